"""Creates a dashboard user (or reuses an existing one) and makes them a member of a team."""
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from sandboxes.models import Team


class Command(BaseCommand):
    help = ("Create a dashboard user (or reuse an existing one) and add them to a team. "
            "Without --password a new user gets a generated password, printed once.")

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--team", required=True, help="slug of an existing team (see `bootstrap`)")
        parser.add_argument("--password", default=None, help="set this password (also for an existing user)")

    def handle(self, *args, username, team, password, **options):
        team_obj = Team.objects.filter(slug=team).first()
        if team_obj is None:
            known = ", ".join(Team.objects.values_list("slug", flat=True)) or "none"
            raise CommandError(f"no team with slug {team!r} (known: {known}); `manage.py bootstrap` creates "
                               f"'default', `create_api_key --team SLUG` creates others")
        User = get_user_model()
        generated = None
        with transaction.atomic():
            user, created = User.objects.get_or_create(username=username)
            if password:
                user.set_password(password)
                user.save()
            elif created:
                generated = secrets.token_urlsafe(12)
                user.set_password(generated)
                user.save()
            team_obj.members.add(user)
        self.stderr.write(f"{'created' if created else 'updated'} user {username}; member of team {team_obj.slug}")
        if generated:
            self.stdout.write(f"password: {generated}")
        elif not created and not password:
            self.stderr.write("password unchanged")
