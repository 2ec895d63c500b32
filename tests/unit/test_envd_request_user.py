"""envd decides in one place which account a request acts as (``envd.users.request_user``)."""
import pwd
from types import SimpleNamespace

import pytest

from envd.state import DEFAULT_USER, Settings
from envd.users import UnknownUser, request_user, resolve_path


def test_a_named_user_wins_over_the_default():
    assert request_user(Settings(default_user="user"), "root").pw_name == "root"


@pytest.mark.parametrize("name", [None, ""])
def test_no_name_means_the_sandbox_default_user(name):
    assert request_user(Settings(default_user="root"), name).pw_name == "root"


def test_without_any_default_it_is_e2b_s_user(monkeypatch):
    assert DEFAULT_USER == "user" and Settings().default_user == "user"
    seen = []
    monkeypatch.setattr(pwd, "getpwnam", lambda name: seen.append(name) or pwd.getpwuid(0))
    request_user(SimpleNamespace(default_user=None), None)
    assert seen == ["user"]


def test_unknown_users_raise():
    with pytest.raises(UnknownUser):
        request_user(Settings(default_user="no-such-user-envd-test"), None)
    with pytest.raises(UnknownUser):
        request_user(Settings(), "no-such-user-envd-test")


@pytest.mark.parametrize("home", ["", "relative/home"])
def test_a_home_that_is_not_absolute_still_gives_absolute_paths(home):
    """A passwd entry without an absolute home must not leave a relative path relative:
    envd's permission walk goes up to "/" and would never get there."""
    assert resolve_path("a.txt", home) == "/a.txt"
    assert resolve_path("~/b", home) == "/b"
