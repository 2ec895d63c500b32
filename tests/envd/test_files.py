"""files.* through the SDK: write/read/list/stat/mkdir/rename/remove, gzip, metadata, users."""
import os
import pwd

import pytest
from e2b import FileType, NotFoundException
from e2b.exceptions import InvalidArgumentException, AuthenticationException


def test_write_read_text_and_bytes(sandbox, workdir):
    info = sandbox.files.write(f"{workdir}/a.txt", "content A")
    assert info.path == f"{workdir}/a.txt" and info.name == "a.txt"
    assert sandbox.files.read(f"{workdir}/a.txt") == "content A"
    sandbox.files.write(f"{workdir}/b.bin", bytes(range(256)))
    assert sandbox.files.read(f"{workdir}/b.bin", format="bytes") == bytes(range(256))
    st = os.stat(f"{workdir}/a.txt")
    assert pwd.getpwuid(st.st_uid).pw_name == "user" and st.st_mode & 0o777 == 0o644


def test_relative_path_user_and_parent_dirs(sandbox, workdir):
    name = os.path.basename(workdir)
    info = sandbox.files.write(f"{name}/deep/er/c.txt", "C")
    assert info.path == f"{workdir}/deep/er/c.txt"
    st = os.stat(f"{workdir}/deep/er")
    assert pwd.getpwuid(st.st_uid).pw_name == "user" and st.st_mode & 0o777 == 0o755
    r = sandbox.files.write(f"{workdir}/root.txt", "R", user="root")
    assert os.stat(r.path).st_uid == 0
    assert sandbox.files.read("~/" + name + "/deep/er/c.txt") == "C"


def test_gzip_and_octet_stream_upload_and_gzip_download(sandbox, workdir):
    sandbox.files.write(f"{workdir}/g.txt", "gz" * 1000, gzip=True)
    assert open(f"{workdir}/g.txt").read() == "gz" * 1000
    sandbox.files.write(f"{workdir}/o.txt", "oct", use_octet_stream=True)
    assert open(f"{workdir}/o.txt").read() == "oct"
    sandbox.files.write(f"{workdir}/it.txt", iter([b"a", b"b", b"c"]))
    assert open(f"{workdir}/it.txt").read() == "abc"
    assert sandbox.files.read(f"{workdir}/g.txt", gzip=True) == "gz" * 1000


def test_stream_read(sandbox, workdir):
    data = os.urandom(300_000)
    with open(f"{workdir}/big", "wb") as f:
        f.write(data)
    assert b"".join(sandbox.files.read(f"{workdir}/big", format="stream")) == data


def test_pseudo_files_read_to_their_end(sandbox):
    """/proc reports st_size 0 and sysfs 4096 whatever the content: envd reads to the end."""
    boot_id = open("/proc/sys/kernel/random/boot_id").read()
    assert len(boot_id) == 37 and sandbox.files.read("/proc/sys/kernel/random/boot_id") == boot_id
    assert sandbox.files.read("/proc/version") == open("/proc/version").read()
    assert sandbox.files.read("/proc/version", gzip=True) == open("/proc/version").read()
    sys_file = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(sys_file):
        assert sandbox.files.read(sys_file) == open(sys_file).read()
    # longer than one read, still reported as 0 bytes: streams to the end
    maps = sandbox.files.read("/proc/self/mountinfo", format="bytes")
    assert maps.endswith(b"\n") and b" / " in maps
    kallsyms = sandbox.files.read("/proc/kallsyms", format="bytes")
    assert len(kallsyms) > 65536 and kallsyms == open("/proc/kallsyms", "rb").read()


def test_sizes_around_one_read(sandbox, workdir):
    for size in (0, 1, 65535, 65536, 65537, 200_000):
        data = os.urandom(size)
        with open(f"{workdir}/s{size}", "wb") as f:
            f.write(data)
        assert sandbox.files.read(f"{workdir}/s{size}", format="bytes") == data, size


def test_write_files_multipart(sandbox, workdir):
    infos = sandbox.files.write_files([
        {"path": f"{workdir}/m1.txt", "data": "1"},
        {"path": f"{workdir}/d/m2.txt", "data": "2"},
    ])
    assert [i.path for i in infos] == [f"{workdir}/m1.txt", f"{workdir}/d/m2.txt"]
    assert open(f"{workdir}/d/m2.txt").read() == "2"


