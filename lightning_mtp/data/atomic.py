"""Atomic file writes for the data caches: readers (other processes, concurrent runs) never see a partial file."""

from __future__ import annotations

import os
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; caches may be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
