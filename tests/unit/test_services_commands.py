"""Management commands: bootstrap (idempotent) and create_api_key."""
import re
import stat
from io import StringIO

import pytest
from django.core.management import call_command

from sandboxes.models import ApiKey, Team, Template, hash_api_key

pytestmark = pytest.mark.django_db


def _run(*args):
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_bootstrap_is_idempotent_and_prints_the_key_once(settings, tmp_path):
    settings.AENV_HOME = tmp_path
    settings.AENV_BASE_CPU_COUNT, settings.AENV_BASE_MEMORY_MB, settings.AENV_BASE_DISK_MB = 1, 384, 1024
    out, _ = _run("bootstrap")
    raw = re.fullmatch(r"AENV_API_KEY=(e2b_[0-9a-f]{40})\n", out).group(1)
    key_file = tmp_path / "api_key"
    assert key_file.read_text().strip() == raw
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    team = Team.objects.get(slug="default")
    assert ApiKey.objects.get(team=team).key_hash == hash_api_key(raw)
    base = Template.objects.get(pk="base")
    assert (base.image, base.cpu_count, base.memory_mb, base.disk_size_mb) == ("base", 1, 384, 1024)

    out2, err2 = _run("bootstrap")
    assert out2 == "" and "already has an active API key" in err2
    assert ApiKey.objects.count() == 1 and Team.objects.count() == 1 and Template.objects.count() == 1
    assert key_file.read_text().strip() == raw

    ApiKey.objects.update(revoked_at="2026-01-01T00:00:00Z")
    out3, _ = _run("bootstrap")
    assert out3.startswith("AENV_API_KEY=") and out3.strip() != f"AENV_API_KEY={raw}"


def test_create_api_key_creates_team_and_prints_once():
    out, err = _run("create_api_key", "--team", "research", "--name", "ci")
    raw = re.fullmatch(r"AENV_API_KEY=(e2b_[0-9a-f]{40})\n", out).group(1)
    key = ApiKey.objects.get(team__slug="research")
    assert key.name == "ci" and key.key_hash == hash_api_key(raw) and "created team" in err
    out2, err2 = _run("create_api_key", "--team", "research")
    assert out2 != out and "created team" not in err2
    assert ApiKey.objects.filter(team__slug="research").count() == 2 and Team.objects.count() == 1
