"""Makes the control plane's task-signing key and certificate (``nodes.signing``) if they
are missing: the single-machine start and the test stacks run it, so their nodes accept
only signed tasks; a multi-host deployment runs it once and hands the certificate to its
nodes (``AENV_TASK_SIGNING_CERT``) and the key only to the control plane. The key is Ed25519;
a pair that exists is kept whatever its type (an RSA pair made before keeps working);
``--rotate`` replaces it with a new Ed25519 pair (the old one kept beside as ``*.old``)."""
from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_pem_private_key
from django.conf import settings
from django.core.management.base import BaseCommand

from nodes.signing import ED25519, algorithm_of, write_keys


class Command(BaseCommand):
    help = ("Create the task-signing key (Ed25519, 0600) and self-signed certificate in a directory unless "
            "both exist; --rotate: a new pair even so.")

    def add_arguments(self, parser):
        parser.add_argument("--dir", default=None,
                            help="where key.pem and cert.pem go (default AENV_TASK_SIGNING_DIR, AENV_HOME/task-signing)")
        parser.add_argument("--rotate", action="store_true",
                            help="replace an existing pair with a new Ed25519 one (the old kept as *.old): nodes "
                                 "must trust the new certificate before the control plane restarts with the key")

    def handle(self, *args, dir=None, rotate=False, **options):  # noqa: A002 - the option's name
        key, cert, created = write_keys(Path(dir) if dir else settings.AENV_TASK_SIGNING_DIR, rotate=rotate)
        kind = algorithm_of(load_pem_private_key(key.read_bytes(), password=None))
        self.stdout.write(f"{'created' if created else 'kept'}: key {key} ({kind}), certificate {cert}")
        if kind != ED25519:
            self.stdout.write("the key is RSA (made before Ed25519 was the default): it still signs, at ~1 ms "
                              "of CPU per node task; --rotate makes an Ed25519 pair")
