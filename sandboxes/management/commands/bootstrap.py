"""Makes a fresh install usable: default team, the ``base`` template, and an API key.

Idempotent: run it on every start. A key is created (and printed as
``AENV_API_KEY=e2b_…``) only when the default team has no active key. The raw key
is also written to ``$AENV_HOME/api_key`` (mode 0600) so the single-node dev
scripts can show it again; that file is the *only* copy of the raw key (the
database keeps its hash). Multi-user setups should delete it and use
``create_api_key`` instead."""
import os

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

from sandboxes.models import ApiKey, Team, Template

DEFAULT_TEAM = "default"


class Command(BaseCommand):
    help = "Ensure the default team, the base template and an API key exist (idempotent)."

    def handle(self, *args, **options):
        with transaction.atomic():
            team, _ = Team.objects.get_or_create(slug=DEFAULT_TEAM, defaults={"name": "Default"})
            template, created = Template.objects.get_or_create(
                id="base",
                defaults=dict(alias="base", public=True, image="base", cpu_count=settings.AENV_BASE_CPU_COUNT,
                              memory_mb=settings.AENV_BASE_MEMORY_MB, disk_size_mb=settings.AENV_BASE_DISK_MB),
            )
            if not created:  # follow the configured size on every start
                Template.objects.filter(pk=template.pk).update(
                    cpu_count=settings.AENV_BASE_CPU_COUNT, memory_mb=settings.AENV_BASE_MEMORY_MB,
                    disk_size_mb=settings.AENV_BASE_DISK_MB)
            raw = None
            if not ApiKey.objects.filter(team=team, revoked_at__isnull=True).exists():
                _, raw = ApiKey.generate(team, name="bootstrap")
        key_file = settings.AENV_HOME / "api_key"
        if raw is None:
            self.stderr.write(f"team {DEFAULT_TEAM} already has an active API key"
                              + (f" (see {key_file})" if key_file.exists() else ""))
            return
        key_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(raw + "\n")
        os.chmod(key_file, 0o600)  # also when the file existed with wider permissions
        self.stderr.write(f"created an API key for team {DEFAULT_TEAM}; saved to {key_file}")
        self.stdout.write(f"AENV_API_KEY={raw}")
