from django.apps import AppConfig


class TeamSecretsConfig(AppConfig):
    name = "team_secrets"
    default_auto_field = "django.db.models.BigAutoField"
