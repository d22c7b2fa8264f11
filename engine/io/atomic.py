"""Whole-or-nothing file writes: a reader (or the next run) sees the old file or the complete new one,
never a part, whatever happens during the write (full disk, Ctrl-C, two writers on one path)."""
from __future__ import annotations

import contextlib
import os
import tempfile


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str, suffix: str = ".part"):
    """Yield a binary file under a unique temporary name in ``path``'s folder (the same file system, so the
    rename is atomic); on success it replaces ``path``, on any failure or interrupt it is removed and
    ``path`` keeps its old content. The new file gets the usual permissions (0666 less the umask)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".part"):
    """``atomic_write`` for writers that open their file by name (gguf.GGUFWriter): yield the unique
    temporary path in ``path``'s folder; on success it is synced and replaces ``path``, on any failure it is
    removed."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
