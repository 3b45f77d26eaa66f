"""Bad input on the command line ends with one short ``lightning-mtp: error: ...`` line and exit status 2.

Two sources of such errors: jsonargparse's parse errors (a value of the wrong type, an unknown option), which it
reports as a tree of every union member it tried, and lightning-mtp's own checks (config ``__post_init__``, data vs
model, checkpoints), which jsonargparse and Lightning wrap in chained tracebacks. Both are reduced to the message that
names the flag. ``LIGHTNING_MTP_TRACEBACK=1`` keeps the full traceback.

Example::

    >>> condense_parse_error('''Parser key "model":
    ...   Errors:
    ...     - Problem with given class_path 'lightning_mtp.models.CausalLM':
    ...         Parser key "mtp":
    ...           Errors:
    ...             - Problem with given class_path 'lightning_mtp.MTPConfig':
    ...                 Parser key "architecture":
    ...                   Expected a typing.Literal['cascaded', 'parallel']. Got value: tree
    ...             - Expected a <class 'NoneType'>''')
    "--model.init_args.mtp.architecture: Expected a typing.Literal['cascaded', 'parallel']. Got value: tree"
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn, Optional

import yaml
from lightning.pytorch.cli import LightningArgumentParser

_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)":\s*$')
_NOISE = (
    "Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "- Problem with given class_path",
    "Given value type:", "Given value:", "- Expected a <class 'NoneType'>", "Expected a <class 'NoneType'>",
)


CONFIG_FILES: list[str] = []
"""The ``--config`` files the command line gives, in order (set by the CLI before parsing; a refusal then says
more)."""


def condense_parse_error(message: str) -> str:
    """The first real reason in a jsonargparse error tree, prefixed with the flag it concerns."""
    if message.startswith("Problems parsing config"):
        return _yaml_problem(CONFIG_FILES) or message.strip()
    lines = message.splitlines()
    if len(lines) <= 1:
        return message.strip()
    path: list[tuple[int, str]] = []  # (indent, key) of the enclosing "Parser key" lines
    for number, line in enumerate(lines):
        match = _KEY.match(line)
        indent = len(line) - len(line.lstrip())
        if match:
            while path and path[-1][0] >= indent:
                path.pop()
            path.append((indent, match.group(2)))
            continue
        text = line.strip()
        if not text or text.startswith(_NOISE):
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        keys = [key for _, key in path]
        flag = ""
        if keys:
            section, rest = keys[0], keys[1:]
            flag = "--" + ".".join([section, "init_args", *rest] if section in ("model", "data") and rest else keys)
        reason = text[2:] if text.startswith("- ") else text
        if text.startswith("- Expected a "):  # a union: every member it was tried as, and the value given
            reason = _union_reason(lines[number:], indent)
        reason = re.sub(r"<class '([\w.]+)'>", r"\1", reason)
        nested = re.search(r"NestedArg\(key='([^']*)', val='([^']*)'\)", reason)
        if nested:  # a misspelt option of a class given by flags: name it, not jsonargparse's internal value
            reason = f"no option {nested.group(1)!r} (given {nested.group(2)!r}); see --help for the class's options"
        rejected = re.match(r"Option '(\w+)' is not accepted", reason)
        if len(CONFIG_FILES) > 1 and flag in ("--model", "--data") and rejected and _bundled_option(flag, rejected[1]):
            reason += (f" (a later --config replaced the {flag[2:]} class these settings were for: give a strategy's "
                       "config first and the model's after it, e.g. --config deepspeed_zero3 --config finetune)")
        return f"{flag}: {reason}" if flag else reason
    return lines[0].strip()


def _yaml_problem(files: list[str]) -> Optional[str]:
    """The first of ``files`` that is not valid YAML, with the line and column of the problem (jsonargparse's message
    names neither the file nor the line); ``None`` when each parses."""
    for name in files:
        try:
            yaml.safe_load(Path(name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            return f"--config {name}: not valid YAML{where}: {problem}"
    return None


def _bundled_option(flag: str, option: str) -> bool:
    """Whether ``option`` is an option of a bundled model (``--model``) or data (``--data``) class: refused by the
    class a later ``--config`` chose, it was meant for another; an option no class has is a typo."""
    from lightning_mtp.data import TextDataModule
    from lightning_mtp.models import CausalLM, HFCausalLM

    classes = (CausalLM, HFCausalLM) if flag == "--model" else (TextDataModule,)
    return any(option in inspect.signature(cls.__init__).parameters for cls in classes)


def _union_reason(lines: list[str], indent: int) -> str:
    """``Expected a A, or B`` from a union's sibling ``- Expected a ...`` lines (NoneType left out), and the value."""
    expected, given, inside = [], None, True
    for line in lines:
        text = line.strip()
        inside = inside and not (text and len(line) - len(line.lstrip()) < indent)
        if inside and text.startswith("- Expected a ") and "NoneType" not in text:
            expected.append(text[len("- Expected a "):])
        elif text.startswith("Given value:") and given is None:
            given = text[len("Given value:"):].strip()
        elif _KEY.match(line) and not inside:
            break
    reason = "Expected a " + ", or ".join(expected)
    return reason if given is None or "Got value" in reason else f"{reason}. Got value: {given}"


class ShortErrorParser(LightningArgumentParser):
    """A LightningArgumentParser whose parse errors are one line (see :func:`condense_parse_error`), and which takes
    every flag by its whole name: ``--trainer.max_ste 5`` is refused, not read as ``--trainer.max_steps``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("LIGHTNING_MTP_TRACEBACK"):
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        fail(f"{condense_parse_error(message)}\n(run '{prog} --help' for the accepted options)")


def fail(message: str, status: int = 2) -> NoReturn:
    """Print ``lightning-mtp: error: message`` and exit with ``status`` (2: bad input; 1: the run failed)."""
    print(f"lightning-mtp: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def user_error(error: BaseException) -> Optional[str]:
    """The message of a check of lightning-mtp's own, or of Lightning's own check of the trainer's settings
    (``MisconfigurationException``: ``--trainer.max_steps -5``, a GPU accelerator on a machine without one), found
    anywhere in the chain of ``error`` (jsonargparse and Lightning wrap them); ``None`` for anything else, so that
    bugs keep their tracebacks."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    seen: set[int] = set()
    stack: list[Any] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (ValueError, TypeError)) and _raised_by_us(current):
            return str(current)
        if isinstance(current, MisconfigurationException) or (
                isinstance(current, ValueError) and _raised_in(current, "trainer/connectors")):
            message = " ".join(str(current).split())
            if "strategy `fsdp`" in message:
                message += " (FSDP with lightning-mtp is FSDP2: --config fsdp, which runs on CPU processes too)"
            return f"--trainer: {message}"
        stack.extend([current.__cause__, current.__context__])
    return None


def peer_failed(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another process of the run stopped (gloo's "Connection
    closed by peer", NCCL's remote error): that process prints why; this one need not add a traceback."""
    text = f"{type(error).__name__}: {error}"
    pattern = r"Connection closed by peer|Connection reset by peer|remote (worker|process)|DistBackendError"
    return isinstance(error, RuntimeError) and re.search(pattern, text) is not None


def _raised_in(error: BaseException, part: str) -> bool:
    """Whether ``error`` was raised in Lightning's ``part`` (e.g. its trainer's connectors, which check the
    trainer's settings)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"lightning/pytorch/{part}" in Path(frames[-1].filename).as_posix()


def _raised_by_us(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    package = str(Path(__file__).resolve().parent)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(package)
