"""``speculative="auto"``'s mechanisms judged without timing noise: the policy replayed on measured step costs.

A timed ablation (``benchmarks/decode_ablation.py``) on a shared CPU swings 10-20% between runs, more than most
mechanisms are worth. Here the time of a step is taken out of the draw:

1. **Costs.** Each option (a plain step, a chain of k drafts) is run alone through ``auto``'s own decoding loop (its
   choice forced) on the held-out prompts, and its step time is the median over those steps (each call's first step,
   which fills the modules' caches over the prompt, left out), per batch size. A draft whose modules skipped
   positions (steps of a shallower draft, or plain, came before) recomputes them first: what such a step takes beyond
   a draft's cost, per position behind, is the median over passes that alternate plain steps and chains of 1 with the
   deepest chain (``catch_up`` in the JSON, relative to a plain step).
2. **Replay.** Every row decodes the prompts for real (its forwards, drafts and acceptance are the real ones), but the
   policy is told, for each step, the measured cost of the option it ran times a seeded log-normal noise
   (``--noise``, the spread of this machine's step times); the row's time is the sum of those costs without the
   noise. A call that ``auto`` retires to the plain loop costs its plain steps. Fixed chains and plain decoding are
   costed the same way, so the ratios compare decisions alone. One decision changes every later one (what is
   measured, which calls retire), so each ``auto`` row is the mean of ``--seeds`` policies, each with its own
   memory and noise draw.

Rows: plain, every fixed chain (1..D, and D + 1 for cascaded modules), the whole policy and the policy without each
mechanism of ``--ablate`` (:data:`decode_ablation.MECHANISMS`), each after one warm-up pass over the prompts in its
own memory, then ``--repeats`` passes. Assumptions: no EOS (every call emits ``--max-new-tokens``); a draft costs
its option's cost plus ``catch_up`` per position its modules are behind (0 in cost files without it); the prefill and
the first step's catching up over the prompt are left out (the same for every row).

Two mechanisms pay only when the machine changes, so two scenarios change it: ``--learned-on DRAW`` runs the warm-up
pass on another set of step costs (relative to the same plain step) than the replayed passes (``explore``: options
not chosen are measured again), and ``--slow-spell PLAIN_STEPS FACTOR`` makes every step FACTOR times dearer for the
first PLAIN_STEPS plain steps' worth of each row's replayed time (``speed``, which has nothing to follow otherwise and
is only turned off under a spell). Their rows are named after the scenario.

Usage::

    python benchmarks/decode_replay.py --ckpt outputs/quickstart/checkpoints/last.ckpt --label quickstart
    python benchmarks/decode_replay.py --hf-compare .cache/lightning_mtp/hf_compare --label hf_compare --append
    # (the results: with --prompts 8 --prompt-tokens 48 --max-new-tokens 64, hf_compare.py's prompt length and budget)
    python benchmarks/decode_replay.py ... --costs-from benchmarks/results/decode_replay.json  # reuse the costs
    python benchmarks/decode_replay.py --ckpt ... --label quickstart --costs-from benchmarks/cost_draws/costs_c.json \
        --learned-on benchmarks/cost_draws/costs_b.json --append  # learned on CPU costs, replayed on GPU-like ones
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import chunks, combined, held_out_prompts, load, run_chunk  # noqa: E402
from decode_ablation import MECHANISMS, save  # noqa: E402
from report import provenance  # noqa: E402

from lightning_mtp.decoding.auto import SWITCHES, AutoPolicy  # noqa: E402
from lightning_mtp.decoding.tree_policy import AutoSteps  # noqa: E402


class Replay:
    """What the patched loop does: forces an option (``force``), records real step times (``measured``), or feeds
    the policy ``costs`` (with noise) and sums them (``seconds``)."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.force: Optional[int] = None  # drafts of every step (0: plain); None: the policy decides
        self.costs: Optional[dict[int, float]] = None  # drafts -> seconds of a step; None: real times, recorded
        self.per_position = 0.0  # seconds a draft's modules take per position they catch up (added to its cost)
        self.cycle: list[int] = []  # forced drafts in turn, step by step (measuring the catching up)
        self.catching_up: list[tuple[int, int, float]] = []  # (drafts, positions behind, seconds) of such steps
        self.behind: list[int] = []  # by depth: positions its module skipped since it last ran, in the call
        self.noise, self.rng = 0.0, random.Random(0)
        self.spell = (0.0, 1.0)  # (seconds, factor): steps that start in the first seconds of a row cost factor times
        self.measured: dict[int, list[float]] = {}
        self.seconds = 0.0
        self.steps: Counter = Counter()

    def step(self, drafts: int, seconds: float, first: bool, behind: int) -> float:
        """The time the policy is told of a step of ``drafts`` whose modules were ``behind`` (real: ``seconds``)."""
        self.steps[drafts] += 1
        if self.costs is None:
            if not first and math.isfinite(seconds):
                if behind:
                    self.catching_up.append((drafts, behind, seconds))
                else:
                    self.measured.setdefault(drafts, []).append(seconds)
            return seconds
        cost = self._charge(drafts, 0 if first else behind)
        return cost * math.exp(self.rng.gauss(0.0, self.noise)) if math.isfinite(seconds) else seconds

    def caught_up(self, drafts: int, reached: list[int]) -> int:
        """The positions a step of ``drafts`` caught up first (summed over its modules), as the chain drafter's
        windows count them: a module not run falls behind by the most tokens a row gained in the step."""
        behind = sum(self.behind[1 : drafts + 1])
        gained = 1 + sum(hits > 0 for hits in reached[:drafts])
        self.behind = [0 if depth <= drafts else skipped + gained for depth, skipped in enumerate(self.behind)]
        return behind

    def retired(self) -> None:
        """A call decoded by the plain loop from its start: its plain steps."""
        self.steps["retired"] += self.max_new_tokens - 1
        if self.costs is not None:
            for _ in range(self.max_new_tokens - 1):
                self._charge(0)

    def _charge(self, drafts: int, behind: int = 0) -> float:
        """The modeled cost of a step of ``drafts`` whose modules were ``behind`` (``spell[1]`` times dearer while
        the row's time is within the slow spell), added to the row's ``seconds``."""
        factor = self.spell[1] if self.seconds < self.spell[0] else 1.0
        cost = (self.costs[drafts] + self.per_position * behind) * factor
        self.seconds += cost
        return cost


