"""Plot per-depth loss and teacher-forced acceptance from a run's TensorBoard event files.

Usage::

    python benchmarks/plot_tensorboard.py outputs/curves --out docs/mtp_curves.png
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one run under ``log_dir`` (its event files, a resumed fit's several among them); a folder
    holding several runs (``version_0``, ``version_1``... of separate fits) is refused: their steps would be drawn as
    one zigzagging line."""
    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    runs = sorted({str(f.parent) for f in files})
    if len(runs) > 1:
        raise SystemExit(f"{log_dir} holds {len(runs)} runs ({', '.join(runs[:4])}{', ...' if len(runs) > 4 else ''})"
                         ": give one of them")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for event_file in files:
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series[tag] += [(e.step, e.value) for e in accumulator.Scalars(tag)]
    return {tag: sorted(points) for tag, points in series.items()}


def plot(series: dict, out: Path) -> None:
    panels = [
        ("train loss per depth", r"train/(main/loss|mtp/loss_depth\d+)$"),
        ("validation loss per depth", r"val/(main/loss|mtp/loss_depth\d+)$"),
        ("teacher-forced acceptance (chained)", r"val/mtp/accept_chained_depth\d+$"),
        ("expected tokens per forward (tau_walk)", r"val/mtp/tau_walk_draft\d+$"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (title, pattern) in zip(axes, panels):
        for tag in sorted(t for t in series if re.search(pattern, t)):
            steps, values = zip(*series[tag])
            ax.plot(steps, values, label=tag.split("/", 1)[1], marker="." if len(steps) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("mtp_curves.png"))
    args = parser.parse_args()
    series = read_scalars(args.log_dir)
    if not series:
        raise SystemExit(f"no TensorBoard scalars under {args.log_dir}")
    plot(series, args.out)
    print(f"wrote {args.out} from {len(series)} series")


if __name__ == "__main__":
    main()
