"""Sandbox-wide mutable settings pushed by /init (env vars, token, defaults)."""

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENVD_VERSION = "0.6.4"


class Settings:
    """Everything /init may change plus the CLI options that shape behaviour."""

    def __init__(self, default_user="user", default_workdir=None, max_upload_bytes=1 << 30,
                 set_clock="auto", access_token=None, credit_entropy="auto"):
        self.env_vars = {}
        self.access_token = access_token
        self.default_user = default_user
        self.default_workdir = default_workdir
        self.max_upload_bytes = max_upload_bytes
        self.set_clock = set_clock  # "auto" (root + skew > 1 s), "always" or "never"
        self.credit_entropy = credit_entropy  # "auto" (RNDADDENTROPY as root, else mix in) or "never"
