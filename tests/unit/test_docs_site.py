"""The documentation site (``mkdocs.yml``, ``docs/``) and the README as its front door.

Why: ``mkdocs build --strict`` fails on a broken link, a page missing from the nav or a missing
anchor, so pages that drift apart fail here (``scripts/test.sh`` builds the site too, before
its long passes). The README must stay a short front door that links every page; every
setting the settings module reads must have its row in ``docs/operations.md``, and every
benchmark script its place in ``docs/benchmarks.md``."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from django.conf import settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 200


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "index.html").is_file() and (site / "e2b-compatibility" / "index.html").is_file()


def test_the_readme_is_a_short_front_door_to_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < README_MAX_LINES
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]*)?\)", readme))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - linked == set(), "README.md does not link these pages"
    assert linked - pages == set(), "README.md links pages that do not exist"


def test_every_setting_has_a_row_in_the_operations_page():
    source = Path(sys.modules[settings.SETTINGS_MODULE].__file__).read_text()
    names = set(re.findall(r'(?:_env(?:_int|_bool)?|os\.environ\.get)\(\s*"([A-Z][A-Z0-9_]*)"', source))
    assert len(names) > 50, names  # the pattern still finds how settings are read
    rows = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)`", (DOCS / "operations.md").read_text(), re.MULTILINE))
    assert names - rows == set(), "settings without a row in docs/operations.md"


def test_every_benchmark_script_is_on_the_benchmarks_page():
    page = (DOCS / "benchmarks.md").read_text()
    scripts = [p for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py"]
    assert scripts
    assert [p.name for p in scripts if p.name not in page] == []
