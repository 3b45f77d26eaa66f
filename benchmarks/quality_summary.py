"""The table of ``benchmarks/quality.py``: mean ± std per objective over seeds, and each seed's difference to the
next-token run of the same seed, with whether it stands beyond the seed noise."""

from __future__ import annotations

import statistics
from typing import Any


def mean_std(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    std = statistics.stdev(values) if len(values) > 1 else None
    return {"mean": round(statistics.fmean(values), 5), "std": None if std is None else round(std, 5),
            "n": len(values)}


def summarize(rows: list[dict[str, Any]], objectives: list[str]) -> dict[str, Any]:
    """Per objective: mean ± std of each metric; per MTP objective: the paired difference to ``next_token``."""
    by = {o: {r["seed"]: r for r in rows if r["objective"] == o} for o in objectives}
    base = by.get("next_token", {})
    summary = {}
    for objective in objectives:
        runs = by[objective]
        entry = {m: mean_std([r[m] for r in runs.values()]) for m in ("val_loss_stdlib", "val_loss_thirdparty", "tau")}
        entry["seeds"] = sorted(runs)
        if objective != "next_token" and base:
            for metric in ("val_loss_stdlib", "val_loss_thirdparty"):
                deltas = [runs[s][metric] - base[s][metric] for s in sorted(runs) if s in base]
                delta = mean_std(deltas)
                noise = max((summary["next_token"][metric]["std"] or 0.0) if "next_token" in summary else 0.0,
                            entry[metric]["std"] or 0.0)
                delta["seed_std"] = round(noise, 5)  # the larger of the two objectives' std over seeds
                # "beyond seed noise": the mean difference exceeds that std, and every seed moves the same way
                delta["beyond_seed_noise"] = bool(
                    delta["n"] > 1 and abs(delta["mean"]) > noise
                    and (all(d > 0 for d in deltas) or all(d < 0 for d in deltas))
                )
                entry[f"delta_{metric}"] = delta
        summary[objective] = entry
    return summary


def fmt(stat: dict[str, Any], digits: int = 3, signed: bool = False) -> str:
    if stat["mean"] is None:
        return "–"
    mean = f"{stat['mean']:+.{digits}f}" if signed else f"{stat['mean']:.{digits}f}"
    return mean if stat["std"] is None else f"{mean} ± {stat['std']:.{digits}f}"


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table."""
    lines = ["| objective | val loss, stdlib | Δ vs next-token | val loss, third-party | Δ vs next-token | τ (walk) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for objective, entry in summary.items():
        cells = [objective]
        for metric in ("val_loss_stdlib", "val_loss_thirdparty"):
            cells.append(fmt(entry[metric]))
            delta = entry.get(f"delta_{metric}")
            cells.append("–" if delta is None else fmt(delta, signed=True) + ("" if delta["beyond_seed_noise"] else
                                                                            " (within noise)"))
        cells.append(fmt(entry["tau"], digits=2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- sweep
