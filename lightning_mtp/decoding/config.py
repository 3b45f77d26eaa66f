"""Typed settings of :func:`~lightning_mtp.decoding.generate`, ``predict_step`` and ``lightning-mtp predict``.

Every field is also a keyword argument of ``generate``. Errors name the argument and the CLI flag.

Example::

    >>> GenerationConfig(max_new_tokens=32, temperature=0.7, top_p=0.9).draft_tokens is None
    True
    >>> GenerationConfig(temperature=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: temperature (GenerationConfig.temperature, --model.generation.temperature) must be >= 0, got -1.0
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional, Union

from lightning_mtp.decoding.tree import MAX_DRAFT_DEPTH, TreeShape
from lightning_mtp.finite import is_finite_number

ACCEPTANCE_RULES = ("exact", "typical")


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"{field} (GenerationConfig.{field}, --model.generation.{field}) {message}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class GenerationConfig:
    """How to decode: budget, sampling, and the self-speculative draft/verify policy."""

    max_new_tokens: int = 64
    """Tokens to generate after each prompt (≥ 1). Prompt + ``max_new_tokens`` must fit the model's context."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples from softmax(logits / temperature)."""
    top_k: Optional[int] = None
    """Keep the k most likely tokens before sampling (ties with the k-th are kept)."""
    top_p: Optional[float] = None
    """Keep the smallest set of most likely tokens whose probability sums to ≥ p, in (0, 1]."""
    speculative: Union[bool, Literal["auto"]] = "auto"
    """``"auto"``: every step picks its draft (a plain step or a chain) by the most expected tokens per
    second, from a step-cost model fitted to the steps it times and running acceptance estimates
    (:mod:`lightning_mtp.decoding.auto`). ``True``:
    always draft (``draft_tokens`` / ``draft_tree``); ``False``: plain autoregressive decoding with the same KV
    cache (the reference). All three give the same greedy output and the same sampling distribution."""
    draft_tokens: Optional[int] = None
    """Drafts per step (default: the MTP depth D). Above D (cascaded modules only, up to 16) the last MTP module is
    applied again on its own output."""
    draft_tree: Optional[list[int]] = None
    """Static draft tree: candidates per node at each depth, e.g. ``[4, 2, 1]`` (4 at depth 1, 2 under each at
    depth 2, 1 under each at depth 3; 20 nodes verified in one forward). ``None``: a chain of ``draft_tokens``."""
    draft_tree_nodes: Optional[int] = None
    """Dynamic draft tree (EAGLE-2): keep the ``draft_tree_nodes`` candidates with the highest cumulative draft
    probability, expanding the ``draft_tree_top_k`` best nodes of each depth down to ``draft_tokens`` (default D)."""
    draft_tree_top_k: int = 4
    """Dynamic tree: candidates per expanded node and nodes expanded per depth."""
    eos_token_id: Union[int, list[int], None] = None
    """Stop a row after it emits this token, or any of these (``predict_step`` defaults to the tokenizer's EOS and a
    chat template's end of turn)."""
    pad_token_id: Optional[int] = None
    """Fills ``sequences`` and ``new_tokens`` after a row's last new token (a row that stopped at EOS), as
    ``transformers`` does. ``None``: the tokenizer's pad id (``predict_step``: the datamodule's; ``generate``: the
    module's ``mtp_tokenizer`` record, kept from training or the checkpoint), else ``eos_token_id`` (as
    ``transformers`` falls back), else 0 (never used then: without EOS every row generates ``max_new_tokens``)."""
    draft_confidence_threshold: Optional[float] = None
    """Dynamic draft length: a row stops drafting once the drafter's top probability at the next depth (after the same
    temperature / top-k / top-p processing as its drafts) falls below this value, decided before that depth's token is
    drawn; a step stops calling deeper MTP modules once every row has stopped. ``None`` always drafts
    ``draft_tokens``. Lossless for greedy decoding and for sampling (whether a depth is drafted never depends on the
    token drawn there)."""
    adaptive_draft_tokens: bool = False
    """Dynamic draft length: choose each step's number of drafts from the running acceptance (depth k is drafted while
    the running rate of reaching it stays ≥ ``adaptive_min_reach``; the full depth is re-probed every 8 steps).
    Lossless."""
    adaptive_min_reach: float = 0.25
    """Least running probability that all drafts up to a depth are accepted for that depth to be drafted."""
    acceptance: Literal["exact", "typical"] = "exact"
    """``"exact"``: greedy matching / speculative rejection sampling, output identical in distribution to plain
    decoding. ``"typical"``: Medusa's typical acceptance, LOSSY (output differs from the main model's distribution);
    needs ``temperature > 0``; drafts are then the heads' top-1 tokens, as in Medusa; opt-in only, never a default."""
    typical_epsilon: float = 0.09
    """Typical acceptance: accept x when p(x) > min(epsilon, delta · exp(-H(p))) (Medusa paper: epsilon = 0.09)."""
    typical_delta: float = 0.3
    """Typical acceptance: see ``typical_epsilon`` (Medusa paper: delta = 0.3)."""
    compile: bool = False
    """``torch.compile`` the per-step forwards (the trunk's decode steps and the MTP modules; prefill stays eager).
    Faster tokens/s for plain and speculative decoding alike once compiled; the first calls of each shape compile
    (tens of seconds). Bundled ``CausalLM`` host only. Greedy output stays identical to plain greedy decoding."""
    seed: Optional[int] = None
    """Seed of the sampling generator: the same seed gives the same samples (``generate`` also takes a
    ``generator`` instead; ``predict_step`` continues one seeded stream across batches)."""

    @classmethod
    def from_options(cls, **options: Any) -> GenerationConfig:
        """A config from keyword options, an unknown one refused naming those it takes (``transformers`` options such
        as ``repetition_penalty`` or ``min_p`` change the distribution that speculative sampling must keep)."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"generate(): unknown option(s) {unknown}; the options are "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**options)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _fail("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            self.temperature >= 0 and math.isfinite(self.temperature)
        ):
            raise _fail("temperature", f"must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise _fail("top_k", f"must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise _fail("top_p", f"must be in (0, 1] or None, got {self.top_p!r}")
        if self.speculative not in (True, False, "auto"):
            raise _fail("speculative", f"must be true, false or 'auto', got {self.speculative!r}")
        if self.draft_tokens is not None and (
            not _is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_DEPTH
        ):
            raise _fail("draft_tokens", f"must be an integer in [1, {MAX_DRAFT_DEPTH}] or None (= the MTP depth), "
                        f"got {self.draft_tokens!r}")
        self._check_tree()
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if self.eos_token_id is not None and not (eos and all(_is_int(i) and i >= 0 for i in eos)):
            raise _fail("eos_token_id", f"must be a token id >= 0, a list of them, or None, got {self.eos_token_id!r}")
        if self.pad_token_id is not None and (not _is_int(self.pad_token_id) or self.pad_token_id < 0):
            raise _fail("pad_token_id", f"must be a token id >= 0 or None, got {self.pad_token_id!r}")
        threshold = self.draft_confidence_threshold
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise _fail("draft_confidence_threshold", f"must be in [0, 1] or None, got {threshold!r}")
        if not 0 <= self.adaptive_min_reach <= 1:
            raise _fail("adaptive_min_reach", f"must be in [0, 1], got {self.adaptive_min_reach!r}")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise _fail("acceptance", f"must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
        if self.temperature == 0 and (self.top_k is not None or self.top_p not in (None, 1, 1.0)):
            warnings.warn("top_k / top_p (--model.generation.top_k / top_p) apply to sampling only: with temperature 0 "
                          "decoding is greedy and ignores them; set --model.generation.temperature > 0 to sample",
                          UserWarning, stacklevel=3)
        if self.acceptance == "typical" and self.temperature == 0:
            raise _fail("acceptance", "='typical' needs temperature > 0 (greedy decoding is already exact)")
        if not 0 < self.typical_epsilon <= 1:
            raise _fail("typical_epsilon", f"must be in (0, 1], got {self.typical_epsilon!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise _fail("seed", f"must be an integer >= 0 or None, got {self.seed!r}")
        if not (is_finite_number(self.typical_delta) and self.typical_delta > 0):
            raise _fail("typical_delta", f"must be a finite number > 0, got {self.typical_delta!r}")

    def _check_tree(self) -> None:
        tree = self.draft_tree
        if tree is not None:
            if isinstance(tree, (str, bytes)) or not hasattr(tree, "__iter__") or not list(tree) or any(
                not _is_int(b) or b < 1 for b in tree
            ) or len(list(tree)) > MAX_DRAFT_DEPTH:
                raise _fail("draft_tree", f"must be a list of 1..{MAX_DRAFT_DEPTH} integers >= 1 (candidates per "
                            f"node at each depth, e.g. [4, 2, 1]) or None, got {tree!r}")
            self.draft_tree = [int(b) for b in tree]
            if self.draft_tokens is not None:
                raise _fail("draft_tree", "and draft_tokens both set: the tree's length is its depth; leave "
                            "draft_tokens unset")
        nodes = self.draft_tree_nodes
        if nodes is not None:
            if not _is_int(nodes) or not 1 <= nodes <= 256:
                raise _fail("draft_tree_nodes", f"must be an integer in [1, 256] or None, got {nodes!r}")
            if tree is not None:
                raise _fail("draft_tree_nodes", "and draft_tree both set: pick a static tree (draft_tree) or a "
                            "dynamic one (draft_tree_nodes)")
        if not _is_int(self.draft_tree_top_k) or self.draft_tree_top_k < 1:
            raise _fail("draft_tree_top_k", f"must be an integer >= 1, got {self.draft_tree_top_k!r}")
        if tree is not None or nodes is not None:
            for field in self.chain_options():
                raise _fail(field, f"={getattr(self, field)!r} cannot be combined with draft trees: it applies to "
                            "chains of at most D drafts (leave draft_tree / draft_tree_nodes unset)")

    def chain_options(self) -> list[str]:
        """Options that only the chain drafter has (``speculative="auto"`` then keeps the fixed chain of D)."""
        chosen = {"acceptance": self.acceptance != "exact",
                  "draft_confidence_threshold": self.draft_confidence_threshold is not None,
                  "adaptive_draft_tokens": self.adaptive_draft_tokens, "compile": self.compile}
        return [field for field, on in chosen.items() if on]

    def tree_shape(self, mtp_depth: int) -> Optional[TreeShape]:
        """The fixed draft shape of ``speculative=True`` (``None``: the chain path of ``draft_tokens`` <= D)."""
        depth = self.draft_tokens or mtp_depth
        if self.draft_tree is not None:
            return TreeShape(branching=tuple(self.draft_tree))
        if self.draft_tree_nodes is not None:
            return TreeShape(nodes=self.draft_tree_nodes, top_k=self.draft_tree_top_k, max_depth=depth)
        if depth > mtp_depth:
            return TreeShape.chain(depth)
        return None

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def to_kwargs(self) -> dict:
        return asdict(self)
