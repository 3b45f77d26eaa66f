"""The configs bundled with the package, and ``--config NAME`` resolving to one of them.

The repository's ``configs/`` is the one copy: the wheel ships it as ``lightning_mtp/configs`` (``pyproject.toml``
maps the folder), a checkout or an editable install reads it in place.

Example::

    >>> "quickstart" in bundled_configs()
    True
    >>> resolve_config_args(["fit", "--config", "quickstart"])[2].endswith("quickstart.yaml")
    True
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Optional


def bundled_config_dir() -> Optional[Traversable]:
    """Where the bundled configs are: ``lightning_mtp/configs`` in an installed wheel (built from the repository's
    ``configs/``), the repository's ``configs/`` itself in a source checkout or an editable install."""
    packaged = resources.files("lightning_mtp") / "configs"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs").is_dir():
        return checkout / "configs"
    return None


def bundled_configs() -> dict[str, Traversable]:
    """``{name: file}`` of the bundled configs, ``quickstart`` for ``quickstart.yaml``, sorted by name."""
    folder = bundled_config_dir()
    files = [] if folder is None else [f for f in folder.iterdir() if f.name.endswith(".yaml") and f.is_file()]
    return {f.name[: -len(".yaml")]: f for f in sorted(files, key=lambda f: f.name)}


def resolve_config(value: str) -> str:
    """A ``--config`` value as the parser should read it: an existing file (or YAML text) as given, a bare name
    (``quickstart`` or ``quickstart.yaml``) as the bundled config's path; so is ``configs/quickstart.yaml``, as the
    docs write it from the repository's root, when no such file is here.

    Raises:
        ValueError: for a bare name that is neither a file nor a bundled config, naming the bundled ones.
    """
    if Path(value).is_file():
        return value
    if re.fullmatch(r"configs/[\w-]+\.yaml", value):  # the docs' spelling, run from another folder
        value = value[len("configs/"):]
    if not re.fullmatch(r"[\w-]+(\.yaml)?", value):
        return value
    bundled = bundled_configs()
    found = bundled.get(value[: -len(".yaml")] if value.endswith(".yaml") else value)
    if found is None:
        raise ValueError(f"--config {value}: no such file, and no bundled config of that name (bundled: "
                         f"{', '.join(bundled) or 'none found'})")
    return str(found) if isinstance(found, Path) else found.read_text(encoding="utf-8")  # zipped install: the text


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with every ``--config`` / ``-c`` value passed through :func:`resolve_config`."""
    resolved = list(args)
    for i, token in enumerate(args):
        if token in ("--config", "-c") and i + 1 < len(args):
            resolved[i + 1] = resolve_config(args[i + 1])
        elif token.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(token.split("=", 1)[1])
    return resolved


CHECKPOINT_SUBCOMMANDS = ("validate", "test", "predict")


def with_checkpoint_config(args: list[str]) -> list[str]:
    """``args``, with ``--config predict`` put first when a ``validate`` / ``test`` / ``predict`` of a checkpoint
    names neither a config nor a model: the checkpoint decides the model and the data, the bundled ``predict`` config
    gives the rest, so ``lightning-mtp validate --ckpt_path last.ckpt`` runs alone.

    Example::

        >>> with_checkpoint_config(["validate", "--ckpt_path", "last.ckpt"])
        ['validate', '--config', 'predict', '--ckpt_path', 'last.ckpt']
    """
    if args[:1] and args[0] in CHECKPOINT_SUBCOMMANDS and any(
            token == "--ckpt_path" or token.startswith("--ckpt_path=") for token in args) and not any(
            token in ("--config", "-c", "--model", "--data") or token.startswith(("--config=", "--model=", "--data="))
            for token in args):
        return [args[0], "--config", "predict", *args[1:]]
    return args

