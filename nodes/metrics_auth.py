"""The bearer check every Prometheus ``/metrics`` of aenv asks when ``AENV_METRICS_TOKEN``
is set: the node's exporter (``agent.prometheus``) and the API's and data plane's
(``config.prometheus``). One place, so the three answer and compare alike; in ``nodes``,
where the control plane and the node agent meet."""
import hmac

UNAUTHORIZED = b"metrics need Authorization: Bearer <AENV_METRICS_TOKEN>\n"
CHALLENGE = 'Bearer realm="aenv metrics"'


def bearer_matches(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
