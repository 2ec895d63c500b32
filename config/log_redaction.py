"""Credentials never reach a log: signed-URL signatures, access tokens, API keys.

Why: an access log line is a request line, query string included, and a signed file URL
(``/files?…&signature=v1_…``) is a bearer credential for as long as it lives (forever,
without ``signature_expiration``); headers and tokens show up in debug logs and
exception texts. Logs are read by more people, kept longer and shipped further than the
credentials they would leak.

``install()`` (called by the settings, so in every process that runs aenv's Django code:
the API under daphne, the data plane under uvicorn, node workers, the sweeper) puts one
redaction step in front of every handler: a log record factory rewrites each record as
it is made — its message, its string arguments (uvicorn's access log formats its line
from them), its exception and stack text — whatever logger, handler or formatter then
takes it. daphne writes its access log to a stream, not through ``logging``: its line
goes through the same ``redact``.
"""
import logging
import re
from collections.abc import Mapping

REDACTED = "[redacted]"

# Query parameters (and form fields) whose values are credentials.
_PARAMS = r"signature|token|access_?token|accessToken|api_?key|apiKey|x-api-key|x-access-token|password|secret"
_QUERY = re.compile(rf"(?i)(?P<lead>(?:^|[?&;\s\"'(]))(?P<name>{_PARAMS})=(?P<value>[^&\s\"'<>#;)]+)")
# Headers whose values are credentials, in the shapes logs show them: ``Name: value``,
# ``name=value``, a dict's ``'name': 'value'`` or a tuple's ``(b'name', b'value')``.
_HEADERS = (r"x-access-token|x-api-key|x-admin-token|authorization|proxy-authorization|e2b-traffic-access-token"
            r"|x-csrftoken|envd-access-token|accesstoken|envdaccesstoken|trafficaccesstoken")
_HEADER = re.compile(rf"(?i)(?P<name>\b(?:{_HEADERS}))(?P<sep>['\"]?\s*[:=,]\s*(?:b?['\"])?)"
                     r"(?P<value>(?:(?:bearer|basic|token|digest)\s+)?[^\s'\",;&)}\]]+)")
# Cookies carry session ids; their value runs to the end of the header.
_COOKIE = re.compile(r"(?i)(?P<name>\b(?:set-)?cookie)(?P<sep>['\"]?\s*[:=,]\s*(?:b?['\"])?)(?P<value>[^'\"\r\n]+)")
# A platform API key or a person's access token anywhere (sandboxes.models.ApiKey: "e2b_",
# AccessToken: "sk_e2b_" + 40 hex digits), a node's join token or its credential (nodes.join:
# "aenv_join_" + 48, "aenv_node_" + 64 hex digits).
_API_KEY = re.compile(r"\b(?:(?:sk_)?e2b_[0-9a-f]{40}|aenv_join_[0-9a-f]{48}|aenv_node_[0-9a-f]{64})\b")
# A JWT anywhere (a Kubernetes service-account token a node joins with, nodes.join): a JSON
# header and payload, base64url, then the signature.
_JWT = re.compile(r"\beyJ[\w-]+\.eyJ[\w-]+\.[\w-]+")


def redact(text: str) -> str:
    """``text`` with every credential it shows replaced by ``[redacted]``."""
    if not text:
        return text
    text = _QUERY.sub(lambda m: f"{m['lead']}{m['name']}={REDACTED}", text)
    text = _HEADER.sub(lambda m: f"{m['name']}{m['sep']}{REDACTED}", text)
    text = _COOKIE.sub(lambda m: f"{m['name']}{m['sep']}{REDACTED}", text)
    return _JWT.sub(REDACTED, _API_KEY.sub(REDACTED, text))


def _redact_arg(value):
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, bytes):
        return redact(value.decode("latin-1")).encode("latin-1")
    return value


_EXC_FORMATTER = logging.Formatter()


def redact_record(record: logging.LogRecord) -> None:
    """Rewrites ``record`` in place: message, arguments, exception and stack text."""
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    if isinstance(record.args, tuple):
        record.args = tuple(_redact_arg(a) for a in record.args)
    elif isinstance(record.args, Mapping):
        record.args = {k: _redact_arg(v) for k, v in record.args.items()}
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
        message = None
    if message is not None and redact(message) != message:
        # an argument that is no string (a URL object, a request) showed a credential
        record.msg, record.args = redact(message), ()
    if record.exc_info and not record.exc_text:
        record.exc_text = redact(_EXC_FORMATTER.formatException(record.exc_info))
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


def install() -> None:
    """Every log record of this process redacted as it is made (idempotent); daphne's
    access log too."""
    previous = logging.getLogRecordFactory()
    if not getattr(previous, "aenv_redacting", False):
        def factory(*args, **kwargs):
            record = previous(*args, **kwargs)
            redact_record(record)
            return record

        factory.aenv_redacting = True
        logging.setLogRecordFactory(factory)
    _redact_daphne_access_log()


def _redact_daphne_access_log() -> None:
    try:
        from daphne.access import AccessLogGenerator  # noqa: PLC0415 - only where daphne is installed
    except ImportError:
        return
    write_entry = AccessLogGenerator.write_entry
    if getattr(write_entry, "aenv_redacting", False):
        return

    def redacted_entry(self, host, date, request, *args, **kwargs):
        return write_entry(self, host, date, redact(request) if isinstance(request, str) else request,
                           *args, **kwargs)

    redacted_entry.aenv_redacting = True
    AccessLogGenerator.write_entry = redacted_entry
