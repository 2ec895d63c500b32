"""Sandbox-wide mutable settings pushed by /init (env vars, token, defaults), and the
template's defaults read from the root disk."""
import json
import logging

from . import trust

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENVD_VERSION = "0.6.4"
# The account of requests that name none when neither the template nor /init names a default
# (E2B's templates: `user`, home /home/user). envd.users.request_user is where it applies.
DEFAULT_USER = "user"
# Written by aenv's template builder into the template's disk (USER, WORKDIR and ENV of the
# build): every sandbox of the template, however it starts (a restore, a cold boot on its
# disk, a fork, a template built from it), gets them without the node having to know them.
TEMPLATE_DEFAULTS = "/etc/aenv/template.json"

log = logging.getLogger(__name__)


class Settings:
    """Everything /init may change plus the CLI options that shape behaviour."""

    def __init__(self, default_user=DEFAULT_USER, default_workdir=None, max_upload_bytes=1 << 30,
                 set_clock="auto", access_token=None, credit_entropy="auto", template_file=TEMPLATE_DEFAULTS,
                 trust_root="/"):
        self.env_vars = {}
        self.template_env = {}  # the template's ENV; /init's envVars win over them
        # What /aenv/trust asks every process to get (NODE_EXTRA_CA_CERTS…; envd.trust), and
        # the root it installs under (tests: a directory of their own).
        self.trust_env = {}
        self.trust_root = trust_root
        self.access_token = access_token
        self.default_user = default_user
        self.default_workdir = default_workdir
        self.max_upload_bytes = max_upload_bytes
        self.set_clock = set_clock  # "auto" (root + skew > 1 s), "always" or "never"
        self.credit_entropy = credit_entropy  # "auto" (RNDADDENTROPY as root, else mix in) or "never"
        self.template_file = template_file

    def env(self) -> dict:
        """The sandbox-wide environment of new processes: the template's, the installed CA's
        (``envd.trust``), then /init's."""
        return {**self.template_env, **self.trust_env, **self.env_vars}

    def load_trust(self) -> None:
        """Takes the environment of an earlier CA install from the disk (a restarted envd,
        a cold-booted disk), if there is one."""
        self.trust_env = trust.installed_env(self.trust_root)

    def load_template_defaults(self) -> None:
        """Takes the default user, workdir and env vars from the template file, if the disk
        has one (read at start and at every /init: a build writes it while envd runs). A
        file that cannot be read or parsed is logged and ignored."""
        try:
            with open(self.template_file, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring template defaults %s: %s", self.template_file, exc)
            return
        if not isinstance(data, dict):
            log.warning("ignoring template defaults %s: not a JSON object", self.template_file)
            return
        if isinstance(data.get("defaultUser"), str) and data["defaultUser"]:
            self.default_user = data["defaultUser"]
        if isinstance(data.get("defaultWorkdir"), str) and data["defaultWorkdir"]:
            self.default_workdir = data["defaultWorkdir"]
        env = data.get("envVars")
        if isinstance(env, dict):
            self.template_env = {str(k): str(v) for k, v in env.items()}
