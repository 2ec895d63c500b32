"""Models: API key format and hashed storage, sandbox ids, visible states."""
import re

import pytest

from sandboxes.models import ApiKey, Team, hash_api_key, new_sandbox_id
from sandboxes.states import E2B_VIEW as E2B_VISIBLE_STATE
from sandboxes.states import SandboxState

pytestmark = pytest.mark.django_db


def test_generated_key_format_and_only_hash_stored():
    team = Team.objects.create(name="T", slug="t")
    key, raw = ApiKey.generate(team, name="ci")
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", raw)
    assert key.key_hash == hash_api_key(raw) and len(key.key_hash) == 64
    assert raw not in key.key_hash and key.prefix == raw[:12]
    stored = ApiKey.objects.get(pk=key.pk)
    assert all(raw not in str(getattr(stored, f.attname)) for f in ApiKey._meta.fields if f.attname != "prefix")
    assert stored.is_active


def test_keys_are_unique():
    team = Team.objects.create(name="T", slug="t")
    raws = {ApiKey.generate(team)[1] for _ in range(20)}
    assert len(raws) == 20


def test_sandbox_ids_are_dns_label_safe():
    for _ in range(50):
        assert re.fullmatch(r"[a-z0-9]{20}", new_sandbox_id())


def test_terminal_states_are_not_visible():
    assert SandboxState.KILLED not in E2B_VISIBLE_STATE and SandboxState.ERROR not in E2B_VISIBLE_STATE
    assert set(E2B_VISIBLE_STATE.values()) == {"running", "paused"}
