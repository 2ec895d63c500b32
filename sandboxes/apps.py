from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "sandboxes"
    default_auto_field = "django.db.models.BigAutoField"
