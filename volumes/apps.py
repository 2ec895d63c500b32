from django.apps import AppConfig


class VolumesConfig(AppConfig):
    name = "volumes"
    default_auto_field = "django.db.models.BigAutoField"
