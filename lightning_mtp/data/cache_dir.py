"""The cache folder (``--data.cache_dir``) must be one this process can write: checked before anything is read into
it, with a message naming the flag and why (a file, under a file, a read-only file system, permission denied). A write
that fails later, part-way (the disk or the quota full), is told the same way (:func:`writing_cache`): the folder being
written, the system's reason and what to do, never a traceback or a corpus file blamed for it.

Example::

    >>> import tempfile
    >>> from pathlib import Path
    >>> check_writable(Path(tempfile.mkdtemp()) / "cache")  # created, writable: no error
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional


def check_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write a file in it; a ``ValueError`` naming ``--data.cache_dir`` when either
    fails. A complete cache on a read-only mount is refused too: ``datasets`` takes lock files even to read its
    tables."""
    try:
        write_probe(folder)
    except OSError as error:
        raise ValueError(
            f"--data.cache_dir {str(folder)!r} cannot be written: {unwritable_reason(folder, error)}; the data caches "
            "(tokenizers, Arrow tables, token ids) are written there, and read with lock files even when complete: "
            "give a folder this process can write (copy a read-only cache there)") from None
    for sub in sorted(CACHE_SUBFOLDERS):  # a shared cache whose subfolder another user made (mode 755) or a file
        path = folder / sub
        if not path.exists() and not path.is_symlink():
            continue
        try:
            write_probe(path)
        except OSError as error:
            raise ValueError(
                f"--data.cache_dir {str(folder)!r}: its {sub!r} folder cannot be written: "
                f"{unwritable_reason(path, error)}; lightning-mtp writes its {CACHE_SUBFOLDERS[sub]} there: give "
                "--data.cache_dir a folder of your own (or make that one writable)") from None


CACHE_SUBFOLDERS = {"datasets": "Arrow tables of record files", "records": "tokenized records",
                    "tokenizers": "trained BPE tokenizers", "tokens": "token ids of text corpora",
                    "utf8": "decoded text of corpus files"}
"""The folders the data caches write under ``--data.cache_dir``, checked with it (:func:`check_writable`)."""


def write_probe(folder: Path) -> None:
    """Create ``folder`` (and its parents) and a file in it, then remove the file; raises ``OSError`` when either
    cannot be written."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
    os.close(fd)
    os.unlink(probe)


def unwritable_reason(folder: Path, error: OSError) -> str:
    """Why ``folder`` cannot be written, in a few words: it (or a folder above it) is a file, or the system's reason
    (read-only file system, permission denied)."""
    existing = _nearest_existing(folder)
    if existing.exists() and not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder" if existing != folder else "it is a file, not a folder"
    return error.strerror or type(error).__name__


_ELSEWHERE = "point --data.cache_dir at a disk with room"
WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", f"free space on that disk, or {_ELSEWHERE}"),
    errno.EDQUOT: ("the disk quota is exceeded", f"free space within your quota (or raise it), or {_ELSEWHERE}"),
    errno.EFBIG: ("a file grew past what the file system holds",
                  "point --data.cache_dir at a file system that holds large files"),
    errno.EROFS: ("the file system is read-only", "give --data.cache_dir a folder this process can write"),
}
"""The errors that say a cache file could not be written (never that a corpus file could not be read): what each
means and what to do."""
_DATASETS_NO_SPACE = "Not enough disk space"
"""How ``datasets`` words its own check of the free space, an ``OSError`` without an errno."""


@contextmanager
def writing_cache(cache_dir: Path, folder: Path, what: str) -> Iterator[None]:
    """Turn a write that fails inside (the disk full, the quota exceeded, however deep in ``datasets`` or numpy and
    whatever wraps it) into one ``ValueError`` naming ``--data.cache_dir``, the ``folder`` being written, ``what``
    it holds, the reason with its errno name, and what to do (:func:`cache_write_error`). Other errors pass as they
    are. The writers leave no partial file under a final name: they write private names and rename when complete.

    Example::

        >>> import tempfile
        >>> cache = Path(tempfile.mkdtemp())
        >>> try:
        ...     with writing_cache(cache, cache / "records", "tokenized records"):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ... except ValueError as error:
        ...     print(str(error).replace(str(cache), "CACHE").split(" failed: ")[1])
        the disk is full (ENOSPC): free space on that disk, or point --data.cache_dir at a disk with room
    """
    try:
        yield
    except Exception as error:
        failure = cache_write_failure(error)
        if failure is None:
            raise
        raise cache_write_error(cache_dir, folder, what, failure) from None


def cache_write_failure(error: BaseException) -> Optional[OSError]:
    """The ``OSError`` of :data:`WRITE_FAILURES` that ``error`` is, was raised from or while handling (``datasets``
    wraps it in its own errors); ``None`` when there is none."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and (
                current.errno in WRITE_FAILURES or str(current).startswith(_DATASETS_NO_SPACE)):
            return current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


def write_failure_reason(error: OSError) -> tuple[str, str]:
    """(what happened, with its errno name; what to do) of a write that failed with ``error`` (one of
    :data:`WRITE_FAILURES`; ``datasets``' own free-space check counts as ``ENOSPC``)."""
    code = error.errno if error.errno in WRITE_FAILURES else errno.ENOSPC
    reason, advice = WRITE_FAILURES[code]
    return f"{reason} ({errno.errorcode[code]})", advice


def cache_write_error(cache_dir: Path, folder: Path, what: str, error: OSError) -> ValueError:
    """The one-line refusal of a cache write that failed with ``error`` (:func:`write_failure_reason`)."""
    reason, advice = write_failure_reason(error)
    return ValueError(f"--data.cache_dir {str(cache_dir)!r}: writing the {what} into {str(folder)!r} failed: {reason}: "
                      f"{advice}")


def check_free_space(cache_dir: Path, folder: Path, what: str, needed: int) -> None:
    """Refuse (as :func:`cache_write_error` words it) to write ``needed`` bytes into ``folder`` when its disk has less
    room: files filled through a memory map (numpy's ``open_memmap``) are sparse, so a full disk is met while the
    pages are written, and the process dies of ``SIGBUS`` instead of an error."""
    free = shutil.disk_usage(_nearest_existing(folder)).free
    if free < needed:
        error = cache_write_error(cache_dir, folder, what, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        raise ValueError(f"{error} (it needs {_megabytes(needed)}, {_megabytes(free)} are free)")


def _nearest_existing(folder: Path) -> Path:
    """``folder``, or the nearest folder above it that exists (the file system root at most)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB"
