"""Native MTP layers: ``transformers``' ``generate(use_mtp=True)`` against lightning-mtp's decoding of the same layers,
on the same model and prompts, in one run (issue #14).

1. The model, a ``transformers`` folder with native MTP layers (``model.layers.{N+k}.*``, ``num_nextn_predict_layers``):
   - default: a glm4_moe built from :data:`MODEL` (a mixture-of-experts trunk, D native MTP layers) and trained on the
     default corpus (the Python standard library's sources, ``TextDataModule``, byte tokenizer) through
     :class:`~lightning_mtp.models.HFCausalLM` and a Lightning ``Trainer``, as ``benchmarks/hf_compare.py`` does:
     trunk and MTP layers jointly for ``--trunk-seconds``, ``save_pretrained``; then the MTP layers alone, imported
     from that folder onto the frozen trunk (``freeze_trunk=True``), for ``--heads-seconds``, ``save_pretrained``
     again. Kept under ``.cache/lightning_mtp/benchmarks/`` (one folder per setting; ``--retrain`` rebuilds it);
   - ``--folder DIR``: any such folder (written by ``HFCausalLM.save_pretrained``, ``lightning-mtp export``, or a
     released checkpoint's shape), random prompts;
   - ``--smoke``: a tiny glm4_moe trained for ``--train-steps`` steps on arithmetic progressions (seconds).
2. Import it: ``HFCausalLM(pretrained=DIR, mtp=MTPConfig(depth=num_nextn_predict_layers))``.
3. Decode the same prompts (held-out files of the corpus, ragged lengths; greedy, no EOS: every run emits
   ``--max-new-tokens``), after one untimed warm-up call; at batch 1 the decoders interleaved prompt by prompt:
   - batch 1: ``transformers`` greedy ``generate``; ``transformers`` ``generate(use_mtp=True)`` (its
     ``MTPCandidateGenerator``, which re-reads the MTP weights from the folder at every call: part of its cost);
     ours plain (``speculative=False``), chain (``speculative=True``: D drafts a step) and ``speculative="auto"``
     (each step plain or a chain of 1..D drafts, whichever its fitted step costs and acceptance say pays; it learns
     them in its first call, the warm-up);
   - batch B (all prompts in one left-padded batch with an attention mask): ours plain, chain and auto
     (``transformers``' ``use_mtp`` decodes batch 1 only).
   Native MTP layers draft chains only (no trees): the drafting cache and the verify path of a ``transformers`` host
   take one chain per row.

Reports per row tokens/s (median over ``--repeats``), tau (tokens per main-model forward, the bonus token and the
prefill's token counted), acceptance per depth (accepted / drafted at depth k), the speedups over ``transformers``
plain greedy at batch 1 and over our own plain decoding at the same batch size, and whether every output equals
``transformers`` plain greedy token for token. Writes ``--out`` (default ``benchmarks/results/hf_mtp_compare.json``).

Usage::

    python benchmarks/hf_mtp_compare.py                          # default: about 9 minutes on 2 CPU cores
    python benchmarks/hf_mtp_compare.py --smoke                  # tiny model, seconds
    python benchmarks/hf_mtp_compare.py --folder path/to/glm     # a folder with native MTP layers
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_costs import AutoChoices, auto_memory  # noqa: E402
from hf_compare import default_data, fit, prompts_from  # noqa: E402
from report import provenance  # noqa: E402

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.data import TextDataModule  # noqa: E402
from lightning_mtp.decoding import generate  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402
from lightning_mtp.native import native_layer_count, register_mtp_patterns  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=688, moe_intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=4, head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=None,
             eos_token_id=None, pad_token_id=0)
"""The default run's glm4_moe (the vocabulary is the byte tokenizer's; ``num_nextn_predict_layers`` = ``--depth``):
six layers, the first dense, the others 4 routed experts (2 per token) and a shared one. Sized so that a decoding
step is mostly the trunk (D native layers cost about D/6 of it) and trunk + MTP training fits in a few minutes on
2 CPU cores."""

TRAINING = dict(learning_rate=3e-3, warmup_steps=20, attn_implementation="sdpa")
"""``HFCausalLM`` settings of both training phases (those of ``benchmarks/hf_compare.py``)."""

SMOKE_VOCAB = 128
SMOKE_CONFIG = dict(vocab_size=SMOKE_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                    max_position_embeddings=256, num_nextn_predict_layers=2, eos_token_id=None, pad_token_id=0)

NOTES = [
    "tau: generated tokens per main-model forward, the prefill's token and every verify step's bonus token counted "
    "(plain decoding: 1). transformers use_mtp: its forwards are the calls of "
    "MTPCandidateGenerator.update_candidate_strategy (one per main forward, prefill included).",
    "acceptance_per_depth[k-1]: drafts accepted at depth k / drafts made at depth k, over every timed call (null: "
    "no draft at that depth, e.g. auto chose plain steps). At a "
    "run's last step transformers counts only the accepted drafts that fit max_new_tokens; we count every one.",
    "speedup_vs_transformers_plain: tokens/s over transformers plain greedy at batch 1, for every row (at batch B a "
    "throughput ratio: transformers' use_mtp decodes batch 1 only). speedup_vs_own_plain: over lightning-mtp plain "
    "decoding at the same batch size.",
    "Native MTP layers draft chains only (no trees): mode 'chain' is D drafts a step, 'auto' picks plain or a chain "
    "of 1..D drafts each step.",
    "transformers use_mtp re-reads the MTP weights from the folder at every generate call (MtpModel.from_pretrained); "
    "that is part of its measured time.",
    "equals_transformers_plain: every row's new tokens equal transformers plain greedy's for the same prompt "
    "(decoded alone, unpadded).",
]


# ------------------------------------------------------------------------------------------------ the model
def progressions(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Arithmetic progressions mod the vocabulary (B, T): the smoke model's training data and prompts."""
    start = torch.randint(0, SMOKE_VOCAB, (rows, 1), generator=generator)
    return (start + torch.arange(length) * (start % 7 + 1)) % SMOKE_VOCAB


