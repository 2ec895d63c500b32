"""Filesystem inspection helpers: EntryInfo construction, metadata xattrs, ownership."""

import grp
import os
import pwd
import stat

from .proto import filesystem_pb2 as pb

XATTR_PREFIX = "user.e2b."


def _name_of_uid(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _name_of_gid(gid):
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _file_type(mode):
    if stat.S_ISDIR(mode):
        return pb.FILE_TYPE_DIRECTORY
    if stat.S_ISREG(mode):
        return pb.FILE_TYPE_FILE
    if stat.S_ISLNK(mode):
        return pb.FILE_TYPE_SYMLINK
    return pb.FILE_TYPE_UNSPECIFIED


def read_metadata(path):
    """Return ``user.e2b.*`` xattrs of ``path`` (prefix stripped); {} if unsupported."""
    out = {}
    try:
        names = os.listxattr(path)
    except OSError:
        return out
    for name in names:
        if name.startswith(XATTR_PREFIX):
            try:
                out[name[len(XATTR_PREFIX):]] = os.getxattr(path, name).decode("utf-8", "replace")
            except OSError:
                pass
    return out


def write_metadata(fd_or_path, metadata):
    """Replace all ``user.e2b.*`` xattrs with ``metadata``; False if xattrs unsupported."""
    try:
        existing = [n for n in os.listxattr(fd_or_path) if n.startswith(XATTR_PREFIX)]
        for name in existing:
            if name[len(XATTR_PREFIX):] not in metadata:
                os.removexattr(fd_or_path, name)
        for key, value in metadata.items():
            os.setxattr(fd_or_path, XATTR_PREFIX + key, value.encode())
    except OSError:
        return False
    return True


def entry_info(path, name=None):
    """Build an EntryInfo for ``path`` (not following a final symlink for type flags)."""
    lst = os.lstat(path)
    entry = pb.EntryInfo(name=name if name is not None else (os.path.basename(path) or "/"), path=path)
    st = lst
    if stat.S_ISLNK(lst.st_mode):
        entry.is_symlink = True
        target = os.path.realpath(path)
        entry.symlink_target = target
        try:
            st = os.stat(path)
        except OSError:
            st = lst  # dangling link: describe the link itself
    entry.type = _file_type(st.st_mode)
    entry.size = st.st_size
    entry.mode = st.st_mode & 0o777
    entry.permissions = stat.filemode(st.st_mode)
    entry.owner = _name_of_uid(st.st_uid)
    entry.group = _name_of_gid(st.st_gid)
    entry.modified_time.FromNanoseconds(st.st_mtime_ns)
    meta = read_metadata(path) if not stat.S_ISLNK(st.st_mode) else {}
    if meta:
        entry.metadata.update(meta)
    return entry


def make_dirs(path, uid, gid):
    """mkdir -p owned by uid/gid (only newly created dirs); returns True if created."""
    missing = []
    cur = path
    while not os.path.exists(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            continue
        if os.geteuid() == 0:
            os.chown(d, uid, gid)
    return bool(missing)
