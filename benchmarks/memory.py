"""Peak tensor memory of a piece of work on CPU, measured from the C allocator.

torch's CPU tensors are allocated with glibc's malloc, so ``mallinfo2()`` (bytes in use in the main arena plus
mmapped blocks) tracks live tensor memory exactly. A ``TorchDispatchMode`` samples it after every aten op, forward
and backward, which gives the peak at op granularity. Run the work once before measuring so lazily allocated buffers
(optimizer state, BLAS workspaces) do not count as the step's own.

Example::

    >>> import torch
    >>> with PeakMemory() as peak:
    ...     x = torch.ones(1024, 1024)  # 4 MiB
    >>> peak.peak_bytes >= 4 * 2**20
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL(ctypes.util.find_library("c"))
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakMemory(TorchDispatchMode):
    """Context manager: ``peak_bytes`` = the largest allocation growth above the level at entry."""

    def __enter__(self):
        self.base = bytes_in_use()
        self.peak_bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak_bytes = max(self.peak_bytes, bytes_in_use() - self.base)
        return out
