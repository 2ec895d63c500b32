"""Each installation signs with a key of its own: generated on first start under
AENV_HOME (owner-only), reused afterwards, DJANGO_SECRET_KEY wins, and the old public
default is refused outside debug mode."""
import os
import stat
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from config.secret_key import PUBLIC_DEFAULT_KEY, InsecureSecretKey, load_secret_key

ROOT = Path(__file__).resolve().parents[2]


def test_generated_once_then_reused_owner_only(tmp_path):
    first = load_secret_key(tmp_path, None, debug=False)
    assert len(first) >= 50 and first != PUBLIC_DEFAULT_KEY
    path = tmp_path / "secret_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret_key(tmp_path, None, debug=False) == first
    assert load_secret_key(tmp_path / "other", None, debug=False) != first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_readable_key_file_is_made_owner_only(tmp_path):
    (tmp_path / "secret_key").write_text("k" * 60 + "\n")
    os.chmod(tmp_path / "secret_key", 0o644)
    assert load_secret_key(tmp_path, None, debug=False) == "k" * 60
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600


def test_environment_wins(tmp_path):
    assert load_secret_key(tmp_path, "from-the-environment-" * 3, debug=False) == "from-the-environment-" * 3
    assert not (tmp_path / "secret_key").exists()


@pytest.mark.parametrize("where", ["env", "file"])
def test_public_default_refused_unless_debug(tmp_path, where):
    env = PUBLIC_DEFAULT_KEY if where == "env" else None
    if where == "file":
        (tmp_path / "secret_key").write_text(PUBLIC_DEFAULT_KEY)
    with pytest.raises(InsecureSecretKey, match="public default"):
        load_secret_key(tmp_path, env, debug=False)
    assert load_secret_key(tmp_path, env, debug=True) == PUBLIC_DEFAULT_KEY


def test_processes_starting_together_share_one_key(tmp_path):
    with ProcessPoolExecutor(4) as pool:
        keys = set(pool.map(load_secret_key, [tmp_path] * 16, [None] * 16, [False] * 16))
    assert len(keys) == 1 and keys == {(tmp_path / "secret_key").read_text().strip()}


def _settings_key(home: Path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SECRET_KEY", "DJANGO_DEBUG")}
    full.update(AENV_HOME=str(home), DJANGO_SETTINGS_MODULE="config.settings", **env)
    return subprocess.run([sys.executable, "-c", "from django.conf import settings; print(settings.SECRET_KEY)"],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def test_settings_use_the_generated_key_and_refuse_the_old_default(tmp_path):
    first = _settings_key(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == (tmp_path / "secret_key").read_text().strip() != PUBLIC_DEFAULT_KEY
    assert _settings_key(tmp_path).stdout == first.stdout
    refused = _settings_key(tmp_path, DJANGO_SECRET_KEY=PUBLIC_DEFAULT_KEY)
    assert refused.returncode != 0 and "refusing to start" in refused.stderr
    assert _settings_key(tmp_path, DJANGO_SECRET_KEY=PUBLIC_DEFAULT_KEY, DJANGO_DEBUG="1").returncode == 0
