"""What a lifecycle operation can fail with, in the domain's words.

Why not HTTP errors: the sweeper, the data plane and the dashboard call the same
operations as the API. Each kind below means one thing to every caller; only the API
edge (``api.errors``) turns it into a status code, E2B's JSON and headers.
"""


class LifecycleError(Exception):
    """``message`` is for people; ``code`` a stable snake_case name for programs (e.g.
    the node's failure kind); ``retry`` False tells clients a retry cannot help."""

    def __init__(self, message: str, *, code: str | None = None, retry: bool = True):
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry = retry
        self.kind = type(self).__name__  # for event logs: what failed (e.g. the node's error class)


class NotFound(LifecycleError):
    """No such sandbox or snapshot for this team (or it is gone)."""


class Unauthenticated(LifecycleError):
    """The caller's credential is unknown (e.g. a node's join token or credential, nodes.join)."""


class Forbidden(LifecycleError):
    """The thing exists but belongs to another team (where E2B says so rather than hiding it)."""


class RateLimited(LifecycleError):
    """The team is at a limit that frees up with time (e.g. concurrent template builds)."""


class Conflict(LifecycleError):
    """The thing exists but its state does not allow the operation now."""


class Invalid(LifecycleError):
    """The request names something impossible (an unknown template, a count over a limit)."""


class Unavailable(LifecycleError):
    """No node can do it now (none alive, none with room, node unreachable)."""


class NoRoom(Unavailable):
    """Admission refused it: no node has room for it now (placement found none that fits, or
    the node's own memory check said no). Nothing was started and room frees as sandboxes
    end, so the API answers 503 with ``Retry-After`` (``AENV_ADMISSION_RETRY_AFTER``)."""


class Timeout(LifecycleError):
    """The node did not finish within its deadline (the outcome is recorded when it does)."""


class StorageFull(LifecycleError):
    """The snapshot store has no room."""


class Failed(LifecycleError):
    """The node tried and failed (``code`` names the node's error kind)."""


# Node failures (the class name raised on the node) that say the request cannot be honoured
# there, not that the node broke: an egress policy its network backend cannot enforce (the
# slirp fallback cannot filter). They are Invalid (400), never Failed.
REFUSED_BY_NODE = frozenset({"UnsupportedNetworkPolicy", "VolumesUnavailable"})
# The node has no VM for the sandbox (vmm.errors.VMNotFound) although its row says it runs: the
# sandbox is lost (its row goes to error with the event). A 409 saying so, never a 500.
VM_GONE = frozenset({"VMNotFound"})
# A node's refusals for want of room (vmm.errors.HostMemoryFull, HostDiskFull): another node, or
# later, may do it.
FULL_NODE = frozenset({"HostMemoryFull", "HostDiskFull"})
# A start the node undid because the saved state did not load in time on a loaded host
# (vmm.errors.StateLoadTimeout): nothing ran and the saved state is intact, so it is answered
# like a full node (503 with Retry-After), never as a node that broke.
BUSY_NODE = frozenset({"StateLoadTimeout"})
# The node found the guest agent (envd) not answering and was told not to pause it then
# (agent.guest.GuestUnresponsive): the sandbox keeps running; later, it may answer.
UNRESPONSIVE_GUEST = frozenset({"GuestUnresponsive"})
# E2B's error_code for a plain resume of a pause taken while the guest agent did not answer.
GUEST_UNRESPONSIVE_CODE = "sandbox_snapshot_guest_agent_unresponsive"
# A resume that failed after the guest ran on the only copy of its memory (vmm.errors.MemoryLost):
# the node gave the memory up and kept the disk; the sandbox stays paused, marked
# (Sandbox.memory_lost), and only a resume without memory (a cold boot on its disk) is accepted.
MEMORY_LOST = frozenset({"MemoryLost"})
MEMORY_LOST_CODE = "sandbox_memory_lost"
