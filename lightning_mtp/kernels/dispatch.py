"""Backend selection and lazy Triton kernels shared by the fused ops.

Every op has a Triton kernel and a plain-torch twin with the same signature. :func:`resolve_backend` picks one:

* ``backend="torch"`` or ``"triton"`` forces that backend;
* ``backend="auto"`` (the default) defers to the environment variable ``LIGHTNING_MTP_KERNELS`` (``auto``, ``triton``
  or ``torch``); when that is ``auto`` too, CUDA tensors use the kernel and anything else the twin.

Forcing ``"triton"`` on CPU tensors only works under Triton's interpreter (``TRITON_INTERPRET=1``); otherwise a
:class:`RuntimeError` explains why.

Triton decides between compiling and interpreting a function when ``@triton.jit`` runs, i.e. at import. Our kernels
are plain functions wrapped by :class:`LazyKernel`, which builds the jitted (or interpreted) kernel on first launch,
reading ``TRITON_INTERPRET`` at *launch* time. But Triton's own standard library (``tl.max``, ``tl.sum``,
``tl.zeros``...) is jitted when ``triton.language`` is first imported, so with triton 3.9 the interpreter only works
if ``TRITON_INTERPRET=1`` was in the environment BEFORE the first ``import triton.language`` of the process
(:func:`interpreter_ready` checks this; a late setting raises a clear error). Tests therefore run the interpreted
kernels in a subprocess started with the variable set. Importing this module never imports Triton.

Example::

    >>> import torch
    >>> resolve_backend("auto", torch.zeros(2))
    'torch'
"""

import functools
import os
from typing import Any, Callable, Dict, Optional, Sequence

import torch

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "LIGHTNING_MTP_KERNELS"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works (it does on CPU-only machines too; the kernels then need the interpreter)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), read now rather than at import."""
    if triton_available():
        import triton

        knobs = getattr(triton, "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def interpreter_ready() -> bool:
    """Whether interpreted kernels can run: ``TRITON_INTERPRET=1`` now AND when ``triton.language`` was imported."""
    if not (interpreter_enabled() and triton_available()):
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(getattr(tl, "max", None), InterpretedFunction)


def _check_interpreter_ready() -> None:
    if not interpreter_ready():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after `triton.language` had been imported in this process, so Triton's "
            "standard library was compiled for the GPU and the interpreter cannot run it. Set TRITON_INTERPRET=1 in "
            "the environment before Python starts (or before anything imports triton)."
        )


def requested_backend(backend: str = "auto") -> str:
    """The backend asked for: the argument unless it is ``"auto"``, then ``$LIGHTNING_MTP_KERNELS`` (default auto)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"${ENV_VAR} must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_triton_usable(*tensors: Optional[torch.Tensor]) -> None:
    """Raise a clear error when the Triton kernel cannot run on these tensors."""
    if not triton_available():
        raise RuntimeError("backend='triton' needs the `triton` package; install it or use backend='torch'")
    devices = {t.device.type for t in tensors if t is not None}
    if interpreter_enabled():
        _check_interpreter_ready()
    elif not devices <= {"cuda"}:
        raise RuntimeError(
            f"backend='triton' on {sorted(devices)} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before starting Python (slow, for tests), move the tensors to a CUDA device, or use backend='torch'"
        )


def resolve_backend(backend: str, *tensors: Optional[torch.Tensor]) -> str:
    """``"triton"`` or ``"torch"`` for an op on ``tensors`` (``None`` entries are skipped).

    ``auto`` picks Triton only when every tensor is on CUDA and Triton imports; forced ``"triton"`` is checked by
    :func:`check_triton_usable`.
    """
    backend = requested_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        on_cuda = all(t.is_cuda for t in tensors if t is not None)
        return "triton" if on_cuda and triton_available() else "torch"
    check_triton_usable(*tensors)
    return "triton"


class LazyKernel:
    """A Triton kernel built on first launch, compiled or interpreted depending on ``TRITON_INTERPRET`` *then*.

    Args:
        fn: the kernel as a plain Python function written in ``triton.language``.
        configs: optional ``interpret -> list[triton.Config]``; when given the kernel is wrapped in ``triton.autotune``
            (use one config under the interpreter: programs run sequentially there and benchmarking is meaningless).
        autotune_kwargs: ``key``, ``restore_value``, ``reset_to_zero``... forwarded to ``triton.autotune``.

    Launch it like a jitted kernel: ``kernel[grid](*args, **constexprs)``.
    """

    def __init__(self, fn: Callable, configs: Optional[Callable[[bool], Sequence[Any]]] = None, **autotune_kwargs):
        self.fn = fn
        self.configs = configs
        self.autotune_kwargs = autotune_kwargs
        self._built: Dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def build(self) -> Any:
        interpret = interpreter_enabled()
        kernel = self._built.get(interpret)
        if kernel is None:
            import triton

            if interpret:
                from triton.runtime.interpreter import InterpretedFunction

                _check_interpreter_ready()

                kernel = InterpretedFunction(self.fn)
            else:
                kernel = triton.runtime.jit.JITFunction(self.fn)
            if self.configs is not None:
                kernel = triton.autotune(configs=list(self.configs(interpret)), **self.autotune_kwargs)(kernel)
            self._built[interpret] = kernel
        return kernel

    def __getitem__(self, grid):
        return self.build()[grid]


def next_power_of_2(n: int) -> int:
    """Smallest power of two ≥ ``n`` (and ≥ 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
