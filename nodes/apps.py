from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Task signing before anything is sent or consumed; a signing key or certificate that
        # is missing or not valid stops the process here, at start.
        from nodes.celery_app import setup_signing  # noqa: PLC0415

        setup_signing()
