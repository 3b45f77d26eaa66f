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

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_mtp.checkpoint_files import HEADS_ONLY_KEY

SECTIONS = ("model", "data", "trainer")

OPTIMIZER_SETTINGS = ("model.learning_rate", "model.weight_decay", "model.warmup_steps")
"""Model settings that shape training, not the weights: predict/validate/test take any value; a resumed fit keeps the
checkpoint's (its optimizer state and schedule continue)."""

MODEL_KEYS_NOT_FROM_CHECKPOINT = ("generation", "init_from", "_instantiator", "_class_path")
"""Model init arguments that belong to the run, not to the weights: decoding settings, and where a fit started."""

TOKENIZER_SETTINGS = ("tokenizer", "vocab_size")
"""Data settings that choose the tokenizer; with a checkpoint, the checkpoint's tokenizer is used unless these ask
for another one, which is refused."""

EVAL_DATA_SETTINGS = ("corpus", "max_bytes", "seed", "val_fraction", "suffixes", "seq_len", "text_field",
                      "messages_field", "train_on", "packing")
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
    """Dotted keys the user set as flags (``--a.b c`` / ``--a.b=c``) or in ``--config`` files. A config file's
    ``null`` leaves its setting unset, also when an earlier config file set it (``--config deepspeed_zero3 --config
    finetune``: finetune's ``tokenizer: null`` undoes ``tokenizer: bpe``): the bundled configs write ``null`` for
    "the default", which a checkpoint's tokenizer then fills. A flag is given whatever its value."""
    keys: set[str] = set()
    for path in config_files:  # in order: a later file's value replaces an earlier one's
        text = Path(str(path)).read_text(encoding="utf-8") if Path(str(path)).is_file() else str(path)
        content = yaml.safe_load(text)
        if isinstance(content, Mapping):
            for key, value in flatten(content).items():
                (keys.add if value is not None else keys.discard)(key)
    for token in args:
        if token.startswith("--") and len(token) > 2:
            keys.add(normalise(token[2:].split("=", 1)[0]))
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
    """Equal as settings: numbers by value, sequences item by item, two paths to the same existing file or folder
    (``model_a`` and ``/work/model_a``) alike."""
    if isinstance(a, str) and isinstance(b, str) and a != b and os.path.exists(a) and os.path.exists(b):
        return os.path.realpath(a) == os.path.realpath(b)
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


def given_values(args: list[str], files: Iterable[Any], section: str) -> dict[str, Any]:
    """The values set for ``section`` (``model.generation``) in ``--config`` files, then flags (the later wins), as a
    nested dict; flag values are read as YAML, as the parser reads them.

    Example::

        >>> given_values(["--model.init_args.generation.max_new_tokens", "12", "--model.generation.speculative=false"],
        ...              [], "model.generation")
        {'max_new_tokens': 12, 'speculative': False}
    """
    found: dict[str, Any] = {}
    for path in files:
        text = Path(str(path)).read_text(encoding="utf-8") if Path(str(path)).is_file() else str(path)
        content = yaml.safe_load(text)
        if isinstance(content, Mapping):
            for key, value in flatten(content).items():
                _take(found, key, value, section)
    for i, token in enumerate(args):
        if not token.startswith("--"):
            continue
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                continue
            value = args[i + 1]
        _take(found, normalise(key), yaml.safe_load(value), section)
    return found


def _take(found: dict[str, Any], key: str, value: Any, section: str) -> None:
    if key == section and isinstance(value, Mapping):
        found.update(value)
    elif key.startswith(section + "."):
        found[key[len(section) + 1:]] = value


KNOWN_MODEL_CLASSES = ("lightning_mtp.models.CausalLM", "lightning_mtp.models.HFCausalLM")
"""The bundled model classes, recognised by their init arguments in checkpoints that do not name their class."""


