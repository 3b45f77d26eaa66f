"""Optional ``torch.compile`` of the decoding forwards (``GenerationConfig.compile``).

A decoding step at batch 1 runs hundreds of small ops, so eager PyTorch spends much of it in framework overhead;
compiling the trunk's step forward and each MTP module removes most of it (``benchmarks/decode.py`` measures it).
The compiled callables are kept on the module (outside its ``nn.Module`` registry, so checkpoints are unchanged) and
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

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mtp.decoding.host import CausalLMHost

STEP_TOKENS_MAX = 16
"""Forwards of at most this many tokens per row (decode steps and verifies) use the compiled trunk."""


def _compiled(module: nn.Module) -> dict:
    """The module's store of compiled callables (a plain dict in ``__dict__``: not a submodule, not in checkpoints)."""
    store = module.__dict__.get("_mtp_compiled")
    if store is None:
        store = module.__dict__["_mtp_compiled"] = {}
    return store


def _trunk_step(model: nn.Module, input_ids: Tensor, positions: Tensor, caches: list) -> Tensor:
    return model(input_ids, positions, caches)


def _main_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    return model.logits(hidden)


class CompiledCausalLMHost(CausalLMHost):
    """:class:`CausalLMHost` whose step forwards and logits run compiled."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        store = _compiled(model)
        self._forward = store.setdefault("trunk_step", torch.compile(_trunk_step))
        self._logits = store.setdefault("main_logits", torch.compile(_main_logits))

    def forward(self, input_ids: Tensor, positions: Tensor, state: list) -> Tensor:
        if input_ids.shape[1] > STEP_TOKENS_MAX:
            return super().forward(input_ids, positions, state)  # prefill
        return self._forward(self.model, input_ids, positions, state)

    def main_logits(self, hidden: Tensor) -> Tensor:
        return self._logits(self.model, hidden)


def compile_decoding(module: nn.Module, host: Any, drafter: Any) -> tuple[Any, Any]:
    """The compiled counterparts of ``host`` (bundled ``CausalLM`` only) and of ``drafter``'s MTP modules."""
    if type(host) is not CausalLMHost:
        raise ValueError(
            "compile (GenerationConfig.compile, --model.generation.compile) supports the bundled CausalLM's decoding "
            f"host only, got {type(host).__name__}; leave it False for this model"
        )
    host = CompiledCausalLMHost(module)
    if drafter is not None and hasattr(drafter, "step_modules"):
        store = _compiled(module)
        modules = store.get("mtp_modules")
        if modules is None or len(modules) != len(drafter.modules):
            modules = store["mtp_modules"] = [torch.compile(m) for m in drafter.modules]
        drafter.step_modules = modules
    return host, drafter
