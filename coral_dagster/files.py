"""Every file Coral writes: created new without following symbolic links, given the mode it documents, and a
failure (read-only folder, full disk) told as one sentence with the fix."""

from __future__ import annotations

import errno
import io
import os
import secrets
import stat
from pathlib import Path

from coral_dagster.errors import CoralError

#: Outputs people and tools read (task YAMLs, results, plots, plan files).
OUTPUT_MODE = 0o644
#: Scripts a dry run writes for people to run (`launch.sh`).
SCRIPT_MODE = 0o755
#: Keys and credentials: readable by this user only.
PRIVATE_MODE = 0o600
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)


def write_file(path: Path | str, data: str | bytes, mode: int = OUTPUT_MODE, *, private: bool = False,
               fix: str = "write to another folder") -> Path:
    """Write `data` to `path` with exactly `mode` (whatever the umask, or a file there had); the path written.

    The data goes to a new file (O_EXCL, O_NOFOLLOW) in the same folder that then replaces `path`, so a symbolic
    link planted at `path` (or appearing meanwhile) is never written through, nor its target's mode changed; one
    found there first is refused, as is anything but a regular file, and with `private` a file of another user.
    An OSError (read-only folder, full disk) becomes a CoralError ending in `fix` (how this command writes
    elsewhere)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise file_error(exc, path, fix) from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise CoralError(f"{path} is a symbolic link; refusing to write through it.", f"remove it, or {fix}.")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CoralError(f"{path} is not a regular file; refusing to write there.", f"remove it, or {fix}.")
    if private and st is not None and st.st_uid != os.getuid():
        raise CoralError(f"{path} belongs to user id {st.st_uid}, not to you; refusing to write a key there.",
                         f"remove it, or {fix} (one only you can write to).")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    body = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise file_error(exc, path, fix) from None
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise file_error(exc, path, fix) from None
        raise
    return path


def write_figure(fig, path: Path | str, dpi: int = 110, fix: str = "write to another folder") -> Path:
    """Save a matplotlib figure as a PNG file as `write_file` writes (mode 0644, no symbolic link followed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return write_file(path, buf.getvalue(), fix=fix)


def make_dir(path: Path | str, fix: str = "write to another folder") -> Path:
    """Create the folder `path` (and its parents) if missing; a failure as `file_error` says it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_error(exc, path, fix) from None
    return path


def file_error(exc: OSError, path: Path, fix: str = "write to another folder") -> CoralError:
    """An OSError met writing `path` as one sentence with the fix: a full disk, a folder this user may not write,
    a path through something that is not a folder, or the system's own words."""
    if exc.errno in _FULL:
        return CoralError(f"cannot write {path}: the disk holding it is full.", f"free space there, or {fix}.")
    if exc.errno == errno.EROFS:
        return CoralError(f"cannot write {path}: its file system is mounted read-only.", f"{fix}.")
    if exc.errno in _DENIED:
        return CoralError(f"cannot write {path}: you may not write there.",
                          f"make the folder writable (chmod u+w), or {fix}.")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return CoralError(f"cannot write {path}: a part of that path is a file, not a folder.", f"{fix}.")
    return CoralError(f"cannot write {path}: {exc.strerror or exc}.", f"{fix}.")
