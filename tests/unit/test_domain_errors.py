"""The lifecycle's domain errors become HTTP in one table at the API edge."""
import pytest
from rest_framework.response import Response

from api.errors import STATUS, e2b_exception_handler, status_of
from sandboxes import errors as domain


@pytest.mark.parametrize("kind, status", [
    (domain.Invalid, 400), (domain.NotFound, 404), (domain.Conflict, 409), (domain.Failed, 500),
    (domain.Unavailable, 503), (domain.Timeout, 504), (domain.StorageFull, 507),
])
def test_each_domain_error_has_one_status(kind, status):
    assert status_of(kind("x")) == status
    response = e2b_exception_handler(kind("what happened", code="some_code"), {})
    assert isinstance(response, Response) and response.status_code == status
    assert response.data == {"code": status, "message": "what happened", "error_code": "some_code"}
    assert "Should-Retry" not in response.headers


def test_every_kind_is_in_the_table_and_no_retry_is_said():
    kinds = {c for c in vars(domain).values() if isinstance(c, type) and issubclass(c, domain.LifecycleError)}
    assert kinds - {domain.LifecycleError} == set(STATUS)
    response = e2b_exception_handler(domain.Unavailable("no node", retry=False), {})
    assert response.status_code == 503 and response.headers["Should-Retry"] == "false"
    assert response.data == {"code": 503, "message": "no node"}
    assert "Retry-After" not in response.headers  # not an admission refusal: room is no matter


def test_an_admission_refusal_says_when_to_try_again():
    """NoRoom (issue 27): 503 + Retry-After (AENV_ADMISSION_RETRY_AFTER), whatever its retry flag."""
    from django.test import override_settings  # noqa: PLC0415

    with override_settings(AENV_ADMISSION_RETRY_AFTER=7):
        refused = e2b_exception_handler(domain.NoRoom("no node has room", retry=False), {})
        resume = e2b_exception_handler(domain.NoRoom("cannot be resumed now"), {})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
    assert refused.headers["Should-Retry"] == "false"
    assert resume.headers["Retry-After"] == "7" and "Should-Retry" not in resume.headers


def test_no_database_connection_is_503_not_500():
    """A pool that has no connection to give (or a database down or locked) is a
    transient condition the client may retry, with a JSON body, not an 'internal error'."""
    from django.db import OperationalError  # noqa: PLC0415

    response = e2b_exception_handler(OperationalError("couldn't get a connection after 30.00 sec"), {})
    assert response.status_code == 503
    assert response.data == {"code": 503, "message": "the database is busy or unreachable; try again"}
