"""The build VM's side of each step: commands through its envd (``envd_client``), as E2B's
builder runs them (``/bin/bash -l -c`` as the step's user, in the context's workdir, with
the context's env vars; ``/bin/sh -l -c`` in an image without bash), output streamed into
the build log line by line. An image with neither fails its first step (or finalize), saying so.

Helpers that change the file system as root (COPY's placement, WORKDIR's directories,
USER's account, the template defaults) are small POSIX sh scripts run by the tools drive's
busybox (``/opt/aenv/bin/busybox sh``), and every tool they call is an applet of that
busybox too: the image may have no bash, no ``dirname``, no ``useradd`` (busybox,
distroless, a static binary plus ``sh``), or tools that behave otherwise. They take every
path and name from environment variables, never from the script text, so no user-given
string is ever parsed as shell."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from envd_client import EnvdClient, EnvdError
from envd_client.deadline import within

from agent.builder import plan
from agent.builder.log import BuildLog, LineSplitter

# The tools drive's static busybox (vmm.toolsdrive: mounted read-only at /opt/aenv in every guest).
BUSYBOX = "/opt/aenv/bin/busybox"
# The shells a step's command runs with: the first the image has.
SHELLS = ("/bin/bash", "/bin/sh")
NO_SHELL = ("the image has no /bin/sh: a template build runs its steps and start/ready commands with "
            "/bin/bash, else /bin/sh, and the image has neither (add a POSIX shell, e.g. busybox as /bin/sh)")

# Each tool the helpers call is a function running the drive's busybox applet; the image's
# PATH is searched only for what a helper asks for by name (useradd).
_TOOLS = r'''
for t in awk basename cat chmod chown cp date dirname id mkdir mv rm stat tail tar touch; do
  eval "$t() { @BUSYBOX@ $t \"\$@\"; }"
done
'''.replace("@BUSYBOX@", BUSYBOX)

# Creates each missing directory of $1 (absolute) owned by $OWNER (E2B: "newly created
# parts chowned"); existing parts, symlinks included, are left as they are.
_ENSURE_DIR = r'''
ensure_dir() {
  _path="" _rest="${1#/}"
  while [ -n "$_rest" ]; do
    _part="${_rest%%/*}"
    case "$_rest" in */*) _rest="${_rest#*/}" ;; *) _rest="" ;; esac
    [ -n "$_part" ] || continue
    _path="$_path/$_part"
    if [ ! -e "$_path" ] && [ ! -L "$_path" ]; then mkdir "$_path"; chown "$OWNER" "$_path"; fi
  done
  [ -d "$1" ] || { echo "$1 exists and is not a directory" >&2; exit 2; }
}
'''

# COPY (spec §4.2): unpack the archive aside, give the source its owner and mode, then a
# directory's contents are merged into DEST (an existing DEST keeps its own owner and mode;
# a new one is the unpacked directory moved into place, as `cp -a src/. DEST/` would leave
# it but without writing every file twice: a venv of 330 MB took 93 s to unpack and copy
# under TCG), a file goes into DEST when it ends with "/" or is a directory, else becomes
# DEST; symlinks stay links.
COPY_SCRIPT = _TOOLS + _ENSURE_DIR + r'''
set -eu
rm -rf "$WORK"; mkdir -p "$WORK"
if [ "$GZ" = 1 ]; then tar -xzf "$ARCHIVE" -C "$WORK"; else tar -xf "$ARCHIVE" -C "$WORK"; fi
rm -f "$ARCHIVE"
src="$WORK/$SRC"
if [ ! -e "$src" ] && [ ! -L "$src" ]; then echo "COPY: $SRC is not among the uploaded files" >&2; exit 2; fi
chown -hR "$OWNER" "$src"
if [ -n "$MODE" ]; then chmod -R "$MODE" "$src"; fi
dest="${DEST%/}"
if [ -d "$src" ] && [ ! -L "$src" ] && [ -n "$dest" ] && [ ! -e "$dest" ] && [ ! -L "$dest" ]; then
  ensure_dir "$(dirname "$dest")"
  mv "$src" "$dest"
elif [ -d "$src" ] && [ ! -L "$src" ]; then
  keep=""
  if [ -d "$DEST" ]; then keep=$(stat -c '%u:%g %a' "$DEST"); fi
  ensure_dir "$DEST"
  cp -a "$src/." "$DEST/"
  if [ -n "$keep" ]; then chown "${keep% *}" "$DEST"; chmod "${keep#* }" "$DEST"; fi
else
  if [ "$INTO" = 1 ] || [ -d "$DEST" ]; then ensure_dir "$DEST"; target="$DEST/$(basename "$src")"
  else ensure_dir "$(dirname "$DEST")"; target="$DEST"; fi
  if [ -d "$target" ] && [ ! -L "$target" ]; then echo "COPY: $target is a directory" >&2; exit 2; fi
  rm -f "$target"
  cp -a "$src" "$target"
fi
rm -rf "$WORK"
'''

WORKDIR_SCRIPT = _TOOLS + _ENSURE_DIR + r'''
set -eu
ensure_dir "$DIR"
'''

# USER (spec §4.2): a missing account is made with the image's useradd, as E2B's builder
# does; an image without one (busybox, distroless) gets the lines useradd would write:
# /etc/passwd and /etc/group (/etc/shadow, /etc/gshadow if it has them, password locked),
# the first id from 1000 free as uid and gid (an existing group of that name keeps its
# gid), home /home/<name> (0755, from /etc/skel), shell /bin/bash, else /bin/sh. SUDO=1 (the
# implicit default-user phase) also gives it passwordless sudo.
USER_SCRIPT = _TOOLS + r'''
set -eu
end_line() { if [ -s "$1" ] && [ -n "$(tail -c 1 "$1")" ]; then echo >> "$1"; fi; }
add_account() {
  for f in /etc/passwd /etc/group; do
    if [ ! -e "$f" ]; then touch "$f"; chmod 0644 "$f"; fi
    end_line "$f"
  done
  uid=$(awk -F: '{ used[$3] = 1 } END { i = 1000; while (i in used) i++; print i }' /etc/passwd /etc/group)
  gid=$(awk -F: '$1 == ENVIRON["NAME"] { print $3; exit }' /etc/group)
  if [ -z "$gid" ]; then
    gid=$uid
    printf '%s:x:%s:\n' "$NAME" "$gid" >> /etc/group
    if [ -f /etc/gshadow ]; then end_line /etc/gshadow; printf '%s:!::\n' "$NAME" >> /etc/gshadow; fi
  fi
  home="/home/$NAME"
  printf '%s:x:%s:%s::%s:%s\n' "$NAME" "$uid" "$gid" "$home" "$shell" >> /etc/passwd
  if [ -f /etc/shadow ]; then
    end_line /etc/shadow
    printf '%s:!:%s:0:99999:7:::\n' "$NAME" "$(( $(date +%s) / 86400 ))" >> /etc/shadow
  fi
  if [ ! -e "$home" ] && [ ! -L "$home" ]; then
    mkdir -p /home
    mkdir -m 0755 "$home"
    if [ -d /etc/skel ]; then cp -a /etc/skel/. "$home/"; fi
    chown -R "$uid:$gid" "$home"
  fi
}
if ! id -u "$NAME" >/dev/null 2>&1; then
  shell=/bin/sh
  if [ -x /bin/bash ]; then shell=/bin/bash; fi
  if command -v useradd >/dev/null 2>&1; then useradd --create-home --shell "$shell" "$NAME"
  else add_account; fi
fi
if [ "$SUDO" = 1 ] && [ -d /etc/sudoers.d ] && [ ! -e "/etc/sudoers.d/aenv-$NAME" ]; then
  echo "$NAME ALL=(ALL:ALL) NOPASSWD: ALL" > "/etc/sudoers.d/aenv-$NAME"; chmod 0440 "/etc/sudoers.d/aenv-$NAME"
fi
'''

# The template's defaults for envd (envd.state.TEMPLATE_DEFAULTS), from $DEFAULTS_JSON.
DEFAULTS_SCRIPT = _TOOLS + r'''
set -eu
mkdir -p "$(dirname "$FILE")"
printf '%s\n' "$DEFAULTS_JSON" > "$FILE.tmp"; chmod 0644 "$FILE.tmp"; mv -f "$FILE.tmp" "$FILE"
'''

# Prints the first of its arguments that is an executable file in the image (nothing if none).
SHELL_SCRIPT = r'''for s in "$@"; do if [ -f "$s" ] && [ -x "$s" ]; then echo "$s"; exit 0; fi; done'''

# Before the template snapshot: the guest writes back and drops its page cache.
DROP_CACHES_SCRIPT = f"{BUSYBOX} sync; echo 3 > /proc/sys/vm/drop_caches"

# Linux reports free pages to the balloon about every 2 s; a little more lets the report land.
FREE_PAGE_REPORTING_SECONDS = 2.5

# root's login environment, NUL-separated: what the image's login shell exports (the drive's
# busybox prints it: the image's env may lack -0, or be missing).
ROOT_ENV = f"exec {BUSYBOX} env -0"


class StepFailed(Exception):
    """A step ended with an error the user caused (exit status, bad argument); the build
    fails at that step with this message."""


class BuildGuest:
    """The build VM as the steps see it."""

    def __init__(self, host: str, port: int, log: BuildLog, deadline: float):
        self.envd = EnvdClient.at(host, port)
        self.log = log
        self.deadline = deadline  # time.monotonic() when the build times out
        self.shell = ""  # the image's shell, as check_shell() last found it
        self._root_env: dict[str, str] | None = None

    def close(self) -> None:
        self.envd.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise StepFailed("the build timed out")
        return left

    def _exec(self, argv: list[str], *, user: str | None, cwd: str | None, envs: dict | None = None,
              on_stdout=None, on_stderr=None):
        """``argv`` through envd to its end (``run`` would start the image's ``/bin/bash``)."""
        return self.envd.run_argv(argv[0], argv[1:], envs=envs, cwd=cwd, user=user, deadline=self._left(),
                                  on_stdout=on_stdout, on_stderr=on_stderr)

    def check_shell(self) -> str:
        """The shell the next commands run with (/bin/bash, else /bin/sh), asked again before
        each step (a RUN may install bash); StepFailed when the image has none."""
        found = self._exec([BUSYBOX, "sh", "-c", SHELL_SCRIPT, "sh", *SHELLS], user="root", cwd="/")
        self.shell = found.stdout.decode("utf-8", "replace").strip()
        if not self.shell:
            raise StepFailed(NO_SHELL)
        return self.shell

    def run(self, command: str, *, user: str, ctx: plan.Context, prefix: str, step: str, quote: str = "",
            envs: dict | None = None, cwd: str | None = None):
        """``<shell> -l -c command`` as ``user``; its output goes to the log. A non-zero exit
        raises StepFailed (``failed to run command '<quote>': exit status N`` + the last lines)."""
        splitters = {name: LineSplitter(lambda line, n=name: self.log.output(n, line, prefix, step))
                     for name in ("stdout", "stderr")}
        shell = self.shell or self.check_shell()
        try:
            result = self._exec([shell, "-l", "-c", command], envs=plan.command_env(ctx) if envs is None else envs,
                                cwd=cwd if cwd is not None else (ctx.workdir or None), user=user,
                                on_stdout=splitters["stdout"].feed, on_stderr=splitters["stderr"].feed)
        except EnvdError as exc:
            if exc.code == "deadline_exceeded":
                raise StepFailed(f"failed to run command '{quote or command}': the build timed out") from None
            if exc.code in ("invalid_argument", "not_found", "permission_denied"):
                raise StepFailed(f"failed to run command '{quote or command}': {exc.message or exc}") from None
            raise
        for s in splitters.values():
            s.close()
        if not result.ok:
            status = result.status or f"exit status {result.exit_code}"
            tail = "; ".join(list(self.log.tail)[-3:])
            raise StepFailed(f"failed to run command '{quote or command}': {status}"
                             + (f" (last output: {tail})" if tail else ""))
        return result

    def root_script(self, script: str, env: dict[str, str], *, what: str, step: str) -> None:
        """A helper script as root, run by the tools drive's busybox sh; its stderr becomes
        the step's error."""
        result = self._exec([BUSYBOX, "sh", "-c", script], envs={"PATH": ":".join(plan.STANDARD_PATH), **env},
                            cwd="/", user="root")
        if not result.ok:
            detail = (result.stderr or result.stdout).decode("utf-8", "replace").strip().splitlines()
            raise StepFailed(f"{what}: {detail[-1] if detail else result.status or 'failed'}")

    def root_env(self) -> dict[str, str]:
        """root's login environment (ENV values expand against it), asked once."""
        if self._root_env is None:
            shell = self.shell or self.check_shell()
            result = self._exec([shell, "-l", "-c", ROOT_ENV], user="root", cwd="/")
            env = dict(item.split("=", 1) for item in result.stdout.decode("utf-8", "replace").split("\0")
                       if "=" in item)
            env.pop("_", None)  # the shell's last command (the printer itself), not an env var
            self._root_env = env
        return self._root_env

    # -- the step kinds ---------------------------------------------------------------------

    def ensure_user(self, name: str, sudo: bool, step: str) -> None:
        self.root_script(USER_SCRIPT, {"NAME": name, "SUDO": "1" if sudo else "0"}, what=f"USER {name}", step=step)

    def make_workdir(self, path: str, owner: str, step: str) -> None:
        self.root_script(WORKDIR_SCRIPT, {"DIR": path, "OWNER": f"{owner}:{owner}"}, what=f"WORKDIR {path}",
                         step=step)

    def copy(self, archive: Path, gzip: bool, files_hash: str, cp: plan.CopyPlan, step: str) -> None:
        remote = f"/tmp/.aenv-copy-{files_hash[:16]}.tar"
        with within(self._left()):  # the upload as a whole, not only each read, ends with the build
            self.envd.upload_file(remote, archive, user="root")
        self.root_script(COPY_SCRIPT, {"ARCHIVE": remote, "GZ": "1" if gzip else "0", "SRC": cp.source,
                                       "DEST": cp.dest, "INTO": "1" if cp.into else "0", "OWNER": cp.owner,
                                       "MODE": cp.mode, "WORK": f"/tmp/.aenv-copy-{files_hash[:16]}"},
                         what=f"COPY to {cp.dest}", step=step)

    def write_defaults(self, ctx: plan.Context, file: str) -> None:
        """The template's USER, WORKDIR and ENV for envd (read at once by the /init that follows)."""
        data = {"defaultUser": ctx.user, "defaultWorkdir": ctx.workdir or "", "envVars": ctx.env}
        self.root_script(DEFAULTS_SCRIPT, {"FILE": file, "DEFAULTS_JSON": json.dumps(data)},
                         what="writing the template defaults", step="finalize")
        self.envd.init({})

    def sync(self) -> None:
        self.envd.sync()

    def drop_caches(self) -> None:
        """Before the template snapshot: the guest writes back and drops its page cache (the
        build's downloads, archives, compiler output), and the balloon's free page reporting
        hands those pages back to the host, so the snapshot's RAM, which every create copies,
        holds only what the template really keeps in memory."""
        self._exec([BUSYBOX, "sh", "-c", DROP_CACHES_SCRIPT], user="root", cwd="/")
        time.sleep(FREE_PAGE_REPORTING_SECONDS)
        # envd's own pages went too: what a create asks of it first (/init, a command, a
        # file) is read back in now, not at every create's first request
        self.envd.init({})
        self._exec([self.shell or self.check_shell(), "-l", "-c", "true"], user=None, cwd=None)
        self.envd.write_file("/tmp/.aenv-warm", b"warm")
        self.envd.read_file("/tmp/.aenv-warm")
        self._exec([BUSYBOX, "rm", "-f", "/tmp/.aenv-warm"], user="root", cwd="/")


class StartCommand:
    """The template's start command, left running in the VM: started through envd, its
    output logged by a reader thread with a client of its own while the ready command is
    awaited, then detached. Detaching ends the stream from this side (the reader sees a
    keepalive at least every second and stops), so envd drops its subscriber before the
    snapshot: a stream left open would be a dead peer in every sandbox, whose output queue
    would fill and stop the process."""

    def __init__(self, guest: BuildGuest, command: str, ctx: plan.Context, user: str):
        self.guest, self.command = guest, command
        self.exit_code: int | None = None
        self.status = ""
        self.pid = 0
        self._started = threading.Event()
        self._stop = threading.Event()
        self._client = EnvdClient(guest.envd.base_url)
        self._thread = threading.Thread(target=self._read, args=(ctx, user), daemon=True, name="start-cmd")
        self._thread.start()
        self._started.wait(30)

    def _read(self, ctx: plan.Context, user: str) -> None:
        log = self.guest.log
        splitters = {n: LineSplitter(lambda line, n=n: log.output(n, line, "[start]", "finalize"))
                     for n in ("stdout", "stderr")}
        shell = self.guest.shell or SHELLS[0]  # finalize checked it
        events = self._client.start(shell, ["-l", "-c", self.command], envs=plan.command_env(ctx),
                                    cwd=ctx.workdir or None, user=user, tag="aenv-start-cmd", keepalive=1)
        try:
            for ev in events:
                if ev.kind == "start":
                    self.pid = ev.pid or 0
                    self._started.set()
                elif ev.kind == "data" and ev.stream in splitters:
                    splitters[ev.stream].feed(ev.data)
                elif ev.kind == "end":
                    self.exit_code = ev.exit_code if ev.exit_code is not None else -1
                    self.status = ev.status or f"exit status {self.exit_code}"
                if self._stop.is_set():
                    break
        except Exception:  # noqa: BLE001 - the VM went away under the stream: the build ends anyway
            pass
        finally:
            events.close()
            self._client.close()
            self._started.set()

    @property
    def exited(self) -> bool:
        return self.exit_code is not None

    def detach(self) -> None:
        self._stop.set()
        self._thread.join(10)