@contextlib.contextmanager
def patched(replay: Replay) -> Iterator[Replay]:
    """``auto``'s loop reporting to ``replay`` (chain options only: the policy's trees are not replayed)."""
    observe, init, choose = AutoSteps.observe_step, AutoSteps.__init__, AutoPolicy.next

    def observe_step(self, option, reached, active_rows, seconds, **rows):
        behind = replay.caught_up(int(option or 0), reached)
        told = replay.step(int(option or 0), seconds, first=self.policy.steps == 1, behind=behind)
        return observe(self, option, reached, active_rows, told, **rows)

    def start(self, policy, tree_mode):
        if tree_mode:
            raise ValueError("decode_replay replays chain options only")
        init(self, policy, tree_mode)
        replay.behind = [0] * (policy.deepest + 1)  # (the prompt, which the first step catches up, left out)
        if self.retired:
            replay.retired()

    def next_option(self):
        if replay.force is None and not replay.cycle:
            return choose(self)
        self.steps += 1
        drafts = replay.cycle[self.steps % len(replay.cycle)] if replay.cycle else replay.force
        return None if drafts == 0 else next(o for o in self.options[1:] if o.depth == drafts)

    AutoSteps.observe_step, AutoSteps.__init__, AutoPolicy.next = observe_step, start, next_option
    try:
        yield replay
    finally:
        AutoSteps.observe_step, AutoSteps.__init__, AutoPolicy.next = observe, init, choose


def decode_all(model, batches, tokens: int, memory: dict, switches: Optional[dict] = None) -> dict:
    """Every batch decoded by ``auto`` (forced or not) with ``switches`` set; the combined stats."""
    saved = dict(vars(SWITCHES))
    vars(SWITCHES).update(switches or {})
    model.__dict__["_mtp_auto_memory"] = memory
    try:
        return combined([run_chunk(model, chunk, tokens, torch.Generator().manual_seed(0), speculative="auto")
                         for chunk in batches])[1]
    finally:
        vars(SWITCHES).update(saved)


