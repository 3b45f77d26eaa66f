"""The :class:`~lightning_mtp.decoding.DecodingHost` of a Hugging Face ``transformers`` causal LM over its own KV cache.

The decoder addresses the cache by *position* and its batches are ragged (each row has its own newest position and
accepts its own number of drafts). A ``transformers`` ``DynamicCache`` instead appends every forward's keys at the same
*slot* for all rows. The adapter bridges the two:

* every forward appends T slots to the cache and records, per row, the position each slot holds (``slot_positions``,
  (B, S)); the model gets the row's own ``position_ids`` (RoPE / learned positions) and a 2D ``attention_mask`` over
  ``past slots + new tokens`` that hides the slots no longer valid for that row;
* :meth:`HFCacheHost.rollback` marks the slots at positions ``>= lengths`` invalid for each row (rejected drafts,
  prompt padding, the writes of finished rows) and then crops, with ``DynamicCache.crop(-n)``, the trailing slots no
  row needs any more. At batch size 1 that crop removes exactly the rejected drafts, like HF assisted generation
  (which is batch-1 only); in a ragged batch a row's rejected slots stay in the cache, masked, until every row is past
  them.

A masked slot contributes exactly zero attention weight, so each row computes what it would compute alone.

Only plain full-attention layers (``DynamicLayer``) can be rolled back this way: sliding-window layers count their
window in slots, and linear-attention/recurrent states cannot drop arbitrary past tokens. Other cache types are refused
with an error that names the model class.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mtp.loss import LogitTransform
from lightning_mtp.models.hf_trunk import context_length


@dataclass
class HFDecodeState:
    """One decoding call's ``transformers`` cache and the bookkeeping that makes it positional."""

    cache: Any
    """The ``transformers`` ``DynamicCache``: (B, heads, S, head_dim) keys/values per layer."""
    slot_positions: Tensor
    """(B, S) position held by each cache slot of each row."""
    valid: Tensor
    """(B, S) slots a row may attend to."""
    tree_start: int = 0
    """Slots before the last tree verification (its nodes follow)."""


def _cache_argument(module: nn.Module) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (transformers ≥ 5.x) or ``past_key_values``."""
    names = inspect.signature(module.forward).parameters
    if "cache" in names:
        return "cache"
    if "past_key_values" in names:
        return "past_key_values"
    raise TypeError(f"{type(module).__name__}.forward takes no KV cache argument (cache / past_key_values): "
                    "it cannot be used for cached decoding")


def new_rollbackable_cache(model: nn.Module) -> Any:
    """A fresh ``DynamicCache`` for ``model``, checked to be croppable with arbitrary per-row masking.

    Raises:
        TypeError: naming the model class, when its cache has layers other than full-attention ``DynamicLayer``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if kinds or not hasattr(cache, "crop"):
        window, context = getattr(model.config.get_text_config(), "sliding_window", None), context_length(model.config)
        wide = ("" if not (window and context and window >= context) else
                f" Its sliding window ({window} tokens) is no shorter than its context ({context}), so it attends to "
                "every token anyway: give its config sliding_window: null (--model.init_args.config.sliding_window "
                "null, or in the folder's config.json) and it is decoded as full attention.")
        raise TypeError(
            f"{type(model).__name__} uses a KV cache that lightning-mtp cannot roll back (layer types: "
            f"{', '.join(kinds) or type(cache).__name__}); decoding needs full-attention DynamicLayer caches "
            "(DynamicCache.crop). Sliding-window, linear-attention and recurrent caches are not supported." + wide
        )
    return cache


