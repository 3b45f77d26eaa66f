"""The package's modules depend one way: no import cycle, and no module imports a layer above its own.

The graph is read from the source with ``ast`` (every ``import`` statement, at module level or inside a function,
except those under ``if TYPE_CHECKING:``), so a lazy import inside a method counts like any other. Layers, lowest
first (a module may import its own layer and the ones below):

    config, layers, kernels, zero, zero_settings, fsdp, fsdp_settings, sharded, data, metrics, checkpointing,
    checkpoint_files, finite
    → heads → loss, outputs, head calls, distillation (a loss term)
    → decoding (pure functions over a host; it never imports the mixin), the prediction writer
    → mixin (its ``generate``/``predict_step`` call down into decoding)
    → callbacks, strategies, optim → models → cli
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mtp"

LAYERS = [
    ("lightning_mtp.config", "lightning_mtp.small_matmul", "lightning_mtp.layers", "lightning_mtp.kernels",
     "lightning_mtp.zero", "lightning_mtp.data", "lightning_mtp.metrics", "lightning_mtp.checkpointing",
     "lightning_mtp.checkpoint_files",
     "lightning_mtp.flops", "lightning_mtp.finite", "lightning_mtp.zero_settings", "lightning_mtp.sharded",
     "lightning_mtp.fsdp", "lightning_mtp.fsdp_settings"),
    ("lightning_mtp.heads", "lightning_mtp.native"),
    ("lightning_mtp.loss", "lightning_mtp.outputs", "lightning_mtp.head_calls", "lightning_mtp.distillation"),
    ("lightning_mtp.decoding", "lightning_mtp.prediction_writer"),
    ("lightning_mtp.mixin",),
    ("lightning_mtp.callbacks", "lightning_mtp.strategies", "lightning_mtp.optim"),
    ("lightning_mtp.models",),
    ("lightning_mtp.cli", "lightning_mtp.cli_checkpoint", "lightning_mtp.cli_configs", "lightning_mtp.cli_errors",
     "lightning_mtp.cli_help", "lightning_mtp.cli_export"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (resolved to the deepest known module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                if isinstance(node, ast.ImportFrom):
                    break  # `from a.b import c`: the deepest of a.b.c / a.b that is a module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (empty when there is none)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def layer_of(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_layering.py: place it")


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    assert {"lightning_mtp.mixin", "lightning_mtp.decoding.speculative", "lightning_mtp.cli"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_every_module_imports_only_its_layer_and_below():
    upward = []
    for name, targets in import_graph().items():
        if name == "lightning_mtp":
            continue  # the package's public surface re-exports from every layer
        for target in targets:
            if target != "lightning_mtp" and layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "\n".join(sorted(upward))


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    """The walker counts imports inside functions and finds a two-module cycle."""
    graph = {"a": {"b"}, "b": {"a"}}
    assert find_cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from lightning_mtp.decoding import generate\n")
    known = {"lightning_mtp.decoding", "lightning_mtp.decoding.speculative"}
    assert imports_of("lightning_mtp.mixin.x", source, known) == {"lightning_mtp.decoding"}
