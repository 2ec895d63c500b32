"""A volume's size limit (``AENV_VOLUME_MAX_MB``, volumes.image) on the real ASGI app: a new
volume is an ext4 filesystem of that size of its own, loop-mounted at its directory; the
content API refuses an upload that does not fit with a 413 naming the limit (the old file
kept), takes what fits, and a delete unmounts it and removes its image. Mounted again when
its directory is found unmounted (a reboot). Needs root (loop mounts)."""
import os
import subprocess

import pytest

from volumes import image, store
from volumes.models import Volume

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")]

OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(autouse=True)
def _store(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    settings.AENV_VOLUME_MAX_MB = 8
    yield
    image.unmount_under(tmp_path)  # whatever a failed test left mounted


async def test_uploads_beyond_the_limit_are_413_and_a_delete_unmounts(api, assert_error, team):
    made = (await api.post("/volumes", json={"name": "small"})).json()
    volume = await Volume.objects.aget(pk=made["volumeID"])
    root = store.volume_root(team.pk, volume.id)
    assert volume.size_mb == 8 and os.path.ismount(root) and image.image_of(root).is_file()
    used, size = image.usage(root)
    assert 5 << 20 < size <= 8 << 20, size  # ext4's own metadata takes the rest
    assert os.listdir(root) == [] and os.stat(root).st_uid == 1000  # no lost+found; the guests' user
    auth = {"Authorization": f"Bearer {made['token']}", "X-API-Key": "", **OCTETS}
    v = made["volumeID"]

    ok = await api.put(f"/volumecontent/{v}/file", params={"path": "/a.bin"}, content=b"a" * (1 << 20), headers=auth)
    assert ok.status_code == 201, ok.text
    resp = await api.put(f"/volumecontent/{v}/file", params={"path": "/a.bin"}, content=b"b" * (9 << 20), headers=auth)
    assert_error(resp, 413, "its limit is 8 MiB")
    assert (await api.get(f"/volumecontent/{v}/file", params={"path": "/a.bin"}, headers=auth)).content == b"a" * (1 << 20)
    assert [e["name"] for e in (await api.get(f"/volumecontent/{v}/dir", params={"path": "/"}, headers=auth)).json()] \
        == ["a.bin"]  # the refused upload left nothing

    subprocess.run(["umount", str(root)], check=True)  # a reboot: the next request mounts it again
    listed = await api.get(f"/volumecontent/{v}/dir", params={"path": "/"}, headers=auth)
    assert [e["name"] for e in listed.json()] == ["a.bin"] and os.path.ismount(root)

    assert (await api.delete(f"/volumes/{v}")).status_code == 204
    assert not root.exists() and not image.image_of(root).exists() and image.mounts_under(root.parent) == []


async def test_without_a_limit_a_volume_is_a_plain_directory(api, settings, team):
    settings.AENV_VOLUME_MAX_MB = 0
    made = (await api.post("/volumes", json={"name": "plain"})).json()
    root = store.volume_root(team.pk, made["volumeID"])
    assert root.is_dir() and not os.path.ismount(root) and not image.image_of(root).exists()
    assert (await Volume.objects.aget(pk=made["volumeID"])).size_mb == 0


async def test_no_image_on_a_shared_store(api, assert_error, monkeypatch):
    """Two machines loop-mounting one image from NFS or CephFS would wreck it: a store there
    needs AENV_VOLUME_MAX_MB=0 (and the store's own quotas); a create says so (503)."""
    monkeypatch.setattr(image, "filesystem_type", lambda path: "nfs")
    assert_error(await api.post("/volumes", json={"name": "shared"}), 503, "AENV_VOLUME_MAX_MB=0")
    assert await Volume.objects.acount() == 0


def test_an_unset_limit_is_the_default_where_it_holds_and_none_elsewhere(settings, monkeypatch, tmp_path):
    """AENV_VOLUME_MAX_MB unset: limited volumes where this process can make them (root, a
    local store), plain ones otherwise (an API run as its own user, a store shared between
    machines), so such deployments keep creating volumes; a limit set there is refused (503)."""
    from volumes.models import default_size_mb  # noqa: PLC0415

    settings.AENV_VOLUME_MAX_MB = None
    settings.AENV_VOLUMES_DIR = tmp_path / "not-made-yet" / "volumes"
    assert default_size_mb() == image.DEFAULT_MB
    with monkeypatch.context() as m:
        m.setattr(image, "filesystem_type", lambda path: "nfs4")
        assert default_size_mb() == 0
    with monkeypatch.context() as m:
        m.setattr(os, "geteuid", lambda: 1000)
        assert default_size_mb() == 0
    settings.AENV_VOLUME_MAX_MB = 64
    with monkeypatch.context() as m:
        m.setattr(os, "geteuid", lambda: 1000)
        assert default_size_mb() == 64
