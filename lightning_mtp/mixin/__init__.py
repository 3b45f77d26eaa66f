"""``MTPMixin``: adds multi-token prediction heads and their loss to an existing LightningModule.

The host keeps its model; the mixin needs four methods from it (:class:`MTPHostContract` lists them and the
optional hooks with their defaults: ``mtp_block_spec``, ``mtp_logit_transform``, ``mtp_decoding_host``, ...):

1. ``mtp_token_embedding()`` -> the token embedding module (``nn.Embedding``), shared with the cascaded modules;
2. ``mtp_output_head()`` -> the vocabulary projection (``nn.Linear``), shared by every depth;
3. ``mtp_final_norm()`` -> the trunk's final norm used for the next-token loss (default: identity);
4. ``mtp_trunk_hidden_states(input_ids)`` -> the trunk's last hidden state (B, T, H), before the final norm. For
   packed batches it takes ``position_ids=None`` too (attention within each document); without that parameter,
   packed batches are refused (:meth:`MTPHostContract.mtp_trunk_hidden_states`).

Example::

    import lightning as L
    from torch import nn
    from lightning_mtp import MTPConfig, MTPMixin

    class TinyLM(MTPMixin, L.LightningModule):
        def __init__(self, vocab=256, dim=64):
            super().__init__(mtp=MTPConfig(depth=2))
            self.embed = nn.Embedding(vocab, dim)
            self.trunk = nn.GRU(dim, dim, batch_first=True)  # any causal trunk
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def mtp_token_embedding(self): return self.embed
        def mtp_output_head(self): return self.head
        def mtp_final_norm(self): return self.norm
        def mtp_trunk_hidden_states(self, input_ids): return self.trunk(self.embed(input_ids))[0]

        def configure_optimizers(self): ...

The default ``training_step``/``validation_step`` take batches of token ids: a (B, T) tensor, or a dict in
``transformers``' conventions with ``input_ids`` and optional ``labels`` (-100 where not trained, unshifted),
``attention_mask`` (right padding) and ``position_ids`` (packed documents, restarting at 0 at each one; see
:mod:`lightning_mtp.mixin.steps`). Hosts with their own ``training_step`` call :meth:`MTPMixin.compute_mtp_loss`
with their hidden states (and ``position_ids`` for packed batches) and add its ``loss`` to theirs.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import nn

from lightning_mtp import checkpointing
from lightning_mtp.config import MTPConfig, settings_from
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.distillation import self_distillation_term
from lightning_mtp.mixin.batches import batch_position_ids, unpack_batch
from lightning_mtp.mixin.construction import MTPConstruction, check_block_spec
from lightning_mtp.mixin.contract import MTPHostContract
from lightning_mtp.mixin.divergence import MTPDivergenceGuard
from lightning_mtp.mixin.lifecycle import MTPLifecycle
from lightning_mtp.mixin.objective import MTPObjective
from lightning_mtp.mixin.sharding import MTPSharding
from lightning_mtp.mixin.steps import MTPSteps
from lightning_mtp.outputs import LossTerm, MTPForward, MTPLossOutput

__all__ = ["LossTerm", "MTPForward", "MTPLossOutput", "MTPMixin", "batch_position_ids", "check_block_spec",
           "unpack_batch"]


class MTPMixin(MTPSteps, MTPLifecycle, MTPDivergenceGuard, MTPObjective, MTPSharding, MTPConstruction,
               MTPHostContract):
    """Multi-token prediction for a LightningModule; see the module docstring for what the host provides.

    One class per concept, in ``lightning_mtp/mixin/``: :class:`MTPHostContract` (what the host provides),
    :class:`MTPConstruction` (building the modules), :class:`MTPObjective` (the loss), :class:`MTPSteps` (Lightning
    steps and generation), :class:`MTPLifecycle` (checks and checkpoint hooks), :class:`MTPDivergenceGuard` (a
    non-finite loss or gradient stops the fit before the optimizer step), :class:`MTPSharding` (FSDP2 units for the
    trunk's blocks, the MTP modules and the root).
    """

    def __init__(self, *args: Any, mtp: Union[MTPConfig, dict, None] = None,
                 generation: Union[GenerationConfig, dict, None] = None, **kwargs: Any) -> None:
        """``mtp``: the heads and their loss. ``generation``: how ``predict_step`` decodes; a module of your own
        that takes a ``generation`` argument and passes it here gets ``--model.init_args.generation.*`` in
        ``lightning-mtp predict`` (the CLI also applies those settings to a module without one)."""
        super().__init__(*args, **kwargs)
        mtp = settings_from(MTPConfig, mtp, "--model.init_args.mtp")
        generation = settings_from(GenerationConfig, generation, "--model.init_args.generation")
        self.generation_config: GenerationConfig = generation or GenerationConfig()
        self.mtp_generate_kwargs: dict = self.generation_config.to_kwargs()
        self.mtp_config: MTPConfig = mtp if mtp is not None else MTPConfig()
        # Runtime schedule state, driven by callbacks and saved in checkpoints.
        self.mtp_loss_weight: float = self.mtp_config.loss_weight
        self.mtp_depth_weights: list[float] = list(self.mtp_config.depth_weights or [1.0] * self.mtp_config.depth)
        self.mtp_active_depth: int = self.mtp_config.depth
        self.mtp_draft_temperatures: list[float] = [1.0] * self.mtp_config.depth
        self._mtp_loss_terms: dict[str, LossTerm] = {}
        self.mtp_modules: Optional[nn.ModuleList] = None
        self.mtp_output_heads: Optional[nn.ModuleList] = None
        self.mtp_load_report: Optional[checkpointing.LoadReport] = None
        self.mtp_tokenizer: Optional[dict] = None  # Tokenizer.spec() of the tokenizer the weights were trained with
        self.mtp_distill_weight: float = self.mtp_config.distill_weight
        if self.mtp_config.distill_weight > 0:
            self.register_mtp_loss_term("distill", self_distillation_term)
