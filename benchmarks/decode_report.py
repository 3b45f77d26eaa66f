"""What ``benchmarks/decode.py``'s rows mean against issue #13: its targets, each met or missed at the row it was
measured at, the fastest row per decoder, and the plot (speedup over draft length for chains, speedup and tau over
the nodes verified per step for trees).

Example::

    >>> rows = [dict(mode="greedy", batch_size=1, decoder="plain", speedup=1.0, tau=1.0, policy=None, tree=None,
    ...              nodes=None, draft_tokens=None, tokens_per_s=100.0),
    ...         dict(mode="greedy", batch_size=1, decoder="tree", speedup=1.5, tau=3.2, policy="fixed", tree=[2, 1, 1],
    ...              nodes=6, draft_tokens=3, tokens_per_s=150.0)]
    >>> met = check_targets(rows)["batch 1 greedy tau, best tree"]
    >>> met["measured"], met["met"]
    (3.2, False)
    >>> best_per_decoder(rows)["greedy batch 1"]["tree"]["speedup"]
    1.5
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

TARGETS = {  # issue #13 (eager decoding, ratios within this run); "goal": a stretch value reported beside it
    "batch 1 greedy speedup, best tree": {"target": 2.0},
    "batch 1 greedy tau, best tree": {"target": 3.5},
    "batch 8 greedy speedup, auto": {"target": 1.0, "goal": 1.3},
    "batch 1 T=1 sampling speedup, best": {"target": 1.5},
    "every auto row vs plain of its mode and batch": {"target": 0.97},
}

def check_targets(rows: list[dict]) -> dict:
    """Each of :data:`TARGETS` met or missed, with the row it was measured at."""
    def best(candidates: list[dict], key: str = "speedup") -> Optional[dict]:
        return max(candidates, key=lambda r: r[key], default=None)

    greedy_trees = [r for r in rows if r["mode"] == "greedy" and r["batch_size"] == 1
                    and r["decoder"] in ("tree", "dynamic_tree")]
    wide = max((r["batch_size"] for r in rows), default=1)
    batch8 = [r for r in rows if r["mode"] == "greedy" and r["batch_size"] == (8 if any(
        r["batch_size"] == 8 for r in rows) else wide) and r["decoder"] == "auto"]
    sampling = [r for r in rows if r["mode"] == "sampling" and r["batch_size"] == 1 and r["decoder"] != "plain"]
    autos = [r for r in rows if r["decoder"] == "auto"]
    measured = {
        "batch 1 greedy speedup, best tree": (best(greedy_trees), "speedup"),
        "batch 1 greedy tau, best tree": (best(greedy_trees), "tau"),
        "batch 8 greedy speedup, auto": (best(batch8), "speedup"),
        "batch 1 T=1 sampling speedup, best": (best(sampling), "speedup"),
        "every auto row vs plain of its mode and batch": (min(autos, key=lambda r: r["speedup"], default=None),
                                                          "speedup"),
    }
    out = {}
    for name, spec in TARGETS.items():
        row, key = measured[name]
        value = None if row is None else row[key]
        where = None if row is None else {k: row[k] for k in ("mode", "decoder", "policy", "tree", "nodes",
                                                               "batch_size", "draft_tokens")}
        result = {"target": spec["target"], "measured": value, "met": value is not None and value >= spec["target"],
                  "at": where}
        if "goal" in spec:
            result.update(goal=spec["goal"], goal_met=value is not None and value >= spec["goal"])
        out[name] = result
    top_tau = best(greedy_trees, "tau")
    if top_tau is not None:  # the best tree is the fastest; a slower, bigger tree may reach a higher tau
        out["batch 1 greedy tau, best tree"]["highest_tau_of_any_tree"] = {
            k: top_tau[k] for k in ("tau", "speedup", "decoder", "tree", "nodes", "draft_tokens")}
    out["every auto row vs plain of its mode and batch"]["rows"] = [
        {"mode": r["mode"], "batch_size": r["batch_size"], "speedup": r["speedup"]} for r in autos]
    return out


def best_per_decoder(rows: list[dict]) -> dict:
    """Per mode and batch size, the fastest row of each decoder."""
    out: dict[str, dict] = {}
    for row in rows:
        group = out.setdefault(f"{row['mode']} batch {row['batch_size']}", {})
        if row["decoder"] not in group or row["speedup"] > group[row["decoder"]]["speedup"]:
            group[row["decoder"]] = {k: row[k] for k in ("policy", "tree", "nodes", "draft_tokens", "tau",
                                                         "tokens_per_s", "speedup")}
    return out


def plot(rows: list[dict], path: Path, depth: Optional[int] = None) -> None:
    """Chains: speedup over draft length. Trees: speedup and tau over the nodes verified per step (static trees
    labelled with their shape, dynamic trees as triangles, ``auto`` as a dashed line), per mode and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    groups = [(mode, batch) for mode in ("greedy", "sampling") for batch in sorted({r["batch_size"] for r in rows})]
    colors = {group: f"C{i}" for i, group in enumerate(groups)}
    for (mode, batch), color in colors.items():
        name = f"{mode}{' T=1' if mode == 'sampling' else ''}, batch {batch}"
        group = [r for r in rows if r["mode"] == mode and r["batch_size"] == batch]
        chains = sorted((r for r in group if r["decoder"] == "chain" and r["policy"] == "fixed"),
                        key=lambda r: r["draft_tokens"])
        if chains:
            ks = [r["draft_tokens"] for r in chains]
            axes[0].plot(ks, [r["speedup"] for r in chains], marker="o", color=color, label=name)
        for ax, key in ((axes[1], "speedup"), (axes[2], "tau")):
            if chains:
                ax.plot([r["nodes"] for r in chains], [r[key] for r in chains], color=color, lw=0.8, alpha=0.6)
            for r in (r for r in group if r["decoder"] == "tree"):
                ax.scatter(r["nodes"], r[key], marker="o", color=color, zorder=3)
                ax.annotate(",".join(map(str, r["tree"])), (r["nodes"], r[key]), fontsize=6, color=color,
                            xytext=(3, 3), textcoords="offset points")
            dynamic = [r for r in group if r["decoder"] == "dynamic_tree"]
            if dynamic:
                ax.scatter([r["nodes"] for r in dynamic], [r[key] for r in dynamic], marker="^", color=color,
                           zorder=3)
            for r in (r for r in group if r["decoder"] == "auto"):
                ax.axhline(r[key], color=color, ls="--", lw=1.0)
        axes[1].plot([], [], color=color, label=name)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    if depth:
        axes[0].axvline(depth, color="gray", ls=":", lw=0.8)
        axes[0].annotate(f"D={depth}", (depth, axes[0].get_ylim()[1]), fontsize=7, va="top", ha="right")
    ks = sorted({r["draft_tokens"] for r in rows if r["decoder"] == "chain"})
    if ks:
        axes[0].set_xticks(ks)
    axes[1].plot([], [], ls="", marker="o", color="gray", label="static tree (shape)")
    axes[1].plot([], [], ls="", marker="^", color="gray", label="dynamic tree")
    axes[1].plot([], [], ls="-", color="gray", lw=0.8, label="chain")
    axes[1].plot([], [], ls="--", color="gray", label="auto")
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
    axes[0].set(xlabel="draft tokens k (chain)", ylabel="speedup over plain decoding", title="chains")
    axes[1].set(xlabel="draft nodes verified per row and step", ylabel="speedup over plain decoding",
                title="trees: tokens/s speedup")
    axes[2].set(xlabel="draft nodes verified per row and step", ylabel="tau (tokens / main forward, bonus counted)",
                title="trees: tau")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