def step_costs(model, batches, tokens: int, options: list[int], repeats: int,
               replay: Replay) -> tuple[dict[int, float], float]:
    """(median seconds of a step of each option (drafts; 0: plain), seconds per position a draft catches up), the
    options interleaved batch by batch (the machine's drift reaches each alike). The catching up: passes of three
    plain steps, then of three chains of 1, each followed by two of the deepest chain (the first catches up)."""
    replay.costs, replay.force, replay.measured, replay.catching_up = None, None, {}, []
    deepest = options[-1]
    for _ in range(repeats):
        for chunk in batches:
            for drafts in options:
                replay.force = drafts
                decode_all(model, [chunk], tokens, {})
            for replay.cycle in ([0, 0, 0, deepest, deepest], [1, 1, 1, deepest, deepest]):
                decode_all(model, [chunk], tokens, {})
    replay.force, replay.cycle = None, []
    costs = {drafts: statistics.median(replay.measured[drafts]) for drafts in options}
    extra = [(seconds - costs[drafts]) / behind for drafts, behind, seconds in replay.catching_up]
    return costs, max(statistics.median(extra), 0.0) if extra else 0.0


def replay_rows(model, batches, tokens: int, costs: dict[int, float], args, replay: Replay,
                learned_on: Optional[dict[int, float]] = None) -> list[dict]:
    """Modeled seconds of plain decoding, each fixed chain, ``auto`` and ``auto`` without each mechanism (the
    warm-up pass on ``learned_on`` costs where given: the machine changed after ``auto`` learned)."""
    plan = [(f"chain k={k}" if k else "plain", k, {}) for k in costs]
    plan += [("auto", None, {})] + [(f"auto without {m}", None, {m: False}) for m in args.ablate
                                    if (m != "speed" or args.slow_spell[1] != 1.0) and args.ablation]
    replay.noise = args.noise
    rows = []
    for name, force, switches in plan:
        replay.force, spent, taus, steps = force, 0.0, [], Counter()
        for seed in range(args.seed, args.seed + (1 if force is not None else args.seeds)):  # fixed rows: no choice
            # each seed a policy of its own (its memory, its draw of noise): one decision changes every later one,
            # so a row is the sum over seeds, not one trajectory
            memory, replay.rng = {}, random.Random(seed)
            replay.costs, replay.spell = learned_on or costs, (0.0, 1.0)
            decode_all(model, batches, tokens, memory, switches)  # warm-up: auto learns its first pass here
            replay.costs, replay.steps, replay.seconds = costs, Counter(), 0.0
            replay.spell = (args.slow_spell[0] * costs[0], args.slow_spell[1])  # (plain steps' worth, factor)
            for _ in range(args.repeats):
                taus.append(decode_all(model, batches, tokens, memory, switches)["tau"])
            spent += replay.seconds / (args.repeats * (1 if force is not None else args.seeds))
            steps += replay.steps
        rows.append({"row": name, "seconds": spent, "tau": statistics.median(taus),
                     "steps": {str(k): v for k, v in sorted(steps.items(), key=str)}})
    replay.force = None
    plain = next(r["seconds"] for r in rows if r["row"] == "plain")
    best = min(r["seconds"] for r in rows if r["row"].startswith("chain"))
    auto = next(r["seconds"] for r in rows if r["row"] == "auto")
    for row in rows:
        row.update(vs_plain=plain / row["seconds"], vs_best_fixed=best / row["seconds"], vs_auto=auto / row["seconds"])
    return rows


def scenario_name(args: argparse.Namespace) -> str:
    """The rows' model name: ``--label``, and what ``--learned-on`` or ``--slow-spell`` changed (the costs of
    ``--costs-from`` are still looked up by ``--label``)."""
    changes = ([f"learned on {args.learned_on.stem}, replayed on {args.costs_from.stem}"] if args.learned_on else
               []) + (
        [f"{args.slow_spell[1]:g}x slower for {args.slow_spell[0]:g} plain steps"] if args.slow_spell[1] != 1.0 else [])
    return f"{args.label} ({', '.join(changes)})" if changes else args.label


def kept_costs(path: Path, label: str, batch: int) -> tuple[dict[int, float], float]:
    """(seconds of a step of each option (drafts; 0: plain), seconds per position caught up) that an earlier
    ``--out`` measured for ``label`` (0 where it did not measure the catching up)."""
    kept = json.loads(path.read_text())["step_costs"][label][str(batch)]
    plain = kept["plain_step_s"]
    return {int(k): v * plain for k, v in kept["relative"].items()}, kept.get("catch_up", 0.0) * plain


