"""``NativeMTPModule``: one MTP layer in the layout of the released checkpoints (DeepSeek-V3, GLM-4.5).

    h_k(i) = post_norm(block(eh_proj([enorm(Emb(t(i+k))); hnorm(h_(k-1)(i))])))

``block`` is the trunk's own decoder-layer class (attention with its own kernel and cache protocol, MoE MLP),
run with RoPE at the position of the consumed token t(i+k), i.e. i + k. h_0 is the trunk's state after its final
norm, and h_k, already normalised by ``post_norm``, is both what the shared head reads and what depth k+1 reads.

The module plugs into ``MTPMixin``'s loss loop like the lightning layout's (``module(hidden, emb, cos, sin)``, then
``module.norm``): its output is already post-normed, so ``norm`` only copies it (:class:`HeadInput`) and the chain
carries the normed state, as the checkpoints were trained. ``cos``/``sin`` are ignored: the host's rotary embedding
is applied at the module's own positions. In a packed batch the loop passes each token's position within its
document and the block-diagonal causal mask of the documents, so no depth attends across a document boundary.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn


class NativeMTPModule(nn.Module):
    """Depth ``depth`` (1-based) of a native MTP stack; parameter names are the checkpoints' (``enorm``, ``hnorm``,
    ``eh_proj``, ``post_norm`` = their ``shared_head.norm``) and ``block.*`` = the decoder layer's own keys.

    Example::

        >>> import torch
        >>> from transformers import AutoConfig, AutoModelForCausalLM
        >>> from lightning_mtp.native import build_native_modules
        >>> trunk = AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4_moe", vocab_size=64,
        ...     hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2))
        >>> module = build_native_modules(trunk, depth=1)[0]
        >>> module(torch.randn(2, 5, 32), torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, block: nn.Module, norm_class: type, hidden_size: int, eps: float, depth: int,
                 rotary: Optional[nn.Module], hidden_first: bool = False) -> None:
        super().__init__()
        self.enorm = norm_class(hidden_size, eps=eps)
        self.hnorm = norm_class(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.post_norm = norm_class(hidden_size, eps=eps)
        self.norm = HeadInput()  # the output is post-normed already (MTPMixin's loop applies module.norm)
        self.depth = depth
        self.hidden_first = hidden_first  # config.mtp_hidden_states_first: [hnorm(h); enorm(E)] (some checkpoints)
        # The trunk's rotary embedding, shared but not registered: it belongs to the trunk (and its buffers must not
        # follow this module's dtype casts).
        self._rotary = (rotary,)

    def features(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """[enorm(Emb); hnorm(h)] (or hidden first): (B, T, H) twice -> (B, T, 2H), the input of ``eh_proj``."""
        parts = [self.enorm(token_embedding), self.hnorm(hidden)]
        return torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1)

    def block_input(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:
        """eh_proj(features): (B, T, H) twice -> (B, T, H)."""
        return self.eh_proj(self.features(hidden, token_embedding))

    def forward(
        self,
        hidden: Tensor,
        token_embedding: Tensor,
        cos: Any = None,
        sin: Any = None,
        positions: Optional[Tensor] = None,
        cache: Any = None,
        mask: Optional[Tensor] = None,
        normed: bool = False,
    ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """h_k (B, T, H), post-normed; with ``normed``, the pair (h_k, its copy for the head) as the lightning
        modules return (h_k, norm(h_k)) for the MTP loss.

        hidden: h_(k-1) at positions i (B, T, H); token_embedding: Emb(t(i+k)) (B, T, H). ``positions`` (B, T): the
        positions i (default 0..T-1; in a packed batch, i's position within its document); RoPE runs at i + depth.
        ``cache``: an object with ``transformers``' cache ``update`` protocol
        (:class:`~lightning_mtp.native.cache.PositionalLayerCache` when drafting); ``mask``: the (B, 1, T, S)
        attention mask over the keys the block sees, additive or bool (True: visible; packed documents,
        :func:`~lightning_mtp.layers.document_mask`), default causal over these T tokens.
        """
        x = self.block_input(hidden, token_embedding)  # (B, T, H)
        batch, length = x.shape[:2]
        if mask is not None and mask.dtype == torch.bool:
            mask = additive(mask, x.dtype)  # every transformers kernel that takes a 4-D mask (eager, sdpa) adds it
        if positions is None:
            positions = torch.arange(length, device=x.device).expand(batch, length)  # (B, T)
        if cache is not None and hasattr(cache, "step"):
            step_mask = cache.step(positions, x.dtype)  # the slots this call writes, and what each query sees
            mask = step_mask if mask is None else mask
        if mask is None and not (cache is None and length > 1 and self._kernel_is_causal_without_mask()):
            mask = causal_mask(positions, x.dtype)  # eager attention (or a cache) needs it spelled out
        rope_positions = positions + self.depth  # (B, T) positions of the consumed tokens t(i+k)
        rotary = self._rotary[0]
        position_embeddings = rotary(x, position_ids=rope_positions) if rotary is not None else None
        out = self.block(x, attention_mask=mask, position_ids=rope_positions, cache=cache,
                         position_embeddings=position_embeddings)
        if isinstance(out, tuple):  # older decoder layers return (hidden, ...)
            out = out[0]
        out = self.post_norm(out)
        return (out, self.norm(out)) if normed else out


    def _kernel_is_causal_without_mask(self) -> bool:
        """Whether the block's attention kernel runs causally when given no mask (``transformers``' sdpa and flash
        integrations set ``is_causal`` then): training skips the (B, 1, T, T) mask and keeps the fused kernels."""
        config = getattr(getattr(self.block, "self_attn", None), "config", None)
        kernel = str(getattr(config, "_attn_implementation", None) or "")
        return kernel == "sdpa" or kernel.startswith("flash")


def causal_mask(positions: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive (B, 1, T, T) mask: query j sees keys at positions <= its own (0 where visible, the dtype's min
    elsewhere). Additive masks work with every ``transformers`` attention kernel that takes a 4-D mask (eager, sdpa)."""
    visible = positions.unsqueeze(2) >= positions.unsqueeze(1)  # (B, T, T)
    return additive(visible.unsqueeze(1), dtype)


def additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean visibility -> additive mask in ``dtype``."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


class HeadInput(nn.Module):
    """``norm`` of a native module: a copy of its (already post-normed) output for the head.

    A copy, not the tensor itself: the loss may write the head's gradient into the states it scores, in place
    (``loss.score_jointly``), while the next depth's ``hnorm`` still holds the chained state for its backward.
    """

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden.clone()


class NativeRotaryPlaceholder(nn.Module):
    """``mtp_rope`` of a native-layout module: ``MTPMixin`` asks for (cos, sin) of T positions and passes them to
    each depth, but native modules apply the host's own rotary embedding at their own positions. Empty (1, T, 0)
    tensors keep the callers' slicing valid."""

    def forward(self, length: int, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        empty = torch.zeros(1, length, 0)
        return empty, empty
