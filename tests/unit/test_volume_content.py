"""``volumes.content``: a volume's files as the content API reaches them, confined to the
volume's directory. Guests write the same directory through their mounts, so the tests
plant what a hostile guest would (symlinks to the host's files, ``..``, a directory swapped
for a symlink) and check that nothing outside the volume is ever read, written, listed,
chmod'ed or removed."""
import os

import pytest

from volumes import content
from volumes.content import VolumeFiles


@pytest.fixture
def outside(tmp_path):
    """A directory beside the volume, with a secret file: what a planted symlink aims at."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_text("host secret")
    return d


@pytest.fixture
def vol(tmp_path):
    root = tmp_path / "vol"
    content.make_root(root)
    return VolumeFiles(root)


def body(*chunks):
    return iter(chunks)


def read(vol, path) -> bytes:
    fd, size = vol.open_file(path)
    data = b"".join(VolumeFiles.chunks(fd))
    assert len(data) == size
    return data


def test_write_read_stat_list_roundtrip(vol):
    entry = vol.write("/a/b/file.txt", body(b"hello ", b"world"), max_bytes=100, mode=0o640)
    assert entry["type"] == "file" and entry["path"] == "/a/b/file.txt" and entry["name"] == "file.txt"
    assert entry["size"] == 11 and entry["mode"] == 0o640
    assert read(vol, "a/b/file.txt") == b"hello world"  # leading slash optional
    assert vol.stat("/a")["type"] == "directory"
    assert [e["path"] for e in vol.list("/")] == ["/a"]
    assert [e["path"] for e in vol.list("/", depth=3)] == ["/a", "/a/b", "/a/b/file.txt"]
    root = vol.stat("/")
    assert root["path"] == "/" and root["type"] == "directory"
    for key in ("atime", "mtime", "ctime"):
        assert entry[key].endswith("Z")


def test_overwrite_is_atomic_and_the_limit_keeps_the_old_file(vol):
    vol.write("/f", body(b"old"), max_bytes=10)
    with pytest.raises(content.TooLarge) as err:
        vol.write("/f", body(b"12345", b"678901"), max_bytes=10)
    assert err.value.status == 413
    assert read(vol, "/f") == b"old"
    assert [e["name"] for e in vol.list("/")] == ["f"]  # no upload leftovers
    assert not [n for n in os.listdir(vol.root) if n != "f"]
    vol.write("/f", body(b"new"), max_bytes=10)
    assert read(vol, "/f") == b"new"


@pytest.mark.parametrize("path", ["../outside/secret", "/a/../../outside", "/./x", "a/./b", "x\x00y",
                                  "/" + "a" * 256, "/" * 4097])
def test_traversal_and_bad_paths_are_refused(vol, path):
    with pytest.raises(content.Invalid):
        vol.stat(path)
    with pytest.raises(content.Invalid):
        vol.write(path, body(b"x"), max_bytes=10)


def test_symlinks_are_never_followed(vol, outside):
    os.symlink(outside, vol.root / "link")  # a guest's symlink to a host directory
    os.symlink(outside / "secret", vol.root / "file-link")
    # stat and list show the symlink itself
    entry = vol.stat("/link")
    assert entry["type"] == "symlink" and entry["target"] == str(outside)
    assert {e["name"]: e["type"] for e in vol.list("/", depth=5)} == {"file-link": "symlink", "link": "symlink"}
    # through it: nothing
    for bad in ("/link/secret", "/link"):
        with pytest.raises((content.Invalid, content.NotFound)):
            vol.open_file(bad)
    with pytest.raises(content.Invalid):
        vol.open_file("/file-link")
    with pytest.raises(content.Invalid):
        vol.stat("/link/secret")
    with pytest.raises(content.Invalid):
        vol.write("/link/new", body(b"x"), max_bytes=10)
    with pytest.raises(content.Invalid):
        vol.mkdir("/link/d", parents=True)
    with pytest.raises(content.Invalid):
        vol.set_meta("/file-link", mode=0o777)
    with pytest.raises(content.Invalid):
        vol.list("/link")
    # a write over a symlink replaces the link, not its target
    vol.write("/file-link", body(b"mine"), max_bytes=10)
    assert vol.stat("/file-link")["type"] == "file"
    assert (outside / "secret").read_text() == "host secret"
    assert sorted(os.listdir(outside)) == ["secret"]
    assert oct((outside / "secret").stat().st_mode & 0o777) != oct(0o777)


def test_removing_a_tree_with_symlinks_keeps_their_targets(vol, outside):
    vol.write("/d/sub/f", body(b"x"), max_bytes=10)
    os.symlink(outside, vol.root / "d" / "sub" / "out")
    vol.remove("/d")
    assert not (vol.root / "d").exists()
    assert (outside / "secret").read_text() == "host secret"
    os.symlink(outside, vol.root / "out")
    vol.remove("/out")  # the link, not the directory it points at
    assert outside.is_dir() and not os.path.lexists(vol.root / "out")
    with pytest.raises(content.Invalid):
        vol.remove("/")
    with pytest.raises(content.NotFound):
        vol.remove("/nothing")


def test_a_directory_swapped_for_a_symlink_is_not_entered(vol, outside):
    vol.mkdir("/work")
    os.rmdir(vol.root / "work")
    os.symlink(outside, vol.root / "work")  # what a guest could do between two requests
    with pytest.raises(content.Invalid):
        vol.write("/work/secret", body(b"overwritten"), max_bytes=100)
    assert (outside / "secret").read_text() == "host secret"


def test_mkdir_parents_and_conflicts(vol):
    with pytest.raises(content.NotFound):
        vol.mkdir("/x/y")
    entry = vol.mkdir("/x/y", parents=True, mode=0o700)
    assert entry["type"] == "directory" and entry["mode"] == 0o700
    with pytest.raises(content.Conflict):
        vol.mkdir("/x/y")
    assert vol.mkdir("/x/y", parents=True)["path"] == "/x/y"  # force: exists is fine
    vol.write("/file", body(b"x"), max_bytes=10)
    with pytest.raises(content.Conflict):
        vol.mkdir("/file", parents=True)
    with pytest.raises(content.Invalid):
        vol.mkdir("/file/sub", parents=True)
    with pytest.raises(content.Invalid):
        vol.write("/x", body(b"x"), max_bytes=10)  # a directory


def test_set_meta_and_owner(vol):
    vol.write("/f", body(b"x"), max_bytes=10)
    assert vol.set_meta("/f", mode=0o600)["mode"] == 0o600
    if os.geteuid() == 0:
        entry = vol.set_meta("/f", uid=1234, gid=4321)
        assert (entry["uid"], entry["gid"]) == (1234, 4321)
        owned = VolumeFiles(vol.root, content.Owner(1000, 1000))
        made = owned.write("/g/h", body(b"y"), max_bytes=10)
        assert (made["uid"], made["gid"]) == (1000, 1000)
        assert (owned.stat("/g")["uid"], owned.stat("/g")["gid"]) == (1000, 1000)
    else:
        with pytest.raises(content.Forbidden):
            vol.set_meta("/f", uid=0)
    with pytest.raises(content.NotFound):
        vol.set_meta("/missing", mode=0o600)


def test_list_is_bounded_and_hides_uploads_in_progress(vol):
    for i in range(5):
        vol.write(f"/f{i}", body(b"x"), max_bytes=10)
    (vol.root / (content._TMP_PREFIX + "abc")).write_bytes(b"partial")
    assert len(vol.list("/")) == 5
    with pytest.raises(content.Invalid):
        vol.list("/", max_entries=4)
    with pytest.raises(content.NotFound):
        vol.list("/nope")
    with pytest.raises(content.Invalid):
        vol.list("/f0")


def test_special_files_are_not_read(vol):
    os.mkfifo(vol.root / "pipe")
    with pytest.raises(content.Invalid):
        vol.open_file("/pipe")
    assert vol.stat("/pipe")["type"] == "unknown"


def test_a_deleted_volume_answers_not_found(tmp_path):
    root = tmp_path / "gone"
    content.make_root(root)
    files = VolumeFiles(root)
    content.remove_root(root)
    content.remove_root(root)  # twice: nothing to do
    with pytest.raises(content.NotFound):
        files.stat("/")
