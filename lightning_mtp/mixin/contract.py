"""What ``MTPMixin`` asks of its host: the embedding, the output head, the final norm and the trunk's hidden states,
plus optional hooks with defaults (block shape, vocabulary, logit transform, decoding host, context length).
"""

from __future__ import annotations

import inspect
from typing import Optional

from torch import Tensor, nn

from lightning_mtp.layers import mlp_hidden_size
from lightning_mtp.loss import LogitTransform


class MTPHostContract:
    """The methods a host overrides (the first four are required; the rest have defaults)."""

    def mtp_token_embedding(self) -> nn.Embedding:
        raise NotImplementedError(f"{type(self).__name__} must implement mtp_token_embedding() for MTPMixin")

    def mtp_output_head(self) -> nn.Linear:
        raise NotImplementedError(f"{type(self).__name__} must implement mtp_output_head() for MTPMixin")

    def mtp_final_norm(self) -> nn.Module:
        return nn.Identity()

    def mtp_trunk_hidden_states(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """The trunk's last hidden state (B, T, H), before the final norm, for token ids (B, T); causal: position i
        reads tokens 0..i only.

        ``position_ids`` is optional in an override: a host whose override has a ``position_ids`` parameter receives
        it for packed batches, (B, T) positions restarting at 0 at each document (``transformers``' convention), and
        must keep attention within each document (block-diagonal causal) with its position encoding at those
        positions; it is called without it (or with ``None``) for batches of one sequence per row. An override
        ``mtp_trunk_hidden_states(input_ids)`` without that parameter makes packed batches fail with a message
        (:meth:`mtp_run_trunk`); right-padded batches (``attention_mask``) need nothing from the host.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement mtp_trunk_hidden_states(input_ids) to use MTPMixin's default "
            "training_step; hosts with their own training_step call compute_mtp_loss(hidden, input_ids) instead"
        )

    def mtp_run_trunk(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """:meth:`mtp_trunk_hidden_states` of a batch: (B, T) ids, and for a packed batch its (B, T) positions.

        Raises:
            ValueError: ``position_ids`` given and the host's ``mtp_trunk_hidden_states`` takes no ``position_ids``:
                its attention would cross documents, so the batch is refused rather than trained on wrongly.
        """
        self.mtp_whole_root()  # FSDP2: the embedding and head are whole whatever the host's trunk call
        if position_ids is None:
            return self.mtp_trunk_hidden_states(input_ids)
        if not takes_position_ids(self.mtp_trunk_hidden_states):
            raise ValueError(
                f"{type(self).__name__}.mtp_trunk_hidden_states(input_ids) takes no position_ids, so it cannot keep "
                "the documents of a packed batch apart: give it a position_ids=None parameter (attention within each "
                "document, positions restarting at 0), or use --data.init_args.packing false"
            )
        return self.mtp_trunk_hidden_states(input_ids, position_ids=position_ids)

    def mtp_pad_token_id(self) -> Optional[int]:
        """Pad id that ``generate`` writes after a row's EOS in ``sequences`` when no ``pad_token_id`` is given:
        the pad id of the tokenizer the weights were trained with (``mtp_tokenizer``), else ``None`` (then EOS)."""
        record = getattr(self, "mtp_tokenizer", None)
        return (record or {}).get("pad_id")

    def mtp_stop_token_ids(self) -> list[int]:
        """Token ids the model's own folder says end a generation (``predict`` stops at these besides the
        tokenizer's EOS and end-of-turn ids); none by default."""
        return []

    def mtp_block_spec(self) -> dict:
        """Shape of each MTP block: ``dim``, ``n_heads``, ``n_kv_heads``, ``mlp_hidden``, ``eps``, ``max_positions``.

        Hosts with attention heads or a context length of their own override this; the default infers the width from
        the embedding and uses 64-wide heads.
        """
        dim = self.mtp_token_embedding().embedding_dim
        n_heads = self.mtp_config.num_heads or max(1, dim // 64)
        ratio = self.mtp_config.mlp_ratio or 8 / 3
        return dict(dim=dim, n_heads=n_heads, n_kv_heads=None, mlp_hidden=mlp_hidden_size(dim, ratio), eps=1e-6,
                    max_positions=4096)

    def mtp_vocab_size(self) -> int:
        return self.mtp_output_head().out_features

    def mtp_trunk_blocks(self) -> list[nn.Module]:
        """The trunk's repeated blocks, each made an FSDP2 unit by :meth:`~lightning_mtp.MTPMixin.mtp_fully_shard`
        (what is not in a block is sharded with the root: the embedding, the head, the final norm).

        Default: the elements of the host's longest ``nn.ModuleList`` outside the MTP modules
        (:func:`lightning_mtp.fsdp.default_trunk_blocks`); override it to name them (the bundled hosts do).
        """
        from lightning_mtp.fsdp import default_trunk_blocks

        return default_trunk_blocks(self)

    def mtp_logit_transform(self) -> LogitTransform:
        """What the host's forward does to its head's outputs (logit scaling, soft-capping); default: nothing.

        Every depth's logits get it: in the loss, in :meth:`mtp_depth_logits` (drafting), and wherever logits are
        formed by calling a head (``transform(mtp_depth_head(k)(normed))``). Hosts like Gemma-2 or Cohere override it.
        """
        return LogitTransform()

    def mtp_decoding_host(self):
        """A :class:`lightning_mtp.decoding.DecodingHost` for :meth:`generate`.

        ``None``: the bundled ``CausalLM``'s adapter, else :class:`lightning_mtp.decoding.UncachedHost` (no cache:
        each step re-runs ``mtp_trunk_hidden_states``; warned once per class). Return a host with a cache to decode
        faster (README, "Add MTP to your own module"); Hugging Face models return one over their own cache.
        """
        return None

    def mtp_max_sequence_length(self) -> Optional[int]:
        """Longest sequence the host supports (``None``: unknown). ``--data.seq_len`` is checked against it before
        training starts; minus the MTP depth, it bounds prompt + new tokens when decoding through the uncached host."""
        return None

    def mtp_context_flag(self) -> str:
        """The flag or field that sets :meth:`mtp_max_sequence_length`, for error messages."""
        return f"{type(self).__name__}.mtp_max_sequence_length()"

    def mtp_vocab_flag(self) -> str:
        """The flag or field that sets the model's vocabulary size, for error messages."""
        return f"{type(self).__name__}.mtp_vocab_size()"


def takes_position_ids(method) -> bool:
    """Whether ``method`` (a host's ``mtp_trunk_hidden_states``) has a parameter named ``position_ids``; a bare
    ``**kwargs`` does not count, since it may drop them."""
    try:
        return "position_ids" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
