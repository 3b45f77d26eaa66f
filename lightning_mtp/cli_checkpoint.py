"""What ``lightning-mtp`` takes from a checkpoint, and what it refuses, before any class is built.

A checkpoint (``--ckpt_path``, or ``--model.init_args.init_from`` for a new fit) decides the model's architecture
and the tokenizer. The rule is the same for every setting: what the user *gave* (in a ``--config`` file or as a
flag) must agree with the checkpoint, and what the user left unset is taken from it. A conflict is refused with a
message naming the flag and the checkpoint's value; it is never overridden unseen.

Example::

    >>> sorted(given_keys(["--model.init_args.mtp.depth", "3", "--data.seq_len=64", "--ckpt_path", "x"]))
    ['ckpt_path', 'data.seq_len', 'model.mtp.depth']
    >>> conflicts({"model.mtp.depth": 2}, {"model.mtp.depth": 3}, {"model.mtp.depth"})
    [('model.mtp.depth', 3, 2)]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import yaml

SECTIONS = ("model", "data", "trainer")

MODEL_KEYS_NOT_FROM_CHECKPOINT = ("generation", "init_from", "_instantiator", "_class_path")
"""Model init arguments that belong to the run, not to the weights: decoding settings, and where a fit started."""

TOKENIZER_SETTINGS = ("tokenizer", "vocab_size")
"""Data settings that choose the tokenizer; with a checkpoint, the checkpoint's tokenizer is used unless these ask
for another one, which is refused."""

EVAL_DATA_SETTINGS = ("corpus", "max_bytes", "seed", "val_fraction", "suffixes", "seq_len")
"""Data settings that default to the checkpoint's for predict/validate/test (held-out prompts and validation
windows come from the training run's own split); given ones may point elsewhere."""

RESUME_DATA_SETTINGS = EVAL_DATA_SETTINGS + ("batch_size",)
"""Data settings a resumed fit must keep: other values would continue on other data than the one it stopped in."""


def normalise(key: str) -> str:
    """``model.init_args.mtp.depth`` -> ``model.mtp.depth`` (LightningCLI accepts both spellings)."""
    return ".".join(part for part in key.split(".") if part != "init_args")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": leaf}`` with ``init_args`` levels dropped; lists are leaves."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = normalise(f"{prefix}.{key}" if prefix else str(key))
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def given_keys(args: Iterable[str], config_files: Iterable[Any] = ()) -> set[str]:
    """Dotted keys the user set as flags (``--a.b c`` / ``--a.b=c``) or in ``--config`` files."""
    keys: set[str] = set()
    for token in args:
        if token.startswith("--") and len(token) > 2:
            keys.add(normalise(token[2:].split("=", 1)[0]))
    for path in config_files:
        text = Path(str(path)).read_text(encoding="utf-8") if Path(str(path)).is_file() else str(path)
        content = yaml.safe_load(text)
        if isinstance(content, Mapping):
            keys.update(flatten(content))
    return keys


def config_files(args: list[str]) -> list[str]:
    """The values of ``--config`` / ``-c`` in ``args``."""
    files = []
    for i, token in enumerate(args):
        if token in ("--config", "-c") and i + 1 < len(args):
            files.append(args[i + 1])
        elif token.startswith("--config="):
            files.append(token.split("=", 1)[1])
    return files


def is_given(key: str, given: set[str]) -> bool:
    """Whether ``key`` or a section of it below the top level (``model.mtp`` for ``model.mtp.depth``) was given."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in given for n in range(2, len(parts) + 1))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def conflicts(saved: Mapping[str, Any], current: Mapping[str, Any], given: set[str]) -> list[tuple[str, Any, Any]]:
    """(key, given value, checkpoint value) for every given setting whose value differs from the checkpoint's."""
    return [(key, current.get(key), value) for key, value in saved.items()
            if is_given(key, given) and key in current and not same(current.get(key), value)]


def flag(key: str) -> str:
    """``model.mtp.depth`` -> ``--model.init_args.mtp.depth``."""
    section, _, rest = key.partition(".")
    return f"--{section}.init_args.{rest}" if section in ("model", "data") and rest else f"--{key}"


def describe_conflicts(found: list[tuple[str, Any, Any]], source: str, advice: str) -> str:
    lines = [f"{flag(key)} is {value!r}, but {source} has {saved!r}" for key, value, saved in found]
    return "; ".join(lines) + f". {advice}"


def model_settings(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's model init arguments that describe the weights, flattened under ``model.``."""
    kept = {k: v for k, v in hparams.items() if k not in MODEL_KEYS_NOT_FROM_CHECKPOINT}
    return flatten(kept, "model")


def data_settings(record: Optional[Mapping[str, Any]], names: Iterable[str]) -> dict[str, Any]:
    """The checkpoint's data settings ``names`` (from its tokenizer record), flattened under ``data.``."""
    settings = (record or {}).get("data") or {}
    return {f"data.{name}": settings[name] for name in names if name in settings}
