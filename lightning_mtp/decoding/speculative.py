"""Self-speculative decoding with the MTP heads, and plain autoregressive decoding with the same KV cache: small
functions over tensors (gpt-fast style), wired together by :func:`decode`.

1. :func:`prefill` runs the prompts through the trunk and picks each row's first token.
Then every step (:func:`~lightning_mtp.decoding.step.speculative_step`):
2. The drafter (:mod:`lightning_mtp.decoding.drafting`) proposes up to k tokens after each row's newest token.
3. :func:`~lightning_mtp.decoding.step.verify_forward` scores ``[newest token, drafts]`` in one trunk forward.
4. Acceptance: ``lightning_mtp.kernels.verify_drafts`` (greedy: longest prefix equal to the argmax plus the main
   model's next token; sampling: speculative rejection sampling, arXiv 2211.17192), or the opt-in, LOSSY Medusa
   typical acceptance (:func:`~lightning_mtp.decoding.step.accept_typical`).
5. :func:`~lightning_mtp.decoding.state.emit` appends each row's accepted tokens (its own count: ragged), stops
   rows at EOS or their budget, and moves each row's newest position; that move is the rollback of the positional
   caches (rejected entries are masked and overwritten later).

Finished rows stay in the batch with their position frozen and emit nothing, so each row's output is what decoding
it alone gives.

Under DeepSpeed ZeRO-3 with several processes every module call all-gathers its parameters, so all ranks must run the
same number of forwards (HF's ``synced_gpus``). Ranks accept different numbers of drafts, so the loop runs until an
all-reduced "all done" flag is set; a rank whose rows are all finished runs padding steps (its rows emit nothing), and
the adaptive draft length is driven by the all-reduced acceptance so every rank drafts the same number of depths.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mtp import small_matmul
from lightning_mtp.decoding.compiled import compile_decoding
from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.drafting import Drafter, DraftLength
from lightning_mtp.decoding.host import DecodingHost, decoding_host, module_device_dtype
from lightning_mtp.decoding.lockstep import all_ranks, gathered_output_head, needs_rank_sync
from lightning_mtp.decoding.sampling import SamplingParams, choose_tokens
from lightning_mtp.decoding.state import DecodeState, emit, new_state
from lightning_mtp.decoding.stats import DecodeStats, GenerateOutput
from lightning_mtp.decoding.step import plain_step, speculative_step
from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter
from lightning_mtp.decoding.tree_policy import draft_plan
from lightning_mtp.decoding.tree_step import tree_step
from lightning_mtp.finite import check_finite_weights


# ----------------------------------------------------------------------------------------------- input handling
def prepare_prompts(
    input_ids: Tensor, attention_mask: Optional[Tensor], vocab_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Validate the prompts; returns them starting at position 0, right-padded with 0 (B, P), and their lengths (B,).

    ``attention_mask`` (B, L) marks each row's prompt tokens with 1 (left or right padding both work: the masked-in
    tokens, in order, are the prompt).
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, length) tensor of token ids, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    batch, length = input_ids.shape
    if batch == 0:
        raise ValueError("input_ids is an empty batch (0 rows)")
    if length == 0:
        raise ValueError("input_ids: empty prompt (0 tokens); every row needs at least one token")
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (batch, length):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a tensor of input_ids' shape {(batch, length)}, got {got}")
        mask = attention_mask.to(device) != 0
    lengths = mask.sum(dim=1)  # (B,)
    if bool((lengths == 0).any()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"attention_mask: empty prompt in row(s) {rows}; every row needs at least one token")
    prompt_tokens = input_ids[mask]
    low, high = int(prompt_tokens.min()), int(prompt_tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab_size}) (the model's vocabulary), "
                         f"got ids in [{low}, {high}]")
    if attention_mask is None:
        return input_ids, lengths
    # Move each row's prompt tokens to the front, in order: the mask's cumulative count is the destination.
    destination = torch.where(mask, mask.long().cumsum(dim=1) - 1, torch.full_like(input_ids, length))
    packed = torch.zeros(batch, length + 1, dtype=torch.long, device=device)
    packed.scatter_(1, destination, torch.where(mask, input_ids, torch.zeros_like(input_ids)))
    return packed[:, : int(lengths.max())], lengths


def check_special_ids(config: GenerationConfig, vocab_size: int) -> None:
    """Refuse an EOS or pad id outside the vocabulary: such an EOS could never be emitted (rows would run to
    ``max_new_tokens`` without a word), and such padding would not decode."""
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        if value is not None and max(value if isinstance(value, list) else [value]) >= vocab_size:
            raise ValueError(f"{name} (GenerationConfig.{name}, --model.generation.{name}) is {value}, outside the "
                             f"model's vocabulary of {vocab_size} ids: give an id below {vocab_size} (the tokenizer's "
                             "own, or None for its default)")


def check_budget(prompt_lengths: Tensor, max_new_tokens: int, max_context: int) -> None:
    longest = int(prompt_lengths.max())
    if longest + max_new_tokens > max_context:
        raise ValueError(
            f"max_new_tokens: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {max_context} tokens; shorten the prompt or lower max_new_tokens (no truncation is applied)"
        )


# ----------------------------------------------------------------------------------------------- the steps
def prefill(host: DecodingHost, cache: Any, state: DecodeState) -> tuple[Tensor, Tensor, Tensor]:
    """Trunk over every prompt (B, P); returns hidden (B, P, H), positions (B, P) and the last prompt token's logits
    (B, V) of each row."""
    width = int(state.prompt_lengths.max())
    positions = torch.arange(width, device=state.tokens.device).expand(state.tokens.shape[0], width)  # (B, P)
    hidden = host.forward(state.tokens[:, :width], positions, cache)  # (B, P, H)
    state.main_forwards += 1
    last = hidden.gather(1, state.newest.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))  # (B, 1, H)
    return hidden, positions, host.main_logits(last)[:, 0]


# ----------------------------------------------------------------------------------------------- the loop
@torch.inference_mode()
def decode(host: DecodingHost, drafter: Optional[Drafter], prompts: Tensor, lengths: Tensor, config: GenerationConfig,
           generator: Optional[torch.Generator] = None, sync_ranks: bool = False,
           fused_step: Optional[Callable] = None, policy: Optional[Any] = None) -> GenerateOutput:
    """Decode validated prompts (B, P) right-padded with lengths (B,); ``drafter=None`` is plain decoding.

    The output's ``sequences`` are ``prompts`` followed by the new tokens (:func:`generate` puts its own
    ``input_ids`` there instead); padding is :func:`padding_id` of ``config``.

    ``sync_ranks``: keep every process of the default group in lockstep (DeepSpeed ZeRO-3; see the module docstring).
    ``fused_step``: :func:`~lightning_mtp.decoding.step.speculative_step` compiled (greedy, fixed draft length),
    used from the second step on (the first fills the MTP modules' caches over the whole prompt).
    ``policy``: what each step drafts (``next()`` / ``observe_step()``): :class:`DraftLength` (the default),
    :class:`FixedTree`, or ``auto``'s :class:`~lightning_mtp.decoding.tree_policy.AutoSteps` (its plain steps run here).
    """
    start = time.perf_counter()
    device = prompts.device
    params = SamplingParams(config.temperature, config.top_k, config.top_p)
    max_drafts, extra_slots = 0, 0
    tree_mode = isinstance(drafter, MTPTreeDrafter)
    if drafter is not None:
        max_drafts = drafter.max_drafts if tree_mode else config.draft_tokens or drafter.max_drafts
        if max_drafts > drafter.max_drafts:
            raise ValueError(f"draft_tokens={max_drafts} exceeds the MTP depth D={drafter.max_drafts} "
                             "(--model.mtp.depth)")
        if policy is None:
            policy = DraftLength(max_drafts, config.adaptive_draft_tokens, config.adaptive_min_reach)
        extra_slots = getattr(policy, "max_nodes", 0)
        if getattr(policy, "retired", False):  # `auto`: a call rated plain with nothing to measure (see .auto)
            drafter = None  # plain from the first step: the drafter's caches are neither allocated nor fed
    draft_params = SamplingParams() if config.acceptance == "typical" else params  # Medusa drafts top-1 candidates
    batch = prompts.shape[0]
    eos = config.eos_token_id
    state = new_state(prompts, lengths, config.max_new_tokens, max_drafts)
    cache_len = state.tokens.shape[1] + extra_slots  # prompt + budget + k + 1 spare slots (+ tree scratch slots)
    cache = host.allocate(batch, cache_len)
    state.cache_len = cache_len
    draft_state = None
    if drafter is not None:
        with gathered_output_head(getattr(drafter, "module", None)) if sync_ranks else contextlib.nullcontext():
            draft_state = drafter.allocate(batch, cache_len)

    hidden, positions, logits = prefill(host, cache, state)
    if drafter is not None:
        drafter.observe(draft_state, hidden, positions)
        drafter.commit(draft_state, int(positions.shape[1]))
    first = choose_tokens(logits, params, generator)  # (B,)
    emit(state, first.unsqueeze(1), torch.ones_like(first), config.max_new_tokens, eos)
    host.rollback(cache, state.newest)

    finished = _all_done(state, sync_ranks)
    per_row = getattr(policy, "per_row", False)  # `auto`: each row's accepted drafts (-1: finished) and budget
    done_rows, remaining = state.done.tolist(), [config.max_new_tokens - 1] * batch  # the rows, as the host knows them
    while not finished:
        if drafter is None:
            plain_step(host, cache, state, params, config, generator)
            host.rollback(cache, state.newest)
            finished = _all_done(state, sync_ranks)
            continue
        # the first step's windows cover the whole prompt; later steps have one shape (MTPDrafter.fixed_window)
        step = tree_step if tree_mode else fused_step if fused_step and state.main_forwards > 1 else speculative_step
        option = policy.next()
        shapes_measured = small_matmul.decisions()
        step_start = time.perf_counter()
        if not option:  # a plain step (`auto`'s: None or 0 drafts) as lean as the plain loop's: no summary tensors
            active_rows = done_rows.count(False) if per_row else int((~state.done).sum())
            drafter.observe(draft_state, *plain_step(host, cache, state, params, config, generator))
            host.rollback(cache, state.newest)
            done_rows = state.done.tolist()  # the step's one host sync
            drafter.commit(draft_state, 1)
            finished = _all_done(state, True) if sync_ranks else all(done_rows)
            remaining = [left - 1 for left in remaining]  # each active row advanced by one
            rows = {"rows": [-1 if done else 0 for done in done_rows], "remaining": remaining} if per_row else {}
            policy.observe_step(option, [], active_rows, _step_seconds(step_start, shapes_measured), **rows)
            continue
        summary = step(host, drafter, draft_state, cache, state, option, draft_params, config, generator)
        if sync_ranks:  # one all-reduce pair per step; finished ranks keep stepping (padding) until every rank is done
            summary = all_ranks(summary.long())
        if per_row:
            summary = torch.cat([summary.long(), state.last_accepted.masked_fill(state.done, -1),
                                 config.max_new_tokens - state.emitted])
        finished, moved, active_rows, *reached = summary.tolist()  # the step's one host sync
        drafter.commit(draft_state, int(moved))
        rows = {}
        if per_row:
            reached, accepted, remaining = reached[: -2 * batch], reached[-2 * batch : -batch], reached[-batch:]
            done_rows, rows = [a < 0 for a in accepted], {"rows": accepted, "remaining": remaining}
        policy.observe_step(option, reached, int(active_rows), _step_seconds(step_start, shapes_measured), **rows)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return finish(state, prompts, padding_id(config), max_drafts, batch, elapsed)


def _step_seconds(start: float, shapes_measured: int) -> float:
    """Seconds since ``start``; nan when the step timed new matrix-product shapes (once per process: not its cost)."""
    return time.perf_counter() - start if small_matmul.decisions() == shapes_measured else math.nan


def _all_done(state: DecodeState, sync_ranks: bool) -> bool:
    done = state.done.all().long().view(1)
    if sync_ranks:
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item())


def padding_id(config: GenerationConfig) -> int:
    """What fills the outputs after a row's last token: ``pad_token_id``, else EOS (``transformers``' fallback),
    else 0 (unused: without EOS every row generates ``max_new_tokens``)."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0


