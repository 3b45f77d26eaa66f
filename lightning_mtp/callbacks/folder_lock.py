"""One fit per checkpoint folder: an exclusive lock held for the whole fit, released when the process ends.

Two fits writing ``last.ckpt`` (and one TensorBoard run) into the same folder interleave their files without a word.
:class:`FolderLock` takes ``fcntl.flock`` on ``<folder>/.lightning-mtp.lock``: the operating system drops the lock
when its process ends, killed or not, so a stale file never blocks the next fit. The file names its holder (process,
host, start time, command) for the refusal message. Locks are kept per process (:func:`hold`), so the CLI can take
the lock before it launches the fit and the checkpoint callback finds it already held.

Example::

    >>> folder = getfixture("tmp_path")
    >>> lock = hold(folder)
    >>> lock.refusal is None and hold(folder) is lock
    True
    >>> release(folder)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, fits are not guarded
    fcntl = None

LOCK_FILE = ".lightning-mtp.lock"

_HELD: dict[str, FolderLock] = {}


class FolderLock:
    """``flock`` on ``<folder>/.lightning-mtp.lock``; ``refusal`` says who holds it when this process could not."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / LOCK_FILE
        self.refusal: Optional[str] = None
        self._fd: Optional[int] = None

    def acquire(self) -> bool:
        """Take the lock; ``False`` (with ``refusal`` set) when another process holds it."""
        if fcntl is None:
            return True
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.refusal = _describe_holder(os.read(fd, 4096))
            os.close(fd)
            return False
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        self._fd = fd
        return True

    def release(self) -> None:
        """Drop the lock and its file; a folder left empty (a fit refused before it saved) is removed too."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before the unlock: a process that opens the file now finds none
        if not any(self.folder.iterdir()):
            self.folder.rmdir()
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def _describe_holder(content: bytes) -> str:
    try:
        holder = json.loads(content.decode())
        return (f"process {holder['pid']} on {holder['host']}, started {holder['started']} "
                f"({holder.get('command', '?')})")
    except (ValueError, KeyError, UnicodeDecodeError):
        return "another process"


def hold(folder: os.PathLike[str] | str) -> FolderLock:
    """This process's lock on ``folder``, taken now if it holds none yet; check ``refusal`` on the result."""
    key = str(Path(folder).resolve())
    lock = _HELD.get(key)
    if lock is None:
        lock = FolderLock(Path(key))
        if lock.acquire():
            _HELD[key] = lock
    return lock


def release(folder: os.PathLike[str] | str) -> None:
    """Drop this process's lock on ``folder`` (nothing when it holds none)."""
    lock = _HELD.pop(str(Path(folder).resolve()), None)
    if lock is not None:
        lock.release()


def release_all() -> None:
    """Drop every lock this process holds (the CLI, when a subcommand ends, however it ends)."""
    for folder in list(_HELD):
        release(folder)
