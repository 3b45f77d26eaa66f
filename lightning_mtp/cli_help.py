"""Help on the command line: config fields' docstrings, and the nested dataclass arguments of a class.

``lightning-mtp fit --model.help CausalLM`` lists the init arguments and then ``ModelConfig``'s, ``MTPConfig``'s and
``GenerationConfig``'s fields with their docstrings (jsonargparse shows nested dataclasses only on request).
Init arguments that only Python can give (:data:`PYTHON_ONLY_ARGS`, e.g. ``HFCausalLM``'s ``trunk``, a model object)
are left out of the parser: not in the help, not accepted as flags or in YAML, not written to saved config files.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from typing import Optional

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser

PYTHON_ONLY_ARGS: dict[str, dict[str, str]] = {
    "lightning_mtp.models.HFCausalLM": {"trunk": "a transformers model object; Python only (HFCausalLM(trunk=model))"},
}
"""Per class path, the init arguments that the CLI leaves out (objects, not values), each with the line its class's
``--model.help`` shows instead. Typed ``nn.Module``, ``trunk`` would otherwise fill that help with every ``nn.Module``
subclass jsonargparse knows, and put ``trunk: null`` in every saved config."""


def print_nested_help(parser: LightningArgumentParser, args: list[str]) -> None:
    """After ``--model.help NAME`` (or ``--data.help``), the help of each of its dataclass init arguments as well
    (``--model.mtp.*``, ``--model.generation.*``), which jsonargparse otherwise shows only one level down, on request
    (``--model.help CausalLM --model.mtp.help``)."""
    request = args[-1].split("=", 1) if args and args[-1].startswith("--") else args[-2:]  # [flag, class name]
    if len(request) != 2 or request[0] not in ("--model.help", "--data.help"):
        return
    section = request[0][2:].split(".")[0]
    cls = _named_class(request[1], L.LightningModule if section == "model" else L.LightningDataModule)
    if cls is None:
        return
    for path, hidden in PYTHON_ONLY_ARGS.items():
        for name, line in hidden.items() if _named_class(path, object) is cls else ():
            print(f"  {name}: {line}")
    for field in _dataclass_init_args(cls):
        print()
        try:
            parser.parse_args([*args, f"--{section}.{field}.help"])
        except SystemExit:
            pass


def _named_class(name: str, base: type) -> Optional[type]:
    """The class a ``--model.help`` / ``--data.help`` value names: a dotted path, or a short name of a subclass."""
    if "." in name:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return None
    found, stack = set(), [base]
    while stack:
        cls = stack.pop()
        found.update(sub for sub in cls.__subclasses__() if sub.__name__ == name)
        stack.extend(cls.__subclasses__())
    return found.pop() if len(found) == 1 else None


def _dataclass_init_args(cls: type) -> list[str]:
    """Names of ``cls.__init__`` arguments typed as a dataclass (or an optional one), in signature order."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: no nested help, the class help stands
        return []
    names = []
    for name in inspect.signature(cls.__init__).parameters:
        hint = hints.get(name)
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if any(isinstance(t, type) and dataclasses.is_dataclass(t) for t in members):
            names.append(name)
    return names


def document_fields() -> None:
    """Let ``--help`` show each config field's docstring (jsonargparse reads attribute docstrings only when asked),
    and leave the :data:`PYTHON_ONLY_ARGS` out of the parser (:func:`hide_python_only_args`)."""
    hide_python_only_args()
    try:
        from jsonargparse import set_parsing_settings
    except ImportError:  # jsonargparse before set_parsing_settings
        from jsonargparse import set_docstring_parse_options

        set_docstring_parse_options(attribute_docstrings=True)
    else:
        set_parsing_settings(docstring_parse_attribute_docstrings=True)


def hide_python_only_args() -> None:
    """Have jsonargparse skip the :data:`PYTHON_ONLY_ARGS` when it reads those classes' ``__init__`` signatures.

    Subclass mode adds a class's init arguments only once the class is named (``--model.help``, ``class_path``), so
    there is no parser call to give ``skip=`` to; jsonargparse's own table of ignored parameters (keyed by the import
    path of the ``__init__``) is read at that moment, for help, parsing and ``--print_config`` alike. With a
    jsonargparse that lacks the table nothing is hidden: the help is long again, and everything still parses."""
    try:
        from jsonargparse._parameter_resolvers import ignore_params
        from jsonargparse._util import get_import_path
    except ImportError:  # pragma: no cover - jsonargparse moved its internals
        return
    for class_path, names in PYTHON_ONLY_ARGS.items():
        cls = _named_class(class_path, object)
        if cls is not None:
            ignore_params.setdefault(get_import_path(cls.__init__), set()).update(names)