def smoke_folder(folder: Path, steps: int, prompts: int) -> tuple[list[torch.Tensor], dict]:
    """Train the tiny glm4_moe and export it to ``folder``; returns ragged prompts in its training distribution and
    what the training did."""
    torch.manual_seed(0)
    model = HFCausalLM("glm4_moe", SMOKE_CONFIG, mtp=MTPConfig(depth=SMOKE_CONFIG["num_nextn_predict_layers"]))
    model.configure_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for _ in range(steps):
        loss = model.compute_lm_loss(progressions(8, 32, generator)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    info = {"steps": steps, "seconds": time.perf_counter() - start, "last_loss": float(loss.detach())}
    model.eval().save_pretrained(str(folder))
    rows = progressions(prompts, 8, torch.Generator().manual_seed(2))  # (P, 8)
    return [row[8 - n :].view(1, -1) for row, n in zip(rows, ragged_lengths(prompts, 8))], info


def trained_folder(args: argparse.Namespace, data: TextDataModule) -> tuple[Path, dict]:
    """The default model's folder (trained now, or reused from the cache) and its training record."""
    config = dict(MODEL, vocab_size=data.vocab_size, num_nextn_predict_layers=args.depth)
    setting = {"model": config, "training": TRAINING, "trunk_seconds": args.trunk_seconds,
               "heads_seconds": args.heads_seconds, "max_bytes": args.max_bytes, "data": "byte, seq_len 128, batch 16"}
    key = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:10]
    root = ROOT / ".cache" / "lightning_mtp" / "benchmarks" / f"hf_mtp_model-{key}"
    record = root / "training.json"
    if record.is_file() and not args.retrain:
        print(f"reusing {root} (--retrain to train again)")
        return root / "model", {**json.loads(record.read_text()), "reused": True}
    torch.manual_seed(0)
    # 1. Trunk and native MTP layers jointly (MTP loss weight 0.3, as DeepSeek-V3 pretrained).
    joint = HFCausalLM("glm4_moe", config, mtp=MTPConfig(depth=args.depth), **TRAINING)
    joint_info = fit(joint, data, args.trunk_seconds)
    joint.eval().save_pretrained(str(root / "joint"))
    # 2. The MTP layers alone, imported from that folder onto the frozen trunk.
    heads = HFCausalLM(pretrained=str(root / "joint"), freeze_trunk=True, mtp=MTPConfig(depth=args.depth), **TRAINING)
    heads_info = fit(heads, data, args.heads_seconds) if args.heads_seconds > 0 else None
    heads.eval().save_pretrained(str(root / "model"))
    info = {"setting": setting, "joint_training": joint_info, "heads_training": heads_info}
    record.write_text(json.dumps(info, indent=2))
    return root / "model", {**info, "reused": False}


