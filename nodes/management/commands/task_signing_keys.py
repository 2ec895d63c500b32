"""Makes the control plane's task-signing key and certificate (``nodes.signing``) if they
are missing: the single-machine start and the test stacks run it, so their nodes accept
only signed tasks; a multi-host deployment runs it once and hands the certificate to its
nodes (``AENV_TASK_SIGNING_CERT``) and the key only to the control plane."""
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.signing import write_keys


class Command(BaseCommand):
    help = "Create the task-signing key (0600) and self-signed certificate in a directory unless both exist."

    def add_arguments(self, parser):
        parser.add_argument("--dir", default=None,
                            help="where key.pem and cert.pem go (default AENV_TASK_SIGNING_DIR, AENV_HOME/task-signing)")

    def handle(self, *args, dir=None, **options):  # noqa: A002 - the option's name
        key, cert, created = write_keys(Path(dir) if dir else settings.AENV_TASK_SIGNING_DIR)
        self.stdout.write(f"{'created' if created else 'kept'}: key {key}, certificate {cert}")
