"""The node protocol: the names of the tasks the control plane sends to a node's queue
(``node.<id>``) and the node agent (``agent.tasks``) runs. Both sides import these, and
nothing else of each other. Payloads: the keyword arguments of ``nodes.client``'s calls."""

BOOT_SANDBOX = "nodes.boot_sandbox"
KILL_SANDBOX = "nodes.kill_sandbox"
PAUSE_SANDBOX = "nodes.pause_sandbox"
RESUME_SANDBOX = "nodes.resume_sandbox"
SNAPSHOT_SANDBOX = "nodes.snapshot_sandbox"
COMMIT_SNAPSHOT = "nodes.commit_snapshot"
INDEX_SNAPSHOT = "nodes.index_snapshot"
RESTORE_SANDBOX = "nodes.restore_sandbox"
FORK_SANDBOX = "nodes.fork_sandbox"
DELETE_SNAPSHOT_FILES = "nodes.delete_snapshot_files"
UPDATE_NETWORK = "nodes.update_network"
# Build a template on this node (fire and forget: the builder reports progress and the
# outcome through template_builds.progress, straight into the database).
BUILD_TEMPLATE = "nodes.build_template"


def pause_image_of(sandbox_id: str) -> str:
    """The snapshot-store id under which a node exports a paused sandbox (agent.moves), so
    another node can resume it (lifecycle.sandboxes.pause)."""
    return f"pause-{sandbox_id}"[:64]


# The host figure a node's heartbeat carries when it takes INDEX_SNAPSHOT and restores with
# ``pending_wait`` (a fork's capture handed over before its upload ends: peer fetch is on).
FORK_HANDOFF = "forkHandoff"


def queue_of(node_id: str) -> str:
    return f"node.{node_id}"
