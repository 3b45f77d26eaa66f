"""The cache folder (``--data.cache_dir``) must be one this process can write: checked before anything is read into
it, with a message naming the flag and why (a file, under a file, a read-only file system, permission denied).

Example::

    >>> import tempfile
    >>> from pathlib import Path
    >>> check_writable(Path(tempfile.mkdtemp()) / "cache")  # created, writable: no error
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder" if existing != folder else "it is a file, not a folder"
    return error.strerror or type(error).__name__
