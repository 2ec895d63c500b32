"""Path resolution, Basic-auth user parsing, exit statuses and clock parsing in envd."""
import base64
import signal

import pytest

from envd.clock import parse_rfc3339, should_set
from envd.processes import exit_status
from envd.users import UnknownUser, base_env, lookup, resolve_path, username_from_basic_auth

HOME = "/home/user"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("a.txt", "/home/user/a.txt"),
        ("d/e/../f", "/home/user/d/f"),
        ("~", "/home/user"),
        ("~/x", "/home/user/x"),
        ("/etc/hosts", "/etc/hosts"),
        ("/tmp/../etc", "/etc"),
        ("//double//slash/", "/double/slash"),
        ("../../..", "/"),
        (".", "/home/user"),
    ],
)
def test_resolve_path(given, expected):
    assert resolve_path(given, HOME) == expected


@pytest.mark.parametrize("bad", ["", None, "a\x00b"])
def test_resolve_path_rejects_empty_and_nul(bad):
    with pytest.raises(ValueError):
        resolve_path(bad, HOME)


def test_basic_auth_username():
    assert username_from_basic_auth("Basic " + base64.b64encode(b"root:").decode()) == "root"
    assert username_from_basic_auth("basic " + base64.b64encode(b"user:").decode()) == "user"
    assert username_from_basic_auth(None) is None
    assert username_from_basic_auth("Bearer abc") is None
    assert username_from_basic_auth("Basic !!!notbase64") is None
    assert username_from_basic_auth("Basic " + base64.b64encode(b":").decode()) is None


def test_lookup_and_base_env():
    pw = lookup("root")
    env = base_env(pw)
    assert env["HOME"] == pw.pw_dir and env["USER"] == "root" and env["LOGNAME"] == "root"
    assert "/usr/bin" in env["PATH"]
    with pytest.raises(UnknownUser):
        lookup("no-such-user-envd-test")


def test_exit_status_like_go():
    assert exit_status(0) == (0, True, "exit status 0", None)
    assert exit_status(3) == (3, True, "exit status 3", "exit status 3")
    assert exit_status(-signal.SIGKILL) == (-1, False, "signal: killed", "signal: killed")
    assert exit_status(-signal.SIGTERM)[2] == "signal: terminated"


def test_rfc3339_parsing_with_nanoseconds_and_offsets():
    assert parse_rfc3339("1970-01-01T00:00:10Z") == 10
    assert parse_rfc3339("1970-01-01T00:00:10.5Z") == 10.5
    assert abs(parse_rfc3339("2026-01-01T00:00:00.123456789Z") - 1767225600.123456789) < 1e-6
    assert parse_rfc3339("1970-01-01T01:00:00+01:00") == 0
    with pytest.raises(ValueError):
        parse_rfc3339("yesterday")


def test_clock_policy():
    assert should_set(100.0, 0.0, "auto", True) is True
    assert should_set(100.5, 100.0, "auto", True) is False  # skew below 1 s
    assert should_set(100.0, 0.0, "auto", False) is False  # never without root
    assert should_set(100.0, 0.0, "never", True) is False
    assert should_set(100.0, 100.0, "always", True) is True
