"""Atomic writes: a file or folder is either the old one or the complete new one, never half of each.

Every writer in the package goes through these helpers: the new content is
written to a temporary sibling (same folder, so the final rename is atomic on
POSIX file systems) and renamed over the destination only once it is complete.
A failing or interrupted write removes its temporary and leaves the old
destination untouched.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "NotAFileError",
    "atomic_write",
    "atomic_write_dir",
    "atomic_write_text",
    "create_text_exclusive",
    "readable_file",
    "writable_file",
]


class NotAFileError(ValueError):
    """A path given as a file to read is a folder, a FIFO, a socket or a device."""


def readable_file(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` if it names a regular file (links followed), checked without opening it.

    Reading a FIFO blocks until a writer appears (and ignores Ctrl-C inside
    native readers), so every user-named input is checked here first.

    Parameters
    ----------
    path : path-like
        The file to read.
    what : str
        What it should hold, for the messages ("cost model file", "log").

    Raises
    ------
    FileNotFoundError
        If nothing is there.
    NotAFileError
        If it is a folder or not a regular file.
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{what} not found: {p}") from None
    if stat.S_ISDIR(mode):
        raise NotAFileError(f"{what} {p} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise NotAFileError(f"{what} {p} is not a regular file (a FIFO, socket or device); refusing to read it")
    return p


def writable_file(path: str | os.PathLike[str]) -> Path:
    """``path`` if an atomic write may replace it (absent, or a regular file), checked before any long work.

    Raises
    ------
    ValueError
        If it exists and is a folder, a FIFO, a socket, a device or a link.
    """
    p = Path(path)
    _refuse_non_regular(p)
    return p


def _plain_file_mode(existing: Path) -> int:
    """Mode of the file being replaced, or the one a plain ``open()`` would give."""
    if existing.exists():
        return existing.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _refuse_non_regular(path: Path, want_dir: bool = False) -> None:
    """A write never replaces a device, a socket, a link or a folder (a file for folders) with anything."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError as exc:
        raise OSError(exc.errno, f"cannot write {path}: a folder on its path is a file") from exc
    ok = stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)
    if not ok:
        kind = "folder" if want_dir else "regular file"
        raise ValueError(f"{path} exists and is not a {kind}; refusing to replace it")


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], object]) -> None:
    """Call ``write(tmp_path)``, then rename ``tmp_path`` over ``path``.

    Parameters
    ----------
    path : path-like
        Destination file; its parent folders are created.
    write : callable
        Receives the temporary file's path (a ``str``, the file exists and is
        empty) and writes the complete content there.

    Raises
    ------
    ValueError
        If ``path`` exists and is not a regular file (a device, a folder, a
        link): nothing is written.

    Notes
    -----
    The temporary name ends in ``.tmp``: a writer that infers a format from the
    suffix (matplotlib) must be told the format.
    """
    path = Path(path)
    _refuse_non_regular(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a file where the folder should be, permissions, disk full
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _plain_file_mode(path))  # mkstemp creates 0600
        os.replace(tmp, path)
    except OSError as exc:  # disk full, permissions: say which file, leave the old one
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding=encoding))


def atomic_write_dir(path: str | os.PathLike[str], write: Callable[[Path], object], *, replace: bool = True) -> bool:
    """Call ``write(tmp_folder)``, then put ``tmp_folder`` in the place of the folder ``path``.

    An existing ``path`` is removed only once the new folder is complete; the
    swap itself is two renames, so a crash between them leaves the complete
    new folder under its temporary name and no half-written one at ``path``.
    With ``replace=False`` a folder that is at ``path`` when the new one is
    complete (another process wrote it meanwhile) is kept and the new one
    dropped. Returns whether the new folder was put in place.
    """
    path = Path(path)
    _refuse_non_regular(path, want_dir=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        if not replace:
            try:
                os.rename(tmp, path)  # fails where a complete folder is already there
            except OSError:
                if not path.is_dir():
                    raise
                return False
            return True
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def create_text_exclusive(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> bool:
    """Write ``text`` to ``path`` only if nothing is there, atomically: complete or absent, never half-written.

    Of several processes creating the same file at once exactly one succeeds
    (the complete file is hard-linked into place, which fails if the name
    exists). Returns whether this call created it.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _plain_file_mode(path))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)
