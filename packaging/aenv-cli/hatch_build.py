"""Hatch hooks of the standalone CLI package: its sources live in the repository, two
levels up (``../../aenv_cli`` ...), when built from a clone, and beside this file when built
from the sdist made of them; the version is ``aenv_cli.__version__`` either way."""
import re
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface

# What the CLI needs: its package, the envd client, and the two Django-free modules of
# envd that the client shares with the guest (the Connect wire format, the envd port).
SOURCES = ("aenv_cli", "envd_client", "envd/__init__.py", "envd/wire.py")


def _base(root: str) -> Path:
    here = Path(root)
    return here if (here / "aenv_cli").is_dir() else here.parents[1]


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        base = _base(self.root)
        if base != Path(self.root):  # a clone: bring the sources in (in the sdist they are selected)
            for rel in SOURCES:
                build_data["force_include"][str(base / rel)] = rel


class CustomMetadataHook(MetadataHookInterface):
    def update(self, metadata):
        text = (_base(self.root) / "aenv_cli" / "__init__.py").read_text(encoding="utf-8")
        metadata["version"] = re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)
