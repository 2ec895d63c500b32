"""Prints the requirement of one package of pyproject.toml's test extra (e.g. ``moto``,
``pyinstaller``), so an image that needs only that package installs the version the tests run
with, without a second copy of the pin. Run by the Dockerfiles: ``python3 pin.py pyinstaller``."""

import re
import sys
import tomllib
from pathlib import Path

name = sys.argv[1].lower()
pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
for requirement in pyproject["project"]["optional-dependencies"]["test"]:
    if re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0].lower() == name:
        print(requirement)
        sys.exit(0)
sys.exit(f"pin.py: no {name} in pyproject.toml's test extra")
