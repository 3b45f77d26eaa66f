"""Atomic writes for the data caches: every file or folder is written under a name private to this process (pid and
a random part) and renamed into place, so readers (other processes, concurrent runs sharing a cache) never see a
partial one and two writers never write into the same file."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary file next to ``path``, then rename it over ``path`` (world-readable).

    Example::

        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "cache" / "hello.txt"
        >>> atomic_write(target, lambda fh: fh.write(b"hi"))
        >>> target.read_text()
        'hi'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; caches may be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def private_folder(final: Path) -> Path:
    """A new empty folder beside ``final``, named for this process (pid and a random part), to build ``final`` in
    before :func:`publish_folder` renames it into place: concurrent runs never write into one another's files."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.{os.getpid()}-", suffix=".tmp"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; caches may be shared
    return tmp


def publish_folder(tmp: Path, final: Path, complete: Callable[[Path], bool]) -> bool:
    """Rename the folder ``tmp`` (from :func:`private_folder`, finished) to ``final``. When ``final`` is already
    there and ``complete`` (another process finished first), ``tmp`` is dropped and theirs is kept; an incomplete
    ``final`` (left by an interrupted older version) is moved aside and replaced. Returns whether ``tmp`` became
    ``final``.

    Example::

        >>> import tempfile
        >>> final = Path(tempfile.mkdtemp()) / "rows"
        >>> first, second = private_folder(final), private_folder(final)
        >>> _ = (first / "done").write_text("1"), (second / "done").write_text("2")
        >>> done = lambda folder: (folder / "done").is_file()
        >>> publish_folder(first, final, done), publish_folder(second, final, done), (final / "done").read_text()
        (True, False, '1')
        >>> second.exists()
        False
    """
    for _ in range(5):
        try:
            os.rename(tmp, final)  # atomic; refuses a non-empty final folder
            return True
        except OSError:
            if not final.exists():
                continue  # moved away meanwhile: try again
            if complete(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            stale = final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.stale"
            try:
                os.rename(final, stale)
            except OSError:
                continue  # another process moved it first
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"could not move the cache folder {tmp} into place at {final}")
