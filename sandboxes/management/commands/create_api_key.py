"""Creates an API key for a team (creating the team if needed) and prints it once."""
from django.core.management.base import BaseCommand
from django.utils.text import slugify

from sandboxes.models import ApiKey, Team


class Command(BaseCommand):
    help = "Create an API key for a team; the raw key is printed once (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("--team", required=True, help="team slug (created if missing)")
        parser.add_argument("--name", default="default", help="a label for the key")

    def handle(self, *args, team, name, **options):
        slug = slugify(team)
        if not slug:
            from django.core.management.base import CommandError  # noqa: PLC0415

            raise CommandError(f"invalid team slug {team!r}")
        team_obj, created = Team.objects.get_or_create(slug=slug, defaults={"name": team})
        key, raw = ApiKey.generate(team_obj, name=name)
        if created:
            self.stderr.write(f"created team {slug}")
        self.stderr.write(f"created key {key.prefix}… for team {slug}; it is shown only now:")
        self.stdout.write(f"AENV_API_KEY={raw}")
