"""Creates an access token (E2B's ``sk_e2b_…``) for a user and prints it once: a person's
first token, from which ``POST /access-tokens`` makes more (the dashboard's session can too)."""
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from sandboxes.api_keys import clean_name
from sandboxes.errors import Invalid
from sandboxes.models import AccessToken


class Command(BaseCommand):
    help = "Create an access token for a user; the raw token is printed once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True, help="the user's username")
        parser.add_argument("--name", default="cli", help="a label for the token")

    def handle(self, *args, user, name, **options):
        person = get_user_model().objects.filter(username=user, is_active=True).first()
        if person is None:
            raise CommandError(f"no active user {user!r}")
        try:
            name = clean_name(name)
        except Invalid as exc:
            raise CommandError(exc.message) from None
        token, raw = AccessToken.generate(person, name)
        teams = ", ".join(person.teams.order_by("created_at").values_list("slug", flat=True)) or "none yet"
        self.stderr.write(f"created access token {token.prefix}… for {user} (teams: {teams}); it is shown only now:")
        self.stdout.write(f"E2B_ACCESS_TOKEN={raw}")
