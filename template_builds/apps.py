from django.apps import AppConfig


class TemplateBuildsConfig(AppConfig):
    name = "template_builds"
    verbose_name = "template builds"
    default_auto_field = "django.db.models.BigAutoField"
