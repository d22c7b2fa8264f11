"""Whole-or-nothing file writes: a reader (or the next run) sees the old file or the complete new one,
never a part, whatever happens during the write (full disk, Ctrl-C, SIGTERM, two writers on one path). A writer
holds a lock (flock) on its part file while it writes; the next write of the same output removes the part files
no live writer holds, those a killed run (SIGKILL, power loss) left behind."""
from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile

try:
    import fcntl
except ImportError:  # Windows: no flock; part files are not locked, and stale ones are not swept
    fcntl = None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_not_input(src: str, dst: str) -> None:
    """Refuse an output whose write would replace the input or a file inside it: ``src`` under another name (a
    link to it, a link it is, a folder reached through a link, a hard link) or a file inside the folder ``src``.
    ValueError naming both paths."""
    src, dst = os.fspath(src), os.fspath(dst)
    written = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(dst))), os.path.basename(dst))
    source = os.path.realpath(src)
    if written == source or (os.path.exists(src) and os.path.exists(dst) and os.path.samefile(src, dst)):
        raise ValueError(f"output '{dst}' is the input '{src}' (the same file): the output must differ from the input")
    if os.path.isdir(source) and written.startswith(os.path.join(source, "")):
        raise ValueError(f"output '{dst}' is inside the input folder '{src}': write it outside that folder")


def _remove_if_stale(part: str) -> None:
    """Remove ``part`` if it is a regular file of this user that no live writer holds locked."""
    with contextlib.suppress(OSError):  # gone, not ours to open, or locked (BlockingIOError): leave it
        fd = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.path.samestat(os.stat(part, follow_symlinks=False), st):  # still that file under that name
                    os.unlink(part)
        finally:
            os.close(fd)


def _new_part(path: str, suffix: str):
    """(fd, name) of a new part file for ``path`` in its folder (the same file system, so the rename is atomic),
    locked for as long as the fd is open; stale part files of ``path`` are removed first."""
    folder, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}."
    if fcntl is not None:
        own = re.compile(re.escape(prefix) + "[a-z0-9_]{8}" + re.escape(suffix))  # mkstemp's 8 random characters
        with contextlib.suppress(OSError):
            for name in filter(own.fullmatch, os.listdir(folder)):
                _remove_if_stale(os.path.join(folder, name))
    while True:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(tmp), os.fstat(fd)):  # another run's sweep did not take it before the lock
                return fd, tmp
        os.close(fd)


@contextlib.contextmanager
def _part_file(path: str, suffix: str):
    """Yield (fd, name) of a locked part file; on success it is synced and replaces ``path`` (before the lock is
    let go), on any failure or interrupt it is removed and ``path`` keeps its old content. The new file gets the
    usual permissions (0666 less the umask), not mkstemp's 0600."""
    fd, tmp = _new_part(path, suffix)
    try:
        yield fd, tmp
        os.fsync(fd)
        os.chmod(tmp, 0o666 & ~_umask())
        if fcntl is None:  # Windows renames only a closed file (and there is no lock to keep)
            fd = _close(fd)
        os.replace(tmp, path)  # with the lock still held: no other run's sweep takes it first
    except BaseException:
        fd = _close(fd)  # first: Windows removes only a closed file
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        _close(fd)


def _close(fd: int) -> int:
    if fd >= 0:
        os.close(fd)
    return -1


@contextlib.contextmanager
def atomic_write(path: str, suffix: str = ".part"):
    """Yield a binary file under a unique temporary name in ``path``'s folder; on success it replaces ``path``,
    on any failure or interrupt it is removed and ``path`` keeps its old content."""
    path = os.fspath(path)
    with _part_file(path, suffix) as (fd, _), open(fd, "wb", closefd=False) as f:
        yield f


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".part"):
    """``atomic_write`` for writers that open their file by name (gguf.GGUFWriter): yield the unique
    temporary path in ``path``'s folder; on success it is synced and replaces ``path``, on any failure it is
    removed."""
    path = os.fspath(path)
    with _part_file(path, suffix) as (_, tmp):
        yield tmp


def private_dir(name: str) -> str:
    """``<user cache>/sgld/<name>`` (``$XDG_CACHE_HOME``, else ``~/.cache``): this user's own folder for files kept
    between runs, created 0700 and never in the shared temp folder. One that exists is used only if it is a real
    folder of this user that nobody else can write or read; anything else (a link, an open folder) is refused,
    so a file found there was written by this user."""
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sgld")
    os.makedirs(root, mode=0o700, exist_ok=True)
    path = os.path.join(root, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path}: not a private folder of this user (it must be a folder owned by uid {os.getuid()} "
                      f"with mode 0700); remove it or set XDG_CACHE_HOME to a folder of your own")
    return path