def finish(state: DecodeState, inputs: Tensor, pad: int, max_drafts: int, batch: int, elapsed: float) -> GenerateOutput:
    """Collect each row's new tokens (B, N), padded with ``pad``, after ``inputs`` (B, L): ``sequences`` (B, L + N)."""
    longest = int(state.emitted.max())
    steps = torch.arange(longest, device=state.tokens.device)  # (N,)
    index = state.prompt_lengths.unsqueeze(1) + steps  # (B, N) positions of the new tokens in the token buffer
    valid = steps < state.emitted.unsqueeze(1)  # (B, N)
    new_tokens = torch.where(valid, state.tokens.gather(1, index), pad)  # (B, N)
    sequences = torch.cat([inputs, new_tokens], dim=1)  # (B, L + N)
    stats = DecodeStats(
        batch_size=batch, max_drafts=max_drafts, main_forwards=state.main_forwards,
        row_forwards=state.row_forwards.tolist(), new_tokens=state.emitted.tolist(),
        drafted_per_depth=state.drafted[:max_drafts].tolist(), accepted_per_depth=state.accepted[:max_drafts].tolist(),
        accepted_length_histogram=state.histogram.tolist() if max_drafts else [], elapsed_s=elapsed,
    )
    return GenerateOutput(sequences, new_tokens, state.emitted.clone(), state.prompt_lengths.clone(), stats)


