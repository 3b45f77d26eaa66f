"""Typed configuration of the MTP heads and their loss.

Example::

    >>> from lightning_mtp import MTPConfig
    >>> MTPConfig(depth=3, architecture="parallel", loss_weight=0.1).depth
    3
    >>> MTPConfig(depth=0)
    Traceback (most recent call last):
    ...
    ValueError: MTPConfig.depth (--model.mtp.depth) must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

from lightning_mtp.finite import is_finite_number

ARCHITECTURES = ("cascaded", "parallel")
LAYOUTS = ("lightning", "native")


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"MTPConfig.{field} (--model.mtp.{field}) {message}")


@dataclass
class MTPConfig:
    """What MTP heads a module gets and how their loss is weighted.

    Depth ``k`` (1 ≤ k ≤ ``depth``) at position ``i`` predicts token ``t(i+k+1)``; depth 0 is the host's
    ordinary next-token head.
    """

    depth: int = 1
    """D: how many extra future tokens are predicted (D ≥ 1). DeepSeek-V3 released D = 1; Meta used 3 extra heads."""

    architecture: Literal["cascaded", "parallel"] = "cascaded"
    """``"cascaded"`` (DeepSeek-V3): module k reads h(k-1) and Emb(t(i+k)), strictly causal chain.
    ``"parallel"`` (Meta 2024, Medusa): D independent blocks on the trunk's last hidden state."""

    loss_weight: float = 0.3
    """λ: total loss = main loss + λ · mean_k(w_k · L_k). DeepSeek-V3 used 0.3, then 0.1."""

    depth_weights: Optional[list[float]] = None
    """Initial per-depth weights w_1..w_D (default all 1). Callbacks (``MTPWeightSchedule``) change them during
    training; the mean above divides by D, so equal weights give DeepSeek-V3's λ/D · Σ L_k."""

    share_embedding: bool = True
    """Use the host's token embedding inside the cascaded modules (never a copy)."""

    share_output_head: bool = True
    """Use the host's output projection for every depth (never a copy). ``False`` gives each depth its own head."""

    detach_trunk: bool = False
    """Stop gradients from the MTP loss into the trunk (and shared embedding/head): retrofit heads onto a trained
    model, Medusa-1 style. Combine with freezing the trunk to train the heads alone."""

    recompute: bool = False
    """Recompute the MTP depths in backward: each depth keeps only its inputs and its block's mid residual
    (B·L·H) between forward and backward, and reruns once in backward, piece by piece (``heads.recomputed_depth``)."""

    loss_chunk_size: Optional[int] = None
    """Rows of [tokens × vocab] logits materialised at once by the chunked cross-entropy. ``None`` picks it so that
    one chunk of logits is about as large as the hidden states (Liger-Kernel's rule)."""

    num_heads: Optional[int] = None
    """Attention heads of each MTP block. Default: the trunk's own for the bundled hosts (``CausalLM``,
    ``HFCausalLM``); ``hidden // 64`` for a custom host unless it overrides ``mtp_block_spec()``. Must divide the
    hidden size."""

    mlp_ratio: Optional[float] = None
    """Hidden size multiplier of each MTP block's SwiGLU. Default: the trunk's own for the bundled hosts (the
    ``transformers`` config's ``intermediate_size``); 8/3 for a custom host unless it overrides ``mtp_block_spec()``."""

    distill_weight: float = 0.0
    """Weight of the opt-in self-distillation term KL(stop-grad(main at i+k) ‖ depth k at i) that raises
    acceptance. 0 disables it."""

    ignore_index: int = -100
    """Target id that is never scored (padding)."""

    layout: Optional[Literal["lightning", "native"]] = None
    """Which MTP semantics the cascaded modules follow. ``"lightning"``: our own blocks (``heads.CascadedMTPModule``),
    pre-norm chaining. ``"native"``: the layout of models released with MTP layers (DeepSeek-V3, GLM-4.5; what
    ``transformers``' ``generate(use_mtp=True)`` runs): the host's own decoder-layer class as the block (mixture of
    experts included), depth 1 reads the trunk's state after its final norm, depth k+1 reads depth k's output after its
    ``post_norm``, and RoPE sits at the position of the consumed token (:mod:`lightning_mtp.native`). Such modules
    load from and export to ``transformers`` folders. ``None``: the host decides -- ``HFCausalLM`` picks
    ``"native"`` for model families that have native MTP layers (their config has ``num_nextn_predict_layers``),
    every other host ``"lightning"``."""

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise _fail("depth", f"must be >= 1, got {self.depth!r}")
        if self.architecture not in ARCHITECTURES:
            raise _fail("architecture", f"must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if not (is_finite_number(self.loss_weight) and self.loss_weight >= 0):
            raise _fail("loss_weight", f"must be a finite number >= 0, got {self.loss_weight!r}")
        if self.depth_weights is not None:
            if len(self.depth_weights) != self.depth:
                raise _fail("depth_weights", f"needs one weight per depth ({self.depth}), got {self.depth_weights!r}")
            if any(not (is_finite_number(w) and w >= 0) for w in self.depth_weights):
                raise _fail("depth_weights", f"must all be finite numbers >= 0, got {self.depth_weights!r}")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 1:
            raise _fail("loss_chunk_size", f"must be >= 1, got {self.loss_chunk_size!r}")
        if self.num_heads is not None and self.num_heads < 1:
            raise _fail("num_heads", f"must be >= 1, got {self.num_heads!r}")
        if self.mlp_ratio is not None and not (is_finite_number(self.mlp_ratio) and self.mlp_ratio > 0):
            raise _fail("mlp_ratio", f"must be a finite number > 0, got {self.mlp_ratio!r}")
        if not (is_finite_number(self.distill_weight) and self.distill_weight >= 0):
            raise _fail("distill_weight", f"must be a finite number >= 0, got {self.distill_weight!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise _fail("layout", f"must be one of {LAYOUTS} (or unset: the host decides), got {self.layout!r}")
        if self.layout == "native":
            self.check_native()

    def check_native(self) -> None:
        """Refuse settings the native layout cannot have (its modules are the checkpoint's: cascaded, sharing the
        host's embedding and head, blocks shaped like the host's own layers, no recomputed backward)."""
        why = {
            "architecture": self.architecture != "cascaded",
            "share_embedding": not self.share_embedding,
            "share_output_head": not self.share_output_head,
            "recompute": self.recompute,
            "num_heads": self.num_heads is not None,
            "mlp_ratio": self.mlp_ratio is not None,
        }
        bad = [name for name, wrong in why.items() if wrong]
        if bad:
            settings = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise _fail("layout", f"= 'native' (native MTP layers: cascaded, the host's own embedding, head and "
                                  f"decoder-layer shape) cannot be combined with {settings}: leave them at their "
                                  "defaults, or use --model.mtp.layout lightning")

    def to_dict(self) -> dict:
        return asdict(self)


def settings_from(cls: type, value: Any, flag: str) -> Any:
    """``value`` as a ``cls`` dataclass: a dict (what a config file or a ``--model.init_args.<name>.<field>`` flag
    gives) is checked for fields ``cls`` does not have, refused naming the flag (Python's own error names neither the
    flag nor the fields), then passed as keyword arguments; anything else is returned as it is.

    Example::

        >>> settings_from(MTPConfig, {"dept": 3}, "--model.init_args.mtp")
        Traceback (most recent call last):
        ...
        ValueError: --model.init_args.mtp.dept: MTPConfig has no field 'dept' (did you mean 'depth'?)
    """
    if not isinstance(value, dict):
        return value
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in value if key not in fields]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; its fields: {', '.join(fields)}"
        raise ValueError(f"{flag}.{unknown[0]}: {cls.__name__} has no field {unknown[0]!r}{hint}")
    return cls(**value)
