"""Which volumes a sandbox mounts, where: checked at create (E2B's 400s), recorded as rows
(what makes a volume "in use"), inherited by fork children and kept with snapshots (their
memory has the mounts in it, so whatever starts from them mounts the same volumes again)."""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from sandboxes.errors import Invalid
from sandboxes.models import Team
from sandboxes.prepared import PreparedQuery
from volumes import rules
from volumes.models import SandboxVolume, SnapshotVolume, Volume


@dataclass(frozen=True)
class Mount:
    volume_id: str
    name: str
    path: str
    team_id: str = ""
    export_id: int = 0

    @classmethod
    def of(cls, volume: Volume, path: str) -> "Mount":
        return cls(volume.id, volume.name, path, str(volume.team_id), volume.export_id)

    def wire(self, mount: bool) -> dict:
        """What a node is told (``agent.volumes``): where the files are under its
        AENV_VOLUMES_DIR, the export id, the guest path, and whether the guest still has to
        mount it. No token: a node never needs the content API's."""
        return {"dir": f"{self.team_id}/{self.volume_id}", "export_id": self.export_id, "path": self.path,
                "mount": mount}


def for_node(mounts: list[Mount], *, to_mount: list[Mount] | None = None) -> list[dict]:
    """A task's ``volumes``: every mount (the server exports them all); ``to_mount`` the ones
    the guest has not mounted yet (None: none)."""
    fresh = set(to_mount or ())
    return [m.wire(m in fresh) for m in mounts]


def check(team: Team, requested: object) -> list[Mount]:
    """E2B's ``volumeMounts`` (``[{name, path}]``) → mounts of the team's volumes; every
    problem at once in E2B's message, as a 400."""
    if requested is None:
        return []
    if not isinstance(requested, list):
        raise Invalid("volumeMounts must be a list of {name, path}")
    if len(requested) > settings.AENV_VOLUME_MAX_MOUNTS:
        raise Invalid(f"at most {settings.AENV_VOLUME_MAX_MOUNTS} volume mounts (AENV_VOLUME_MAX_MOUNTS)")
    names = {m.get("name") for m in requested if isinstance(m, dict) and isinstance(m.get("name"), str)}
    found = {v.name: v for v in Volume.objects.filter(team=team, name__in=names)}
    problems: list[str] = []
    mounts: list[Mount] = []
    for index, item in enumerate(requested):
        if not isinstance(item, dict) or set(item) - {"name", "path"}:
            problems.append(f"volume mount #{index}: must be an object with name and path")
            continue
        volume = found.get(item.get("name")) if isinstance(item.get("name"), str) else None
        if volume is None:
            problems.append(f"volume mount #{index}: volume '{item.get('name')}' not found")
            continue
        reason = rules.path_problem(item.get("path"))
        if reason:
            problems.append(f"volume mount #{index}: {reason}")
            continue
        clash = next((m for m in mounts if rules.nested(m.path, item["path"])), None)
        if clash is not None:
            what = "is already used" if clash.path == item["path"] else f"overlaps '{clash.path}'"
            problems.append(f"volume mount #{index}: path '{item['path']}' {what}")
            continue
        mounts.append(Mount.of(volume, item["path"]))
    if problems:
        raise Invalid("invalid mounts:\n" + "\n".join(f"\t- {p}" for p in problems))
    return mounts


def node_volumes(sandbox_id: str) -> list[dict]:
    """A running or paused sandbox's ``volumes`` for its node (its guest has them mounted)."""
    return for_node(of_sandbox(sandbox_id))


def check_transport(volumes: list[Mount]) -> None:
    """Mounts need the nodes' transport (``AENV_VOLUME_TRANSPORT``): turned off they are a
    400, never a sandbox created without the volumes it asked for."""
    if volumes and settings.AENV_VOLUME_TRANSPORT == "off":
        raise Invalid("volume mounts are turned off on this deployment (AENV_VOLUME_TRANSPORT=off); "
                      "volumes and their content API work without a sandbox")


# A sandbox's and a snapshot's mounts with their SQL compiled once (sandboxes.prepared): read
# by every snapshot, resume and restore (issue 26: compiling cost more than running them).
_OF_SANDBOX = PreparedQuery(lambda key: SandboxVolume.objects.filter(sandbox_id=key).select_related("volume"),
                            key=SandboxVolume._meta.get_field("sandbox").target_field)
_OF_SNAPSHOT = PreparedQuery(lambda key: SnapshotVolume.objects.filter(snapshot_id=key).select_related("volume"),
                             key=SnapshotVolume._meta.get_field("snapshot").target_field)


def of_sandbox(sandbox_id: str) -> list[Mount]:
    return [Mount.of(r.volume, r.path) for r in _OF_SANDBOX.rows(key=sandbox_id)]


def wire_of(sandbox_ids: list[str]) -> dict[str, list[dict]]:
    """E2B's ``volumeMounts`` (``[{name, path}]``) of each sandbox, in one query."""
    out: dict[str, list[dict]] = {}
    for row in SandboxVolume.objects.filter(sandbox_id__in=sandbox_ids).select_related("volume").order_by("path"):
        out.setdefault(row.sandbox_id, []).append({"name": row.volume.name, "path": row.path})
    return out


def of_snapshot(snapshot_id: str) -> list[Mount]:
    return [Mount.of(r.volume, r.path) for r in _OF_SNAPSHOT.rows(key=snapshot_id)]


def record_sandbox(sandbox_id: str, mounts: list[Mount]) -> None:
    SandboxVolume.objects.bulk_create([SandboxVolume(sandbox_id=sandbox_id, volume_id=m.volume_id, path=m.path)
                                       for m in mounts])


def copy_sandbox_mounts(parent_id: str, child_id: str) -> None:
    record_sandbox(child_id, of_sandbox(parent_id))


def record_snapshot(snapshot_id: str, mounts: list[Mount]) -> None:
    SnapshotVolume.objects.bulk_create([SnapshotVolume(snapshot_id=snapshot_id, volume_id=m.volume_id, path=m.path)
                                        for m in mounts])


def merged(inherited: list[Mount], requested: list[Mount]) -> list[Mount]:
    """A snapshot's mounts plus the create's own; a requested one clashing with an inherited
    path is a 400 (the restored guest already has that mount)."""
    for m in requested:
        clash = next((i for i in inherited if rules.nested(i.path, m.path)), None)
        if clash is not None and clash != m:
            raise Invalid(f"invalid mounts:\n\t- path '{m.path}' overlaps '{clash.path}', "
                          f"where the snapshot mounts volume '{clash.name}'")
    return inherited + [m for m in requested if m not in inherited]
