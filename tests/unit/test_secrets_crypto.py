"""Sealing secret values (team_secrets.crypto): the key outside the database, made owner-only,
the id and version bound into every ciphertext, a wrong key or an altered row refused."""
import base64
import os
import stat

import pytest

from team_secrets import crypto

KEY = os.urandom(32)


def test_round_trip_and_fresh_nonces():
    a, kid = crypto.seal("hunter2", "sec_1", 1, KEY)
    b, _ = crypto.seal("hunter2", "sec_1", 1, KEY)
    assert a != b and b"hunter2" not in a
    assert crypto.open_sealed(a, kid, "sec_1", 1, KEY) == "hunter2"
    assert kid == crypto.key_id(KEY) and len(kid) == 16


@pytest.mark.parametrize("secret_id, version", [("sec_2", 1), ("sec_1", 2)])
def test_a_ciphertext_moved_to_another_secret_or_version_does_not_open(secret_id, version):
    sealed, kid = crypto.seal("v", "sec_1", 1, KEY)
    with pytest.raises(crypto.Tampered):
        crypto.open_sealed(sealed, kid, secret_id, version, KEY)


def test_an_altered_ciphertext_does_not_open():
    sealed, kid = crypto.seal("value", "sec_1", 1, KEY)
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    with pytest.raises(crypto.Tampered):
        crypto.open_sealed(flipped, kid, "sec_1", 1, KEY)


def test_the_wrong_key_says_so():
    sealed, kid = crypto.seal("value", "sec_1", 1, KEY)
    other = os.urandom(32)
    with pytest.raises(crypto.WrongKey, match="sealed under key"):
        crypto.open_sealed(sealed, kid, "sec_1", 1, other)
    with pytest.raises(crypto.Tampered):  # the same key id claimed, another key: still no plaintext
        crypto.open_sealed(sealed, crypto.key_id(other), "sec_1", 1, other)


def test_key_file_is_made_owner_only_once_and_reused(tmp_path):
    path = tmp_path / "home" / "secrets_key"
    first = crypto.load_key(None, path)
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert crypto.load_key(None, path) == first
    path.chmod(0o644)
    assert crypto.load_key(None, path) == first and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_key_from_the_environment_wins_hex_or_base64(tmp_path):
    path = tmp_path / "secrets_key"
    assert crypto.load_key(KEY.hex(), path) == KEY
    assert crypto.load_key(base64.b64encode(KEY).decode(), path) == KEY
    assert not path.exists()
    with pytest.raises(crypto.BadKey, match="32 bytes"):
        crypto.load_key("abcd", path)


@pytest.mark.django_db
def test_rows_sealed_under_one_key_do_not_open_under_another(settings, tmp_path):
    from sandboxes.models import Team  # noqa: PLC0415
    from team_secrets import store  # noqa: PLC0415

    settings.AENV_SECRETS_KEY, settings.AENV_SECRETS_KEY_FILE = "", tmp_path / "one"
    team = Team.objects.create(name="T", slug="t")
    secret = store.create(team, "k", "the value")
    assert store.current_value(secret) == "the value"
    settings.AENV_SECRETS_KEY_FILE = tmp_path / "two"  # another installation's key
    with pytest.raises(crypto.WrongKey):
        store.current_value(secret)


@pytest.mark.parametrize("key, ok", [("", True), ("ab" * 32, True), (base64.b64encode(KEY).decode(), True),
                                     ("change-me", False), ("ab" * 31, False)],
                         ids=["unset", "hex", "base64", "not-a-key", "short-hex"])  # KEY is random: ids must not be
def test_a_malformed_key_stops_the_settings_from_loading(tmp_path, key, ok):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    env = {**os.environ, "AENV_SECRETS_KEY": key, "AENV_HOME": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings"}
    done = subprocess.run([sys.executable, "-c", "from django.conf import settings; print(len(settings.AENV_SECRETS_KEY))"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) is ok, done.stderr[-500:]
    if not ok:
        assert "AENV_SECRETS_KEY must be 32 bytes" in done.stderr and key not in done.stderr.replace("AENV_SECRETS_KEY", "")
