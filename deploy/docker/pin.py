"""Prints requirements from pyproject.toml for the image builds, so an image installs what the
project pins without a second copy of a pin:
  python3 pin.py NAME            one package of the test extra (e.g. moto, pyinstaller)
  python3 pin.py --dependencies  the project's dependencies, one a line (a layer of their own,
                                 rebuilt only when pyproject.toml changes, not with the source)"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
if sys.argv[1] == "--dependencies":
    print("\n".join(project["dependencies"]))
    sys.exit(0)
name = sys.argv[1].lower()
for requirement in project["optional-dependencies"]["test"]:
    if re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower() == name:
        print(requirement)
        sys.exit(0)
sys.exit(f"pin.py: no {name} in pyproject.toml's test extra")
