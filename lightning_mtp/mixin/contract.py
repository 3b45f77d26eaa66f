"""What ``MTPMixin`` asks of its host: the embedding, the output head, the final norm and the trunk's hidden states,
plus optional hooks with defaults (block shape, vocabulary, logit transform, decoding host, context length).
"""

from __future__ import annotations

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

    def mtp_trunk_hidden_states(self, input_ids: Tensor) -> Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} must implement mtp_trunk_hidden_states(input_ids) to use MTPMixin's default "
            "training_step; hosts with their own training_step call compute_mtp_loss(hidden, input_ids) instead"
        )

    def mtp_pad_token_id(self) -> Optional[int]:
        """Pad id that ``generate`` writes after a row's EOS in ``sequences`` when no ``pad_token_id`` is given:
        the pad id of the tokenizer the weights were trained with (``mtp_tokenizer``), else ``None`` (then EOS)."""
        record = getattr(self, "mtp_tokenizer", None)
        return (record or {}).get("pad_id")

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