def load_model(args: argparse.Namespace):
    """(model, prompts) of ``--ckpt`` (held-out windows) or of ``--hf-compare`` (``hf_compare.py``'s model)."""
    if args.ckpt is not None:
        model, data = load(args.ckpt, ROOT / "benchmarks" / "decode_model.yaml")
        return model, held_out_prompts(data, args.prompts, args.prompt_tokens)
    from hf_compare import default_data, prompts_from, stored_model

    data = default_data()
    return stored_model(args.hf_compare, args.depth), [p.view(-1) for p in prompts_from(data, args.prompts,
                                                                                          args.prompt_tokens)]


def run(args: argparse.Namespace, argv: Optional[list[str]] = None) -> dict:
    torch.set_num_threads(args.threads)
    model, prompts = load_model(args)
    model.eval()
    replay = Replay(args.max_new_tokens)
    rows, costs_out = [], {}
    name = scenario_name(args)
    with torch.inference_mode(), patched(replay):
        depth = model.mtp_config.depth
        options = list(range(0, depth + 2 if model.mtp_config.architecture == "cascaded" else depth + 1))
        for batch in args.batch_sizes:
            batches = chunks(prompts, batch)
            decode_all(model, batches, args.max_new_tokens, {})  # warm-up: shapes measured, caches filled
            if args.costs_from is not None:  # the costs an earlier run measured (policy variants compared on them)
                costs, replay.per_position = kept_costs(args.costs_from, args.label, batch)
            else:
                costs, replay.per_position = step_costs(model, batches, args.max_new_tokens, options,
                                                        args.cost_repeats, replay)
            learned_on = None
            if args.learned_on is not None:  # the same plain step, the other draw's drafting costs relative to it
                relative = kept_costs(args.learned_on, args.label, batch)[0]
                learned_on = {k: v / relative[0] * costs[0] for k, v in relative.items()}
            costs_out[str(batch)] = {"plain_step_s": costs[0], "relative": {str(k): v / costs[0]
                                                                           for k, v in costs.items()},
                                     "catch_up": replay.per_position / costs[0]}
            print(f"batch {batch}: step cost per plain step {costs_out[str(batch)]['relative']}, catching up "
                  f"{costs_out[str(batch)]['catch_up']:.4f} per position", flush=True)
            for row in replay_rows(model, batches, args.max_new_tokens, costs, args, replay, learned_on):
                rows.append({"model": name, "batch_size": batch, **row})
                print(f"  {row['row']:22s} {row['vs_plain']:.3f}x plain  {row['vs_best_fixed']:.3f}x best fixed  "
                      f"tau {row['tau']:.2f}  {row['steps']}", flush=True)
    return {"rows": rows, "step_costs": {name: costs_out},
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **provenance(__file__, argv)}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", type=Path, help="a CausalLM checkpoint (its held-out prompts)")
    source.add_argument("--hf-compare", type=Path, help="hf_compare.py's --model-dir (its prompts)")
    parser.add_argument("--depth", type=int, default=3, help="the --hf-compare model's depth")
    parser.add_argument("--label", default="benchmark model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cost-repeats", type=int, default=2, help="passes of each option whose steps are timed")
    parser.add_argument("--repeats", type=int, default=3, help="replayed passes after each row's warm-up")
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal spread of the times the policy is told")
    parser.add_argument("--seed", type=int, default=0, help="the first noise seed")
    parser.add_argument("--seeds", type=int, default=4, help="policies replayed per auto row, each with its own "
                        "memory and noise seed (the row: their mean)")
    parser.add_argument("--costs-from", type=Path, help="replay on the step costs this earlier --out measured "
                        "for --label (instead of timing them again)")
    parser.add_argument("--learned-on", type=Path, help="the warm-up pass on this earlier --out's step costs "
                        "(relative to a plain step), the replayed passes on --costs-from's: the machine changed after "
                        "auto learned")
    parser.add_argument("--slow-spell", type=float, nargs=2, default=(0.0, 1.0), metavar=("PLAIN_STEPS", "FACTOR"),
                        help="the machine slows down for the first PLAIN_STEPS plain steps' worth of each row's "
                        "replayed time: every step then costs FACTOR times (another process; the speed mechanism)")
    parser.add_argument("--ablate", nargs="+", default=list(MECHANISMS), choices=MECHANISMS,
                        help="the mechanisms turned off one at a time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-ablation", dest="ablation", action="store_false",
                        help="plain, the fixed chains and auto only (no mechanism turned off)")
    parser.add_argument("--append", action="store_true", help="add this model's rows to an existing --out")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_replay.json")
    args = parser.parse_args(argv)
    return save(run(args, argv), args.out, scenario_name(args), args.append)


if __name__ == "__main__":
    main()
