from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The E2B-compatible REST edge (no models of its own)."""

    name = "api"

    def ready(self):
        from api import schema  # noqa: F401 - registers the OpenAPI auth extension