def test_metadata_round_trip(sandbox, workdir):
    info = sandbox.files.write(f"{workdir}/meta.txt", "x", metadata={"Owner": "me", "k": "v"})
    if info.metadata is None:
        pytest.skip("filesystem under /home/user does not support user xattrs")
    assert info.metadata == {"owner": "me", "k": "v"}
    assert os.getxattr(f"{workdir}/meta.txt", "user.e2b.owner") == b"me"
    assert sandbox.files.get_info(f"{workdir}/meta.txt").metadata == {"owner": "me", "k": "v"}
    moved = sandbox.files.rename(f"{workdir}/meta.txt", f"{workdir}/meta2.txt")
    assert moved.metadata == {"owner": "me", "k": "v"}
    sandbox.files.write(f"{workdir}/meta2.txt", "y")  # no headers -> metadata cleared
    assert sandbox.files.get_info(f"{workdir}/meta2.txt").metadata is None


def test_read_errors(sandbox, workdir):
    with pytest.raises(NotFoundException):
        sandbox.files.read(f"{workdir}/missing.txt")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.read(workdir)
    with pytest.raises(AuthenticationException):
        sandbox.files.read(f"{workdir}/x", user="nobody-such")


def test_list_depth_order_and_entry_fields(sandbox, workdir):
    os.makedirs(f"{workdir}/b/inner")
    open(f"{workdir}/a.txt", "w").write("12345")
    open(f"{workdir}/b/inner/z.txt", "w").write("z")
    os.symlink(f"{workdir}/a.txt", f"{workdir}/c-link")
    one = sandbox.files.list(workdir)
    assert [e.name for e in one] == ["a.txt", "b", "c-link"]
    a = one[0]
    assert a.type == FileType.FILE and a.size == 5 and a.path == f"{workdir}/a.txt"
    assert a.permissions.startswith("-") and a.mode & 0o777 == a.mode
    assert one[1].type == FileType.DIR and one[1].permissions.startswith("d")
    link = sandbox.files.get_info(f"{workdir}/c-link")
    assert link.symlink_target == f"{workdir}/a.txt"
    deep = sandbox.files.list(workdir, depth=3)
    assert [e.path[len(workdir) + 1:] for e in deep] == ["a.txt", "b", "b/inner", "b/inner/z.txt", "c-link"]
    with pytest.raises(NotFoundException):
        sandbox.files.list(f"{workdir}/nope")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(f"{workdir}/a.txt")


def test_exists_get_info_make_dir_rename_remove(sandbox, workdir):
    assert sandbox.files.exists(workdir) is True
    assert sandbox.files.exists(f"{workdir}/nope") is False
    assert sandbox.files.make_dir(f"{workdir}/new/sub") is True
    assert sandbox.files.make_dir(f"{workdir}/new/sub") is False
    assert pwd.getpwuid(os.stat(f"{workdir}/new").st_uid).pw_name == "user"
    info = sandbox.files.get_info(f"{workdir}/new")
    assert info.type == FileType.DIR and info.owner == "user" and info.group == "user"
    sandbox.files.write(f"{workdir}/r.txt", "r")
    moved = sandbox.files.rename(f"{workdir}/r.txt", f"{workdir}/new/r2.txt")
    assert moved.path == f"{workdir}/new/r2.txt" and moved.name == "r2.txt"
    with pytest.raises(NotFoundException):
        sandbox.files.rename(f"{workdir}/gone", f"{workdir}/x")
    with pytest.raises(NotFoundException):
        sandbox.files.get_info(f"{workdir}/gone")
    sandbox.files.remove(f"{workdir}/new")
    assert not os.path.exists(f"{workdir}/new")
    sandbox.files.remove(f"{workdir}/never-existed")  # not an error


def test_weird_paths_resolve_lexically(sandbox, workdir):
    name = os.path.basename(workdir)
    info = sandbox.files.write(f"{workdir}/../{name}/./w.txt", "w")
    assert info.path == f"{workdir}/w.txt"
    assert sandbox.files.read(f"~/{name}//w.txt") == "w"
    assert sandbox.files.exists("/../../etc/hostname") == os.path.exists("/etc/hostname")
