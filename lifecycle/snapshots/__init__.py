"""Snapshots and forks on the sandbox lifecycle core (``lifecycle.sandboxes.core``):

- snapshot: ``running → snapshotting → running``; the node captures the VM into its
  snapshot store and the Snapshot row goes ``creating → ready`` (or ``error``, with
  nothing left on disk);
- fork: ``running → forking → running`` for the parent; ``count`` child rows are inserted
  ``creating`` up front (on the parent's node while it has room; with the S3 store the rest
  on other nodes, restored from a stored capture: ``fork_spread``, released by ``captures``)
  and each ends ``running`` or ``error``;
- delete: ``ready → deleting``, refused while a live sandbox restored from the snapshot
  still reads its files; the files go first, then the row.

Imports nothing itself (see ``lifecycle.sandboxes``)."""
