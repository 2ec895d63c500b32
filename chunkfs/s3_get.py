"""A chunk object's signed GET without botocore's client pipeline: the request signed by
botocore's own SigV4 signer, sent through a urllib3 pool.

Why: a lazy restore fetches every chunk the guest needs before it runs (a 512 MiB guest's
RAM is ~140 one-MiB objects), and the client pipeline (its event hooks, parsers and retry
handlers) costs ~3.7 ms of the node's CPU per GET against ~1.3 ms for the same signed GET
here (measured with moto on loopback): half a second of a busy node's CPU while a guest
waits. Used for stores with an explicit endpoint (path-style URLs: MinIO, Ceph, moto, and
S3 itself when ``AENV_S3_ENDPOINT`` names it); without one the boto3 client stays."""
from __future__ import annotations

from urllib.parse import quote

META = "x-amz-meta-"


class S3GetError(Exception):
    """The GET failed: ``code`` is the HTTP status or the transport error's name."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class SignedGetter:
    """GETs of ``<endpoint>/<bucket>/<key>`` signed with the credentials botocore finds (or
    the ones given), each bounded by the timeouts and retried on 5xx and transport errors."""

    def __init__(self, endpoint: str, bucket: str, region: str = "", *, connect_timeout: float,
                 read_timeout: float, attempts: int, pool: int = 16, credentials=None):
        import botocore.session  # noqa: PLC0415 - only S3 sources need it
        import urllib3  # noqa: PLC0415

        if not endpoint:
            raise ValueError("a signed getter needs the store's endpoint URL")
        self.base = f"{endpoint.rstrip('/')}/{quote(bucket, safe='')}/"
        self.region = region or "us-east-1"
        self.credentials = credentials or botocore.session.get_session().get_credentials()
        if self.credentials is None:
            raise ValueError("no S3 credentials found (environment, config files or instance role)")
        self.timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self.retries = urllib3.Retry(total=max(0, int(attempts) - 1), connect=max(0, int(attempts) - 1),
                                     read=max(0, int(attempts) - 1), status=max(0, int(attempts) - 1),
                                     status_forcelist=(500, 502, 503, 504), allowed_methods=("GET",),
                                     backoff_factor=0.1, raise_on_status=False, redirect=0)
        self.pool = urllib3.PoolManager(maxsize=pool, block=False)

    def _signed_headers(self, url: str) -> dict:
        from botocore.auth import S3SigV4Auth  # noqa: PLC0415
        from botocore.awsrequest import AWSRequest  # noqa: PLC0415

        request = AWSRequest(method="GET", url=url)
        frozen = self.credentials.get_frozen_credentials()  # refreshable ones renew themselves here
        S3SigV4Auth(frozen, "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def get(self, key: str, limit: int) -> tuple[bytes, dict]:
        """(at most ``limit`` bytes of the object's body, its user metadata); ``S3GetError``."""
        import urllib3  # noqa: PLC0415

        url = self.base + quote(key, safe="/")
        try:
            response = self.pool.request("GET", url, headers=self._signed_headers(url), preload_content=False,
                                         timeout=self.timeout, retries=self.retries)
        except urllib3.exceptions.HTTPError as exc:
            raise S3GetError(type(exc).__name__, str(exc)) from exc
        try:
            if response.status != 200:
                raise S3GetError(str(response.status), response.read(512).decode(errors="replace"))
            body = response.read(limit)
            if response.length_remaining:  # more than asked for (a wrong object): not reusable
                response.close()
            metadata = {name[len(META):]: value for name, value in response.headers.items()
                        if name.lower().startswith(META)}
            return body, {k.lower(): v for k, v in metadata.items()}
        except urllib3.exceptions.HTTPError as exc:
            raise S3GetError(type(exc).__name__, str(exc)) from exc
        finally:
            response.release_conn()