def generate(module: torch.nn.Module, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, speculative: Union[bool, str] = "auto",
             draft_tokens: Optional[int] = None, eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
             attention_mask: Optional[Tensor] = None, generator: Optional[torch.Generator] = None,
             **options: Any) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` after each prompt; self-speculative with the MTP heads by default.

    Args:
        module: an :class:`~lightning_mtp.MTPMixin` module with a :class:`~lightning_mtp.decoding.DecodingHost`
            (the bundled ``CausalLM``, any module defining ``mtp_decoding_host()``, or any ``MTPMixin`` module
            through the uncached default host).
        input_ids: (B, L) prompt token ids.
        attention_mask: (B, L) 1 on prompt tokens; rows may have different prompt lengths (left or right padding).
        generator: ``torch.Generator`` on the module's device for every random draw (or ``seed=``).
        max_new_tokens, temperature, ...: the fields of :class:`~lightning_mtp.decoding.GenerationConfig`, which
            documents each; ``pad_token_id`` defaults to the pad id of the tokenizer the module was trained with.

    Returns:
        :class:`GenerateOutput`: ``sequences`` (B, L + N) as ``transformers`` lays them out (``input_ids`` as given,
        then the new tokens, rows that stopped at EOS padded with ``pad_token_id``), the ragged view ``new_tokens``
        (B, N) with ``num_new_tokens`` (B,), and ``stats`` (:class:`DecodeStats`: forward passes, per-depth
        acceptance, ``tau`` counting the bonus token, tokens/s).

    Greedy speculative output equals plain greedy output token for token; sampled output has exactly the plain
    sampling distribution (unless ``acceptance="typical"``, which is lossy).
    """
    config = GenerationConfig.from_options(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, speculative=speculative,
        draft_tokens=draft_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **options,
    )
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer_pad_id(module)
    if config.seed is not None:
        if generator is not None:
            raise ValueError("generate() takes either seed or generator, not both: the seed would be ignored")
        generator = torch.Generator(device=module_device_dtype(module)[0]).manual_seed(config.seed)
    if hasattr(module, "require_mtp_modules"):
        module.require_mtp_modules()  # a module built lazily (configure_model) is built here, not in inference mode
    host = decoding_host(module)
    check_finite_weights(module)
    check_special_ids(config, host.vocab_size)
    sync_ranks = needs_rank_sync(module)
    device, _ = module_device_dtype(module)
    seeded = config.seed is not None or generator is not None
    drafter, policy = draft_plan(module, host, config, prompt_batch(input_ids), device, sync_ranks, seeded)
    fused_step = None
    if config.compile:
        if sync_ranks:
            raise ValueError("compile (--model.generation.compile) cannot be used when decoding is sharded over "
                             "several processes (DeepSpeed ZeRO-3, FSDP2); leave it False")
        fixed_greedy = (drafter is not None and not config.sampling and config.draft_confidence_threshold is None
                        and not config.adaptive_draft_tokens)
        host, drafter, fused_step = compile_decoding(module, host, drafter, fixed_greedy)
    prompts, lengths = prepare_prompts(input_ids, attention_mask, host.vocab_size, device)
    # a host leaves room for D verified positions past its budget; a deeper tree or chain verifies more
    deeper = drafter.max_drafts - len(module.require_mtp_modules()) if isinstance(drafter, MTPTreeDrafter) else 0
    check_budget(lengths, config.max_new_tokens, host.max_context - max(deeper, 0))
    if sync_ranks and config.draft_confidence_threshold is not None and speculative:
        raise ValueError(
            "draft_confidence_threshold (--model.generation.draft_confidence_threshold) cannot be used when decoding "
            "is sharded over several processes (DeepSpeed ZeRO-3, FSDP2): each rank would stop drafting at a "
            "different depth, run a different number of parameter all-gathers, and deadlock; leave it unset"
        )
    out = decode(host, drafter, prompts, lengths, config, generator, sync_ranks, fused_step, policy)
    # Plain tensors (not inference tensors), so that callers may use them in autograd.
    new_tokens = out.new_tokens.clone()  # (B, N)
    sequences = torch.cat([input_ids.to(device=device, dtype=torch.long), new_tokens], dim=1)  # (B, L + N)
    return GenerateOutput(sequences, new_tokens, out.num_new_tokens.clone(), out.prompt_lengths.clone(), out.stats)


def prompt_batch(input_ids: Any) -> int:
    """Rows of ``input_ids`` (validated later by :func:`prepare_prompts`; 1 when it is not a 2-D tensor yet)."""
    return int(input_ids.shape[0]) if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else 1


def tokenizer_pad_id(module: torch.nn.Module) -> Optional[int]:
    """The host's pad id (``MTPMixin.mtp_pad_token_id``: the pad id of the tokenizer its weights were trained with,
    or a ``transformers`` model's own), if known."""
    hook = getattr(module, "mtp_pad_token_id", None)
    pad = hook() if callable(hook) else None
    return int(pad) if pad is not None else None