def ragged_lengths(count: int, longest: int) -> list[int]:
    """Prompt lengths cycling longest, -1/6, -2/6, -3/6: a batch of them is ragged."""
    step = max(1, longest // 6)
    return [max(1, longest - (i % 4) * step) for i in range(count)]


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and attention mask of ``prompts`` (each (1, L_b)), padded on the left with 0."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------------ decoders
@dataclass
class Tally:
    """What a decoder's timed calls did: tokens, main forwards and drafts per depth, summed over calls."""

    depth: int
    tokens: int = 0
    forwards: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted = self.drafted or [0] * self.depth
        self.accepted = self.accepted or [0] * self.depth

    def add(self, tokens: int, forwards: int, drafted: list[int], accepted: list[int]) -> None:
        self.tokens += tokens
        self.forwards += forwards
        for k in range(min(self.depth, len(drafted))):
            self.drafted[k] += drafted[k]
            self.accepted[k] += accepted[k]

    def row(self, speculative: bool) -> dict:
        return {"tau": self.tokens / max(1, self.forwards),
                "acceptance_per_depth": [a / d if d else None for a, d in zip(self.accepted, self.drafted)]
                if speculative else [],
                "drafted_per_depth": self.drafted if speculative else [],
                "accepted_per_depth": self.accepted if speculative else []}


@contextlib.contextmanager
def counting_mtp_steps(steps: list[tuple[int, int]]):
    """Record (drafts, accepted drafts) of every main forward of ``transformers``' ``generate(use_mtp=True)``:
    ``_assisted_decoding`` calls ``MTPCandidateGenerator.update_candidate_strategy(input_ids, scores, num_matches)``
    after each one, with the logits of the drafts and the bonus token as ``scores`` (B, drafts + 1, V)."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    original = MTPCandidateGenerator.update_candidate_strategy

    def record(generator, input_ids, scores, num_matches):
        steps.append((scores.shape[1] - 1, int(num_matches)))

    MTPCandidateGenerator.update_candidate_strategy = record
    try:
        yield steps
    finally:
        MTPCandidateGenerator.update_candidate_strategy = original


@dataclass
class Decoder:
    """One row of the table: ``run(ids, mask)`` decodes a batch and returns its (B, N) new tokens, adding what it did
    to ``tally`` when ``timed``."""

    system: str
    mode: str
    batch_size: int
    run: Callable[[torch.Tensor, Optional[torch.Tensor], Optional[Tally]], torch.Tensor]
    tally: Tally
    seconds: list[float] = field(default_factory=list)
    equal: bool = True

    @property
    def name(self) -> str:
        return f"{self.system} {self.mode} b{self.batch_size}"


def transformers_decoders(reference: Any, new: int, depth: int) -> list[Decoder]:
    """``transformers`` plain greedy and ``use_mtp`` at batch 1."""

    def plain(ids, mask, tally):
        out = reference.generate(ids, do_sample=False, max_new_tokens=new)[:, ids.shape[1] :]
        if tally is not None:
            tally.add(out.shape[1], out.shape[1], [], [])
        return out

    def use_mtp(ids, mask, tally):
        steps: list[tuple[int, int]] = []
        with counting_mtp_steps(steps):
            out = reference.generate(ids, do_sample=False, max_new_tokens=new, use_mtp=True)[:, ids.shape[1] :]
        if tally is not None:
            tally.add(out.shape[1], len(steps), [sum(d > k for d, _ in steps) for k in range(depth)],
                      [sum(a > k for _, a in steps) for k in range(depth)])
        return out

    return [Decoder("transformers", "plain", 1, plain, Tally(depth)),
            Decoder("transformers", "use_mtp", 1, use_mtp, Tally(depth))]


def our_decoders(model: HFCausalLM, new: int, depth: int, batch: int) -> list[Decoder]:
    """lightning-mtp plain, chain and auto at batch ``batch``."""

    def decoder(mode: str, speculative: Any) -> Decoder:
        def run(ids, mask, tally):
            out = generate(model, ids, new, speculative=speculative, attention_mask=mask)
            if tally is not None:
                stats = out.stats
                tally.add(stats.total_new_tokens, sum(stats.row_forwards), stats.drafted_per_depth,
                          stats.accepted_per_depth)
            return out.new_tokens

        return Decoder("lightning-mtp", mode, batch, run, Tally(depth))

    return [decoder("plain", False), decoder("chain", True), decoder("auto", "auto")]


def measure(decoders: list[Decoder], prompts: list[torch.Tensor], repeats: int, choices: AutoChoices) -> None:
    """Time every decoder over the prompt set after an untimed warm-up: at batch 1 prompt by prompt, the decoders
    interleaved prompt by prompt (the machine's drift reaches each alike); else one padded batch, the decoders in
    turn. Compare every output with the first decoder's (``transformers`` plain greedy at batch 1)."""
    batch_ids, batch_mask = left_padded(prompts)
    single = [d for d in decoders if d.batch_size == 1]

    def timed(decoder: Decoder, ids: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        counting = choices.counting(decoder.name) if decoder.mode == "auto" else contextlib.nullcontext()
        with counting:
            start = time.perf_counter()
            outputs = decoder.run(ids, mask, decoder.tally)
            return ([outputs[0]] if mask is None else list(outputs)), time.perf_counter() - start

    with torch.inference_mode():
        for decoder in decoders:  # warm-up; auto learns its costs and acceptance here (once per batch size)
            if decoder.batch_size == 1:
                decoder.run(prompts[0], None, None)
            else:
                decoder.run(batch_ids, batch_mask, None)
        for _ in range(repeats):
            outputs: dict[str, list[torch.Tensor]] = {d.name: [] for d in decoders}
            seconds: dict[str, float] = {d.name: 0.0 for d in decoders}
            for ids in prompts:
                for decoder in single:
                    out, spent = timed(decoder, ids, None)
                    outputs[decoder.name] += out
                    seconds[decoder.name] += spent
            for decoder in (d for d in decoders if d.batch_size != 1):
                outputs[decoder.name], seconds[decoder.name] = timed(decoder, batch_ids, batch_mask)
            reference = outputs[decoders[0].name]  # transformers plain greedy comes first
            for decoder in decoders:
                decoder.seconds.append(seconds[decoder.name])
                decoder.equal &= all(torch.equal(out, ref) for out, ref in zip(outputs[decoder.name], reference))


def rows_of(decoders: list[Decoder], new: int, prompts: int, choices: AutoChoices) -> list[dict]:
    tokens = new * prompts  # every run emits max_new_tokens per prompt (no EOS)
    speed = {d.name: tokens / statistics.median(d.seconds) for d in decoders}
    base = speed["transformers plain b1"]
    rows = []
    for d in decoders:
        row = {"system": d.system, "mode": d.mode, "batch_size": d.batch_size, "tokens_per_s": speed[d.name],
               "speedup_vs_transformers_plain": speed[d.name] / base,
               **d.tally.row(d.mode != "plain"), "equals_transformers_plain": d.equal, "new_tokens": tokens,
               "seconds_median": statistics.median(d.seconds), "seconds_all": d.seconds}
        if d.system == "lightning-mtp":
            row["speedup_vs_own_plain"] = speed[d.name] / speed[f"lightning-mtp plain b{d.batch_size}"]
        if d.mode == "auto":
            row["auto_choices"] = choices.histogram(d.name)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'system':14s} {'mode':8s} {'batch':>5s} {'tok/s':>8s} {'x tf':>6s} {'x own':>6s} {'tau':>5s}  "
          f"{'acceptance/depth':18s} equal")
    for r in rows:
        own = f"{r['speedup_vs_own_plain']:6.2f}" if "speedup_vs_own_plain" in r else f"{'':6s}"
        acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
        print(f"{r['system']:14s} {r['mode']:8s} {r['batch_size']:5d} {r['tokens_per_s']:8.1f} "
              f"{r['speedup_vs_transformers_plain']:6.2f} {own} {r['tau']:5.2f}  {acceptance:18s} "
              f"{r['equals_transformers_plain']}")


# ------------------------------------------------------------------------------------------------ main
def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="a transformers folder with native MTP layers (random prompts)")
    parser.add_argument("--smoke", action="store_true", help="a tiny glm4_moe trained on progressions instead")
    parser.add_argument("--trunk-seconds", type=float, default=300.0, help="joint trunk + MTP training (default run)")
    parser.add_argument("--heads-seconds", type=float, default=120.0, help="MTP layers alone on the frozen trunk")
    parser.add_argument("--depth", type=int, default=2, help="num_nextn_predict_layers of the default run's model")
    parser.add_argument("--retrain", action="store_true", help="train the default model even if it is cached")
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="of the default corpus")
    parser.add_argument("--train-steps", type=int, default=80, help="training steps of the --smoke model")
    parser.add_argument("--prompts", type=int, default=8, help="prompts; also the batch size of the batched rows")
    parser.add_argument("--prompt-tokens", type=int, default=48, help="longest prompt (the others are shorter)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hf_mtp_compare.json")
    args = parser.parse_args(argv)
    if args.smoke and args.folder is not None:
        parser.error("give at most one of --folder DIR and --smoke")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    from transformers.utils import logging as hf_logging

    args = parse(argv)
    threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # use_mtp loads its MTP layers at every call, each with a bar
    try:
        with tempfile.TemporaryDirectory() as scratch:
            return run(args, Path(scratch), argv)
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()


