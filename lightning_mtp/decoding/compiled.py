"""Optional ``torch.compile`` of decoding (``GenerationConfig.compile``).

A decoding step at batch 1 runs hundreds of small ops, so eager PyTorch spends much of it in framework overhead.
Greedy speculative decoding with a fixed draft length compiles its *whole step*
(:func:`~lightning_mtp.decoding.step.speculative_step`: drafting through every MTP module, the verify forward,
acceptance and the bookkeeping) into one graph without host syncs, gpt-fast style; every MTP module then recomputes a
fixed window of D + 1 positions, so the step has one shape. Other modes compile the trunk's step forward and each
MTP module. The compiled callables are kept per module (outside it, so checkpoints and pickling are unchanged) and
reused by every later call; shapes that change between calls (cache length, tokens per step) are recompiled once as
dynamic. Prefill, whose length differs per prompt, stays eager.

Example::

    >>> import torch
    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import CausalLM, ModelConfig
    >>> model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4), MTPConfig(depth=1)).eval()
    >>> model.configure_model()
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), 4, compile=True)  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.host import CausalLMHost
from lightning_mtp.decoding.step import speculative_step

STEP_TOKENS_MAX = 16
"""Forwards of at most this many tokens per row (decode steps and verifies) use the compiled trunk."""


_STORES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _compiled(module: nn.Module, key: str, build: Callable[[], Any]) -> Any:
    """``module``'s compiled callable ``key``, built once by ``build()``. The store lives outside the module (so
    checkpoints, ``state_dict``, pickling and ``deepcopy`` of the module are unchanged) for as long as it lives."""
    store = _STORES.setdefault(module, {})
    if key not in store:
        store[key] = build()
    return store[key]


def _trunk_step(model: nn.Module, input_ids: Tensor, positions: Tensor, caches: list) -> Tensor:
    return model(input_ids, positions, caches)


def _main_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    return model.logits(hidden)


class CompiledCausalLMHost(CausalLMHost):
    """:class:`CausalLMHost` whose step forwards and logits run compiled."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._forward = _compiled(model, "trunk_step", lambda: torch.compile(_trunk_step))
        self._logits = _compiled(model, "main_logits", lambda: torch.compile(_main_logits))

    def forward(self, input_ids: Tensor, positions: Tensor, state: list) -> Tensor:
        if input_ids.shape[1] > STEP_TOKENS_MAX:
            return super().forward(input_ids, positions, state)  # prefill
        return self._forward(self.model, input_ids, positions, state)

    def main_logits(self, hidden: Tensor) -> Tensor:
        return self._logits(self.model, hidden)


def compile_decoding(
    module: nn.Module, host: Any, drafter: Any, fused_greedy: bool
) -> tuple[Any, Any, Optional[Callable]]:
    """The compiled counterparts of ``host`` (bundled ``CausalLM`` only) and of ``drafter``'s MTP modules; or, when
    ``fused_greedy`` (greedy, fixed draft length), the eager host and drafter and the compiled
    :func:`~lightning_mtp.decoding.step.speculative_step` that traces through them (else ``None``)."""
    if type(host) is not CausalLMHost:
        raise ValueError(
            "compile (GenerationConfig.compile, --model.generation.compile) supports the bundled CausalLM's decoding "
            f"host only, got {type(host).__name__}; leave it False for this model"
        )
    if drafter is None:
        return CompiledCausalLMHost(module), None, None
    if fused_greedy:  # host and drafter stay eager: the step's graph traces through them
        drafter.fixed_window = drafter.max_drafts + 1
        return host, drafter, _compiled(module, "speculative_step", lambda: torch.compile(speculative_step))
    host = CompiledCausalLMHost(module)
    modules = _compiled(module, "mtp_modules", lambda: [torch.compile(m) for m in drafter.modules])
    drafter.step_modules = modules
    return host, drafter, None
