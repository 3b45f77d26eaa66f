"""What decoding returns: the sequences and the statistics (forwards, per-depth acceptance, tau, tokens/s)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import zip_longest

from torch import Tensor


@dataclass
class DecodeStats:
    """What one :func:`generate` call did.

    ``tau`` is the mean number of tokens emitted per main-model forward pass, *counting the bonus/correction token*
    that every verify forward adds (and the first token, which the prefill forward emits), per row: plain decoding
    has ``tau == 1`` exactly; speculative decoding with k drafts has ``1 <= tau <= k + 1``.
    """

    batch_size: int
    max_drafts: int
    """Drafts per step asked for (0 for plain decoding)."""
    main_forwards: int
    """Main-model (trunk) forward passes of the batch, prefill included."""
    row_forwards: list[int]
    """Forward passes while each row was still decoding."""
    new_tokens: list[int]
    """Tokens emitted by each row (EOS included)."""
    drafted_per_depth: list[int]
    """Drafts proposed at depth k (index k-1), summed over rows and steps."""
    accepted_per_depth: list[int]
    """Drafts accepted at depth k (index k-1), summed over rows and steps."""
    accepted_length_histogram: list[int]
    """How many drafting row-steps accepted 0, 1, ..., max_drafts drafts (``auto``'s plain steps draft nothing)."""
    elapsed_s: float
    """Wall time of the call (device synchronised)."""

    @property
    def total_new_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def tau(self) -> float:
        """Tokens emitted per main-model forward, bonus token counted (see the class docstring)."""
        return self.total_new_tokens / max(1, sum(self.row_forwards))

    @property
    def acceptance_per_depth(self) -> list[float]:
        """Share of drafts accepted at each depth."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.total_new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(total_new_tokens=self.total_new_tokens, tau=self.tau, acceptance_per_depth=self.acceptance_per_depth,
                   tokens_per_s=self.tokens_per_s)
        return out

    @staticmethod
    def combine(stats: list[DecodeStats]) -> dict:
        """Totals over several calls (e.g. the batches of ``predict``) as a plain dict."""
        if not stats:
            return {}

        def total(name: str) -> list[int]:  # per-call lists summed element by element (the longest's length)
            return [sum(values) for values in zip_longest(*(getattr(s, name) for s in stats), fillvalue=0)]

        merged = DecodeStats(
            batch_size=sum(s.batch_size for s in stats), max_drafts=max(s.max_drafts for s in stats),
            main_forwards=sum(s.main_forwards for s in stats), row_forwards=[sum(sum(s.row_forwards) for s in stats)],
            new_tokens=[sum(s.total_new_tokens for s in stats)], drafted_per_depth=total("drafted_per_depth"),
            accepted_per_depth=total("accepted_per_depth"), elapsed_s=sum(s.elapsed_s for s in stats),
            accepted_length_histogram=total("accepted_length_histogram"),
        )
        out = merged.to_dict()
        for name in ("batch_size", "max_drafts", "new_tokens"):
            del out[name]
        return {"calls": len(stats), "rows": merged.batch_size, **out, "row_forwards": merged.row_forwards[0]}


@dataclass
class GenerateOutput:
    """Result of :func:`generate`, laid out as ``transformers``' ``generate`` returns it.

    B is the batch, L the width of ``input_ids`` and N the most new tokens any row generated (≤ ``max_new_tokens``).
    ``pad_token_id`` is the ``pad_token_id`` the call resolved (see :class:`GenerationConfig`); padding is never
    ``-1``, so ``tokenizer.batch_decode(out.sequences, skip_special_tokens=True)`` gives prompt + completion.
    """

    sequences: Tensor
    """(B, L + N) ``input_ids`` exactly as given (left padding stays left, right padding stays in place: a
    right-padded row's new tokens start after column L, past its padding), then each row's new tokens; a row that
    stopped early (EOS) is padded on the right with ``pad_token_id``. ``sequences[:, L:]`` equals ``new_tokens``."""
    new_tokens: Tensor
    """(B, N) each row's generated tokens (EOS included), right-padded with ``pad_token_id``."""
    num_new_tokens: Tensor
    """(B,) generated tokens per row: ``new_tokens[b, :num_new_tokens[b]]`` is row b's completion (the ragged view)."""
    prompt_lengths: Tensor
    """(B,) prompt tokens per row (ones in ``attention_mask``; L without a mask)."""
    stats: DecodeStats
    """Forward passes, per-depth acceptance, tau and tokens/s of the call."""