def run(args: argparse.Namespace, scratch: Path, argv: Optional[list[str]] = None) -> dict:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    setup: dict[str, Any] = {"arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.smoke:
        folder = scratch / "model"
        prompts, setup["training"] = smoke_folder(folder, args.train_steps, args.prompts)
        setup["prompts_from"] = "arithmetic progressions (the smoke model's training distribution)"
        setup["tokenizer"] = None
    elif args.folder is None:
        data = default_data(args.max_bytes)
        folder, setup["training"] = trained_folder(args, data)
        longest = prompts_from(data, args.prompts, args.prompt_tokens)  # (1, P) each, held-out files
        prompts = [p[:, p.shape[1] - n :] for p, n in zip(longest, ragged_lengths(args.prompts, args.prompt_tokens))]
        setup["prompts_from"] = ("held-out (validation) files of the default corpus, the Python standard library's "
                                 "sources: token offsets i * 97 (benchmarks/hf_compare.py prompts_from), the last "
                                 "L_i tokens")
        setup["tokenizer"] = f"byte (TextDataModule, vocab {data.vocab_size})"
    else:
        folder = args.folder
        vocab = AutoConfig.from_pretrained(folder).get_text_config().vocab_size
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (1, n), generator=generator)
                   for n in ragged_lengths(args.prompts, args.prompt_tokens)]
        setup["prompts_from"] = "random token ids"
        setup["tokenizer"] = None

    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference.generation_config.eos_token_id = None  # every run emits max_new_tokens
    register_mtp_patterns(reference)  # layer counts other than the released ones (native.transformers_mtp)
    depth = native_layer_count(reference.config)
    ours = HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=depth))
    ours.configure_model()
    ours.eval()
    new = args.max_new_tokens
    decoders = (transformers_decoders(reference, new, depth) + our_decoders(ours, new, depth, 1)
                + our_decoders(ours, new, depth, len(prompts)))
    choices = AutoChoices()
    measure(decoders, prompts, args.repeats, choices)
    rows = rows_of(decoders, new, len(prompts), choices)
    print_table(rows)

    setup.update({
        "folder": None if args.smoke else str(folder), "model_type": reference.config.model_type,
        "model": {k: v for k, v in reference.config.to_diff_dict().items() if not k.startswith(("_", "transformers"))},
        "parameters": sum(p.numel() for p in reference.parameters()),
        "mtp_parameters": sum(p.numel() for p in ours.mtp_modules.parameters()), "depth": depth,
        "import_report": ours.mtp_native_report.summary() if ours.mtp_native_report else None,
        "prompt_lengths": [p.shape[1] for p in prompts], "max_new_tokens": new, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "greedy": True, "eos": None,
        "timing": "median over repeats of the whole prompt set; batch 1: decoders interleaved prompt by prompt; one "
                  "untimed warm-up call each (auto learns there)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    })
    result = {**provenance(__file__, argv), "setup": setup, "notes": NOTES, "rows": rows,
              "auto_memory": auto_memory(ours)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