def init_parameters(class_path: str) -> Optional[set[str]]:
    """Names of ``class_path``'s init arguments; ``None`` when it cannot be imported or takes ``**kwargs``."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.name != "self"}


def recorded_model_class(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The class ``checkpoint`` says it holds: as the CLI recorded it (``_class_path``) or the mixin
    (``checkpoint["mtp"]["module_class"]``); ``None`` when neither did."""
    hparams = checkpoint.get("hyper_parameters") or {}
    recorded = hparams.get("_class_path") or (checkpoint.get("mtp") or {}).get("module_class")
    if recorded and "<" in recorded:
        return None  # a class defined inside a function: no path imports it
    if recorded and init_parameters(recorded) is None and not _importable(recorded):
        raise ValueError(f"the checkpoint holds a {recorded.rpartition('.')[2]} ({recorded}), which cannot be "
                         "imported here: put its module on PYTHONPATH (or install it) and run again")
    return recorded


def _importable(class_path: str) -> bool:
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def checkpoint_model_class(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The class whose weights ``checkpoint`` holds: as the CLI recorded it (``_class_path``), as the mixin recorded
    it (``checkpoint["mtp"]["module_class"]``), or the bundled class whose init arguments its hyper-parameters are;
    ``None`` when unknown."""
    hparams = checkpoint.get("hyper_parameters") or {}
    recorded = recorded_model_class(checkpoint)
    if recorded:
        return recorded
    keys = set(hparams) - set(MODEL_KEYS_NOT_FROM_CHECKPOINT)
    if not keys:
        return None
    for class_path in KNOWN_MODEL_CLASSES:
        parameters = init_parameters(class_path)
        if parameters is not None and keys <= parameters:
            return class_path
    return None


def refuse_other_model_class(checkpoint: Mapping[str, Any], class_path: str, source: str) -> None:
    """Raise ``ValueError`` when ``checkpoint`` does not name its class and its hyper-parameters are not init
    arguments of ``class_path`` (the configured model): say which class it holds and how to select it."""
    hparams = checkpoint.get("hyper_parameters") or {}
    parameters = init_parameters(class_path)
    stray = sorted(set(hparams) - set(MODEL_KEYS_NOT_FROM_CHECKPOINT) - (parameters or set()))
    if parameters is None or not stray:
        return
    holder = checkpoint_model_class(checkpoint)
    name = class_path.rpartition(".")[2]
    what = f"holds a {holder.rpartition('.')[2]} ({holder})" if holder else "holds another model class"
    select = f"--model {holder}" if holder else "--model path.to.YourModule"
    raise ValueError(
        f"{source} {what}, not a {name}: its settings {stray[:4]} are not {name}'s. Select its class with {select} "
        "(on the command line, after --config)"
    )


def without_missing_folder(checkpoint: Mapping[str, Any], hparams: dict) -> dict:
    """``hparams`` to rebuild the model from the checkpoint alone when it was loaded from a model folder
    (``pretrained``) that no longer exists: the trunk is then built from the config the checkpoint records
    (``checkpoint["mtp"]["trunk_config"]``) and gets the checkpoint's weights. Unchanged when the folder exists, or
    when the checkpoint lacks the trunk's weights or its config (a frozen trunk's heads-only checkpoint: the folder
    is needed, and its absence is reported by the model)."""
    folder = hparams.get("pretrained")
    config = (checkpoint.get("mtp") or {}).get("trunk_config")
    has_trunk = any(key.startswith("trunk.") for key in checkpoint.get("state_dict") or {})
    if folder and not Path(str(folder)).is_dir() and checkpoint.get(HEADS_ONLY_KEY):
        raise ValueError(f"the checkpoint holds MTP heads only (its trunk was frozen) and gets its trunk from the "
                         f"model folder {folder}, which is gone: put the folder back at that path, or give its "
                         "new place with --model lightning_mtp.models.HFCausalLM --model.init_args.pretrained DIR")
    if not folder or Path(str(folder)).is_dir() or not config or not has_trunk:
        return hparams
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(f"the model folder {folder} is gone: the trunk is rebuilt from the checkpoint's config and weights")
    config = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "_name_or_path")}
    return {**hparams, "pretrained": None, "model_type": config.pop("model_type"), "config": config}
