"""The pieces every renderer of ``docs/results.md`` shares: what a run records (:func:`provenance`), number and
table formatting, and the :class:`Source` / :class:`Entry` a renderer is handed (see ``benchmarks/report.py``)."""

from __future__ import annotations

import ast
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
DEV_MACHINE = "the project's 2-core CPU development machine"
"""What is known of the machine behind a JSON that does not record its own."""


# ----------------------------------------------------------------------------------------------- what runs record
def provenance(script: str, argv: Optional[Sequence[str]] = None, device: str = "cpu") -> dict[str, Any]:
    """The command line and the machine of a benchmark run, for its JSON: ``{"command": ..., "machine": {...}}``.

    ``script``: the benchmark's ``__file__``; ``argv``: the arguments its ``main`` parsed (default ``sys.argv[1:]``);
    ``device``: where the measured work ran. Call it after the script has set its torch threads."""
    import torch

    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "device": device}
    if torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name()
    return {"command": shlex.join(["python", f"benchmarks/{Path(script).name}", *args]), "machine": machine}


# ----------------------------------------------------------------------------------------------- formatting
def num(value: Any, digits: int = 2, suffix: str = "") -> str:
    """``value`` with ``digits`` decimals (``–`` for None, yes/no for booleans)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    text = f"{value:.{digits}f}"
    if text.lstrip("-").strip("0.") == "":
        text = text.lstrip("-")
    return text + suffix


def plural(count: Any, noun: str) -> str:
    """``1 torch thread``, ``2 torch threads``."""
    return f"{count} {noun}" + ("" if str(count) == "1" else "s")


def times(value: Any, digits: int = 2) -> str:
    """A ratio: ``1.23×``."""
    return num(value, digits, "×")


def code(text: Any) -> str:
    return f"`{text}`"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table (pipes inside cells escaped)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows), ""]


def per_depth(values: Optional[Sequence[Any]], digits: int = 2) -> str:
    """Per-depth values: ``0.81 / 0.66 / 0.55``."""
    return " / ".join(num(v, digits) for v in values) if values else "–"


def command_from(script: str, arguments: dict[str, Any], skip: Sequence[str] = ("out",)) -> str:
    """The command line that gives ``arguments`` (argparse dests, in recorded order) to ``benchmarks/<script>``."""
    parts = ["python", f"benchmarks/{script}"]
    for key, value in arguments.items():
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def documented_commands(script: str) -> list[str]:
    """The ``python benchmarks/...`` lines of a script's docstring (continuations joined, comments dropped)."""
    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / script).read_text(encoding="utf-8"))) or ""
    commands, current = [], ""
    for raw in doc.splitlines():
        line = " ".join(raw.split("  #")[0].split())
        if current:
            current += " " + line.rstrip("\\").strip()
        elif line.startswith("python benchmarks/"):
            current = line.rstrip("\\").strip()
        if current and not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


MACHINE_FIELDS: dict[str, Callable[[Any], str]] = {
    "platform": str,
    "processor": lambda v: f"processor {v}",
    "cpus": lambda v: f"{v} CPUs",
    "python": lambda v: f"Python {v}",
    "torch": lambda v: f"torch {v}",
    "transformers": lambda v: f"transformers {v}",
    "torch_threads": lambda v: plural(v, "torch thread"),
    "threads": lambda v: plural(v, "torch thread"),
    "threads_per_run": lambda v: plural(v, "torch thread") + " per run",
    "runs_at_once": lambda v: f"{v} runs at once",
    "device": lambda v: f"device {v}",
    "gpu": lambda v: f"GPU {v}",
}


def machine_text(machine: Any, recorded: Optional[dict[str, Any]] = None) -> str:
    """The machine a JSON records, or what is known when it records none; ``recorded``: other recorded facts
    about it (``{"torch_threads": 2}``), shown either way."""
    facts = dict(machine) if isinstance(machine, dict) else {}
    for key, value in (recorded or {}).items():
        facts.setdefault(key, value)
    words = [MACHINE_FIELDS.get(k, lambda v, k=k: f"{k} {v}")(v) for k, v in facts.items() if v is not None]
    if isinstance(machine, dict):
        return "; ".join(words)
    if isinstance(machine, str):
        words.insert(0, f"processor {machine}")
        return f"only partly recorded in the JSON ({'; '.join(words)}); {DEV_MACHINE}"
    known = f"; recorded: {', '.join(words)}" if words else ""
    return f"not recorded in the JSON ({DEV_MACHINE}){known}"


def machines_text(machines: dict[str, Any], recorded: Optional[dict[str, Any]] = None) -> str:
    """The machine of several runs (label → machine), or each run's where they differ."""
    if len({json.dumps(m, sort_keys=True) for m in machines.values()}) <= 1:
        return machine_text(next(iter(machines.values()), None), recorded)
    return "differs between runs: " + "; ".join(f"{label}: {machine_text(machine, recorded)}"
                                                 for label, machine in sorted(machines.items()))


def command_text(command: Optional[str], reconstructed: Optional[str] = None, note: str = "") -> str:
    """The command as the JSON records it, or rebuilt from the arguments it records."""
    if command:
        return f"{code(command)} (recorded in the JSON)"
    if reconstructed:
        return (f"{code(reconstructed)} (rebuilt from the arguments the JSON records; it does not record the command "
                f"line{note})")
    return "not recorded in the JSON"


def result_link(name: str) -> str:
    """A link from ``docs/`` to ``benchmarks/results/<name>``."""
    return f"[{code('benchmarks/results/' + name)}](../benchmarks/results/{name})"


def provenance_lines(source: Source, machine: str, command: str) -> list[str]:
    lines = [f"- **Machine:** {machine}", f"- **Command:** {command}", f"- **Data:** {result_link(source.name)}"]
    if source.image:
        lines.append(f"- **Plot:** {result_link(source.image)}")
    return lines + [""]


# ----------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    """One result file as a renderer sees it: ``name`` relative to ``benchmarks/results``, its parsed JSON, the
    parsed companion files beside it (by file name) and the PNG of the same name, if any."""

    name: str
    data: Any
    companions: dict[str, Any] = field(default_factory=dict)
    image: Optional[str] = None


@dataclass(frozen=True)
class Entry:
    """A known result file: its section title, renderer and the files beside it the renderer also reads."""

    title: str
    render: Callable[[Source], list[str]]
    companions: tuple[str, ...] = ()
