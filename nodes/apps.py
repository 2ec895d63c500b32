from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    default_auto_field = "django.db.models.BigAutoField"
