"""``manage.py ensure_system_templates [--no-wait] [--download-only]``: the system templates
(``code-interpreter-v1``) built from their recipes if they changed (template_builds.system).
Needs a running node worker unless ``--download-only`` (the host-side work: the downloads
and, where the host can, the venv built in the guest's root file system; ``scripts/setup.sh``
does it ahead)."""
from asgiref.sync import async_to_sync
from django.core.management.base import BaseCommand, CommandError

from template_builds.system import code_interpreter
from lifecycle.templates.system import SystemTemplateError, ensure


class Command(BaseCommand):
    help = "Build the system templates (code-interpreter-v1) when their recipe changed; idempotent."

    def add_arguments(self, parser):
        parser.add_argument("--no-wait", action="store_true", help="start the build and return")
        parser.add_argument("--download-only", action="store_true",
                            help="only prepare what the recipes need on the host: downloads from package "
                                 "registries, the venv built in the guest's root file system (no node needed)")
        parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for a build")

    def handle(self, *args, **options):
        def say(message: str) -> None:
            self.stdout.write(message)
            self.stdout.flush()

        try:
            recipe = code_interpreter.recipe(progress=say)
        except code_interpreter.DownloadFailed as exc:
            raise CommandError(str(exc)) from None
        if options["download_only"]:
            say(f"{recipe.alias}: packages ready ({recipe.tag})")
            return
        try:
            async_to_sync(ensure)(recipe, wait=not options["no_wait"], timeout=options["timeout"], say=say)
        except SystemTemplateError as exc:
            raise CommandError(str(exc)) from None
