"""Signed-URL checks must match the official SDK's signature algorithm exactly."""
import json
import subprocess
import sys
import time

import pytest

from envd.auth import EXPIRED_MESSAGE, AuthError, check_signature, make_signature, token_matches


def _sdk_signature(path, op, user, token, expiration_in):
    # The SDK's protobuf modules clash with envd's in one process; ask a child.
    code = (
        "import json,sys;from e2b.sandbox.signature import get_signature;"
        "a=json.loads(sys.argv[1]);print(json.dumps(get_signature(*a)))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps([path, op, user, token, expiration_in])],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_signature_matches_sdk_without_expiration():
    sdk = _sdk_signature("/home/user/x.txt", "read", None, "tok-1", None)
    assert sdk["signature"] == make_signature("/home/user/x.txt", "read", "", "tok-1")
    check_signature("tok-1", "/home/user/x.txt", "read", "", sdk["signature"], None)


def test_signature_matches_sdk_with_expiration_and_user():
    sdk = _sdk_signature("b.txt", "write", "root", "tok-2", 60)
    check_signature("tok-2", "b.txt", "write", "root", sdk["signature"], str(sdk["expiration"]))
    with pytest.raises(AuthError):  # wrong operation
        check_signature("tok-2", "b.txt", "read", "root", sdk["signature"], str(sdk["expiration"]))
    with pytest.raises(AuthError):  # wrong user
        check_signature("tok-2", "b.txt", "write", "", sdk["signature"], str(sdk["expiration"]))


def test_expired_signature_has_exact_message():
    exp = int(time.time()) - 5
    sig = make_signature("/a", "read", "", "tok", exp)
    with pytest.raises(AuthError) as exc:
        check_signature("tok", "/a", "read", "", sig, str(exp))
    assert str(exc.value) == EXPIRED_MESSAGE == "signature is already expired"


def test_a_forged_signature_is_invalid_whatever_expiration_it_claims():
    """E2B's order: the signature first, so a forger never learns about the expiration."""
    past = int(time.time()) - 5
    with pytest.raises(AuthError) as exc:
        check_signature("tok", "/a", "read", "", make_signature("/a", "read", "", "other", past), str(past))
    assert str(exc.value) == "invalid signature"


def test_tampered_or_missing_signature_fails():
    sig = make_signature("/a", "read", "", "tok")
    with pytest.raises(AuthError):
        check_signature("other", "/a", "read", "", sig, None)
    with pytest.raises(AuthError):
        check_signature("tok", "/a", "read", "", "", None)
    with pytest.raises(AuthError):
        check_signature("tok", "/a", "read", "", sig, "not-a-number")


def test_token_matches():
    assert token_matches("abc", "abc")
    assert not token_matches("abc", "abd")
    assert not token_matches("abc", None)
    assert not token_matches(None, "abc")