class HFCacheHost:
    """:class:`~lightning_mtp.decoding.DecodingHost` over a ``transformers`` ``*ForCausalLM`` and its ``DynamicCache``.

    Args:
        model: the causal LM (``PreTrainedModel`` with ``base_model`` and ``get_output_embeddings()``).
        max_context: the longest prompt + generation; the caller leaves room for the D verify positions past it.
        logit_transform: what the model's forward does to its head's output (Cohere's logit scale, Gemma-2's
            soft-capping, ...), as ``HFCausalLM.mtp_logit_transform()`` gives it; the drafts get the same one
            (``MTPMixin.mtp_depth_logits``).

    ``forward`` returns the base model's ``last_hidden_state`` (after the model's own final norm): the host's
    "pre-final-norm" state with an identity final norm, see :class:`lightning_mtp.models.HFCausalLM`.
    """

    def __init__(self, model: nn.Module, max_context: int, logit_transform: LogitTransform) -> None:
        self.model = model
        self.trunk = model.base_model  # the decoder without the LM head (LlamaModel, GPT2Model, ...)
        self.head = model.get_output_embeddings()
        self.vocab_size = int(self.head.out_features)
        self.max_context = int(max_context)
        self._cache_arg = _cache_argument(self.trunk)
        config = model.config.get_text_config()
        if config.model_type == "bloom" or getattr(config, "alibi", False) is True:  # (Bloom, Falcon with alibi)
            # its ALiBi biases are built from a 2-D attention mask: a tree's 4-D mask cannot be given
            self.tree_refusal = f"{type(model).__name__} builds its ALiBi biases from a 2-D attention mask"
            self.forward_tree = None
        self.logit_transform = logit_transform

    def allocate(self, batch_size: int, max_len: int) -> HFDecodeState:
        device = self.head.weight.device
        empty = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        return HFDecodeState(new_rollbackable_cache(self.model), empty, empty.bool())

    def forward(self, input_ids: Tensor, positions: Tensor, state: HFDecodeState) -> Tensor:
        mask = torch.cat([state.valid, torch.ones_like(input_ids, dtype=torch.bool)], dim=1)  # (B, S + T)
        out = self.trunk(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self._cache_arg: state.cache})
        state.slot_positions = torch.cat([state.slot_positions, positions], dim=1)  # (B, S + T)
        state.valid = mask
        return out.last_hidden_state  # (B, T, H)

    def main_logits(self, hidden: Tensor) -> Tensor:
        return self.logit_transform(self.head(hidden))  # (B, T, V)

    def forward_tree(self, input_ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                     state: HFDecodeState) -> Tensor:
        """Tree verification: the T nodes are appended as new slots; each sees the row's valid slots and the new
        slots of its ancestors (a 4-D additive mask, which ``transformers`` passes to attention as it is).

        ``slots`` / ``mask`` follow the positional convention (node i at slot ``newest + i``): the node-to-node part
        of ``mask`` is read from the columns ``slots``.
        """
        batch, size = input_ids.shape
        tree = mask[:, 0].gather(2, slots.unsqueeze(1).expand(batch, size, size))  # (B, T, T) ancestors
        past = state.valid.unsqueeze(1).expand(batch, size, state.valid.shape[1])  # (B, T, S)
        visible = torch.cat([past, tree], dim=2).unsqueeze(1)  # (B, 1, T, S + T)
        dtype = self.head.weight.dtype
        additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min)
        state.tree_start = state.valid.shape[1]
        out = self.trunk(input_ids=input_ids, attention_mask=additive, position_ids=positions, use_cache=True,
                         **{self._cache_arg: state.cache})
        state.slot_positions = torch.cat([state.slot_positions, positions], dim=1)  # (B, S + T)
        state.valid = torch.cat([state.valid, torch.zeros_like(input_ids, dtype=torch.bool)], dim=1)
        return out.last_hidden_state  # (B, T, H)

    def keep_path(self, state: HFDecodeState, sources: Tensor, targets: Tensor) -> None:
        """Move the accepted path's entries (positional ``sources`` = ``newest + node``) to the first new slots,
        in order, and drop the rest of the tree's slots."""
        start = state.tree_start
        nodes = sources - targets[:, :1]  # (B, A) node indices along the path
        keep = nodes.shape[1]
        for layer in state.cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # (B, heads, S + T, head_dim)
                index = (start + nodes).view(nodes.shape[0], 1, keep, 1).expand(-1, tensor.shape[1], -1,
                                                                                   tensor.shape[3])
                tensor[:, :, start : start + keep] = tensor.gather(2, index)
        drop = state.valid.shape[1] - (start + keep)
        if drop > 0:
            state.cache.crop(-drop)
        state.slot_positions = torch.cat([state.slot_positions[:, :start], targets], dim=1)
        state.valid = torch.cat([state.valid[:, :start], torch.ones_like(targets, dtype=torch.bool)], dim=1)

    def rollback(self, state: HFDecodeState, lengths: Tensor) -> None:
        state.valid &= state.slot_positions < lengths.unsqueeze(1)  # (B, S)
        used = state.valid.any(dim=0)  # (S,) slots some row still needs
        keep = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        drop = state.valid.shape[1] - keep
        if drop > 0:
            state.cache.crop(-drop)  # negative: drop the last `drop` slots
            state.slot_positions = state.slot_positions[:, :keep]
            state.valid = state.valid[:, :keep]
