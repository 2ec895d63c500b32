"""A nudge to this host's data planes after a sandbox's state is written, so that their hot
path (``dataplane.steer``) reads the routable sandboxes again at once rather than at its next
poll.

Why: every state write goes through ``sandboxes.transitions``, in whatever process makes it
(the API, the sweeper, a node's reconcile, the data plane's own auto-resume). The hot path
polls the database every 0.1 s, so a sandbox leaving ``running`` kept its HAProxy entries for
up to a poll after its write (more on a loaded host: the e2e test saw a pause answered
first). A datagram to each data plane's Unix socket costs microseconds and needs no broker
rights (the Redis users' ACLs admit no new channel); a data plane that is not there, not
readable by this process or on another host is simply not nudged, and its poll stays the
fallback. The datagram carries nothing a reader trusts: it only makes it read the database.

No dataplane import here (a domain app does not import the edges): the data plane takes the
socket's name and where it lies from this module.
"""
from __future__ import annotations

import glob
import os
import socket
import tempfile

# In each data plane's run directory (``dataplane.serve.run_dir``), beside HAProxy's admin socket.
SOCKET_NAME = "nudge.sock"
RUN_DIRS = "dataplane-hotpath-*"  # under AENV_HOME (or a link there to the run directory)


def home() -> str:
    """Where the data planes of this host keep their run directories (as ``dataplane.serve``)."""
    return os.environ.get("AENV_HOME") or tempfile.gettempdir()


def sockets() -> list[str]:
    return glob.glob(os.path.join(glob.escape(home()), RUN_DIRS, SOCKET_NAME))


def nudge(sandbox_id: str) -> None:
    """Tells every data plane of this host that ``sandbox_id``'s state was written. Never raises."""
    try:
        paths = sockets()
        if not paths:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            for path in paths:
                try:
                    sock.sendto(sandbox_id.encode()[:128], path)
                except OSError:  # gone, full, or not ours to write to: its poll will see it
                    pass
    except OSError:
        pass
