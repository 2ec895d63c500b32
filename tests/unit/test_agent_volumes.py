"""The node's volume step (``agent.volumes``) refuses what it cannot serve before a guest
runs without its volumes: no network slot (the slirp fallback, a driver without slots), a
volume directory outside ``AENV_VOLUMES_DIR`` or missing on this node; and it asks a guest to
mount only what its memory does not have yet."""
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from agent import volumes as guest_volumes
from vmm.net import nfs_guard, volume_server


@pytest.fixture
def store(settings, tmp_path):
    settings.AENV_VOLUMES_DIR = tmp_path / "volumes"
    settings.AENV_HOME = tmp_path / "home"
    (tmp_path / "volumes" / "team" / "vol").mkdir(parents=True)
    return tmp_path / "volumes"


VOL = {"dir": "team/vol", "export_id": 3, "path": "/data", "mount": True}


class NoSlots:
    def slot_of(self, sandbox_id):
        return None


@pytest.fixture(autouse=True)
def _server_installed(monkeypatch):
    monkeypatch.setattr(volume_server, "available", lambda: None)


def test_nothing_to_serve_is_nothing_to_do(store):
    guest_volumes.serve(object(), "s1", None)
    guest_volumes.serve(object(), "s1", [])


@pytest.mark.parametrize("driver", [NoSlots(), object()])
def test_no_slot_is_refused(store, driver):
    with pytest.raises(guest_volumes.VolumesUnavailable, match="netns"):
        guest_volumes.serve(driver, "s1", [VOL])


@pytest.mark.parametrize("bad", ["../elsewhere", "team/../../etc", "team/missing"])
def test_directories_outside_the_store_or_missing_are_refused(store, bad):
    slot = object()
    driver = SimpleNamespace(slot_of=lambda sid: slot)
    with mock.patch.object(volume_server, "start") as start, pytest.raises(guest_volumes.VolumesUnavailable):
        guest_volumes.serve(driver, "s1", [{**VOL, "dir": bad}])
    start.assert_not_called()


def test_serve_exports_each_volume_once(store):
    slot = object()
    driver = SimpleNamespace(slot_of=lambda sid: slot)
    with mock.patch.object(volume_server, "start") as start, mock.patch.object(volume_server, "open_ports") as ports:
        guest_volumes.serve(driver, "s1", [VOL, {**VOL, "path": "/again", "mount": False}])
    (args, kwargs), = start.call_args_list
    assert args[0] is slot and args[2] == Path(store.parent / "home" / "volume-servers" / "s1")
    secret = (store / guest_volumes.HANDLE_SECRET).read_bytes()
    assert args[1] == [volume_server.Export(3, str((store / "team" / "vol").resolve()), "/3",
                                            nfs_guard.volume_key(secret, "team/vol"))]
    ports.assert_called_once_with(slot)


def test_the_handle_secret_is_made_once_private_and_shared(store):
    """Every node derives the same volume keys from the store's secret: a guest's handles stay
    good when it resumes or forks elsewhere; each volume's key is its own."""
    first = guest_volumes.handle_secret()
    path = store / guest_volumes.HANDLE_SECRET
    assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert guest_volumes.handle_secret() == first
    assert nfs_guard.volume_key(first, "team/vol") != nfs_guard.volume_key(first, "team/other")
    assert nfs_guard.volume_key(first, "team/vol") != nfs_guard.volume_key(b"x" * 32, "team/vol")
    path.write_bytes(b"short")
    with pytest.raises(guest_volumes.VolumesUnavailable, match="no usable secret"):
        guest_volumes.handle_secret()


def test_a_node_without_the_server_refuses(store, monkeypatch):
    monkeypatch.setattr(volume_server, "available", lambda: "ganesha.nfsd is not installed")
    with pytest.raises(guest_volumes.VolumesUnavailable, match="ganesha"):
        guest_volumes.serve(SimpleNamespace(slot_of=lambda sid: object()), "s1", [VOL])


def test_mount_asks_the_guest_only_for_what_it_lacks(store):
    info = SimpleNamespace(envd_host="127.0.0.1", envd_port=1)
    with mock.patch("agent.volumes.EnvdClient") as envd:
        guest_volumes.mount(info, None, [{**VOL, "mount": False}])
        envd.at.assert_not_called()
        run = envd.at.return_value.__enter__.return_value.run_argv
        run.return_value = SimpleNamespace(exit_code=0, stdout=b"", stderr=b"")
        guest_volumes.mount(info, "tok", [{**VOL, "mount": False}], everything=True)
        envd.at.assert_called_once_with("127.0.0.1", 1, "tok")
        script = run.call_args.args[1][1]
        assert "mount -i -t nfs" in script and "169.254.0.22:/3 /data" in script
        assert run.call_args.kwargs["user"] == "root"
        run.return_value = SimpleNamespace(exit_code=32, stdout=b"", stderr=b"mount: permission denied")
        with pytest.raises(guest_volumes.MountFailed, match="permission denied"):
            guest_volumes.mount(info, "tok", [VOL])


def test_servers_of_vms_that_no_longer_run_are_stopped(store, settings):
    from vmm.driver import VMStatus

    root = Path(settings.AENV_HOME) / "volume-servers"
    statuses = {"runs": VMStatus.RUNNING, "frozen": VMStatus.PAUSED, "saved": VMStatus.SAVED, "gone": VMStatus.UNKNOWN}
    for sid in statuses:
        (root / sid).mkdir(parents=True)
        (root / sid / "ganesha.conf").write_text("")
    driver = SimpleNamespace(inspect=lambda sid: SimpleNamespace(status=statuses[sid]))
    with mock.patch.object(volume_server, "stop") as stop:
        assert guest_volumes.stop_orphans(driver) == ["gone", "saved"]
    assert sorted(c.args[0].name for c in stop.call_args_list) == ["gone", "saved"]
    assert sorted(p.name for p in root.iterdir()) == ["frozen", "runs"]


def test_a_guest_without_an_nfs_client_is_a_refusal(store):
    info = SimpleNamespace(envd_host="127.0.0.1", envd_port=1)
    with mock.patch("agent.volumes.EnvdClient") as envd:
        run = envd.at.return_value.__enter__.return_value.run_argv
        run.return_value = SimpleNamespace(exit_code=volume_server.NO_NFS_EXIT, stdout=b"no nfs", stderr=b"")
        with pytest.raises(guest_volumes.VolumesUnavailable, match="no NFS client"):
            guest_volumes.mount(info, None, [VOL])
