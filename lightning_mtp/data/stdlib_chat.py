"""A chat data set built locally from the Python standard library: write each documented function from its docstring.

Every public, documented function and method in the standard library's ``.py`` files becomes one conversation in the
``{"messages": [...]}`` format of transformers' chat templates and TRL: the user asks for the function by its
qualified name, signature and docstring; the assistant answers with its source code. Nothing is downloaded and
nothing is imported (importing some standard modules has side effects): the files are read as text and parsed with
``ast``. The whole standard library takes a few seconds.

Each record is one JSON line (shortened here)::

    {"id": "json/__init__.py::dumps", "source_file": "json/__init__.py",
     "messages": [{"role": "user", "content": "Write the Python function `json.dumps(obj, *, skipkeys=False, ...)`
                                                from the standard library module `json` (file `json/__init__.py`)..."},
                  {"role": "assistant", "content": "def dumps(obj, *, skipkeys=False, ...):\\n    ..."}]}

What is kept, and why:

* The assistant's answer is the definition without its docstring: the user turn already gives the docstring, and
  copying it back would spend a large share of the answer's tokens (and of the loss) on a copy rather than on code.
  Decorators stay, since they are part of the definition (a property is not a plain method), and the user turn names
  them. The answer is plain code (no Markdown fence), as the user turn asks, so it parses as Python.
* Only public names: a function, method or class whose name starts with ``_`` is an implementation detail, whose
  docstring (when it has one) tends to describe what its caller needs rather than a contract. Dunder methods
  (``__init__``, ``__enter__``) are public protocol and are kept. Private *modules* are kept: ``_pydecimal``,
  ``_pyio`` and ``_collections_abc`` hold the public API of ``decimal``, ``io`` and ``collections.abc``.
* Module-level functions and methods of classes (nested classes too), including those defined under ``if``, ``try``
  or ``with`` (``os`` defines many per platform). A function nested in another function is left out: it depends on
  its enclosing variables, which the prompt cannot state.
* Stubs are left out: a body that is only the docstring, ``pass``, ``...`` or ``raise NotImplementedError`` leaves
  nothing to write.
* Folders left out: tests (``test``, ``tests``, ``idle_test``; ``lib2to3``'s grammar fixtures live in
  ``lib2to3/tests``), installed packages (``site-packages``, ``dist-packages``), ``__pycache__`` and hidden folders.
  A file that does not parse is skipped.

The order is fixed (files by relative path, then definitions by line), so two runs on one interpreter write the same
bytes. ``id`` is the file's path relative to the library root, ``::`` and the qualified name (``Class.method``); a
name defined more than once in one file (per platform, or a property's getter and setter) gets ``#2``, ``#3``, ...
after its later definitions, counted over all definitions so that filtering options never renumber an id. To hold
out an evaluation set, split by a hash of ``source_file`` (so methods of one class stay on one side) or of ``id``.

Example::

    >>> from lightning_mtp.data.stdlib_chat import stdlib_chat_records
    >>> record = next(stdlib_chat_records(max_records=1))
    >>> [message["role"] for message in record["messages"]]
    ['user', 'assistant']
    >>> record["id"].startswith(record["source_file"] + "::")
    True

Command line (``--max-source-lines none`` keeps functions of any length)::

    python -m lightning_mtp.data.stdlib_chat --out stdlib_chat.jsonl --max-records 5000 --max-source-lines 60
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Optional, Union

from lightning_mtp.data.atomic import atomic_write
from lightning_mtp.data.cache_dir import cache_write_failure, write_failure_reason
from lightning_mtp.data.corpus import stdlib_root

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
"""Folder names never entered (hidden folders, starting with ``.``, are skipped too)."""

DEFAULT_MAX_SOURCE_LINES = 60
"""Longest answer kept, in lines: about 600 tokens of code at most, so a record fits a short context window."""

DEFAULT_MIN_DOCSTRING_CHARS = 20
"""Shortest (cleaned) docstring kept: below it a docstring rarely says more than the name ("Return x.")."""

FunctionNode = Union[ast.FunctionDef, ast.AsyncFunctionDef]


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root``, outside :data:`EXCLUDED_DIRS` and hidden folders, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def module_name(relative: str) -> str:
    """The dotted module name of a ``.py`` path relative to the library root.

    Example::

        >>> module_name("json/__init__.py"), module_name("concurrent/futures/thread.py")
        ('json', 'concurrent.futures.thread')
    """
    parts = relative[: -len(".py")].split("/")
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_public(qualname: str) -> bool:
    """Whether no part of a qualified name is private (``_x``); dunder names (``__init__``) are public.

    Example::

        >>> is_public("Popen.__init__"), is_public("Popen._communicate"), is_public("_Helper.run")
        (True, False, False)
    """
    return all(not part.startswith("_") or (part.startswith("__") and part.endswith("__"))
               for part in qualname.split("."))


def _blocks(stmt: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists inside a compound statement (``if``, ``try``, ``with``, ``for``, ``while``, ``match``)."""
    for field in ("body", "orelse", "finalbody"):
        block = getattr(stmt, field, None)
        if isinstance(block, list):
            yield block
    for part in [*getattr(stmt, "handlers", []), *getattr(stmt, "cases", [])]:
        yield part.body


def definitions(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, FunctionNode]]:
    """``(qualified name, node)`` of the functions and methods in ``body``, in source order.

    Classes are entered (their methods are named ``Class.method``); function bodies are not.
    """
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + stmt.name, stmt
        elif isinstance(stmt, ast.ClassDef):
            yield from definitions(stmt.body, f"{prefix}{stmt.name}.")
        else:
            for block in _blocks(stmt):
                yield from definitions(block, prefix)


def is_stub(node: FunctionNode) -> bool:
    """Whether the body, after the docstring, is empty, ``pass``, ``...`` or ``raise NotImplementedError``."""
    rest = node.body[1:]
    if not rest:
        return True
    if len(rest) > 1:
        return False
    stmt = rest[0]
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _after(line: str, byte_offset: int) -> str:
    """The text of ``line`` after a UTF-8 byte offset (``ast`` columns count bytes)."""
    return line.encode("utf-8")[byte_offset:].decode("utf-8", errors="replace")


def function_source(lines: Sequence[str], node: FunctionNode) -> Optional[str]:
    """The definition (decorators, ``def`` line and body), dedented, without its docstring.

    ``None`` when the docstring shares a line with code, or the result does not parse on its own.
    """
    doc = node.body[0]
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert doc.end_lineno is not None and node.end_lineno is not None and doc.end_col_offset is not None
    if doc.lineno <= node.lineno or lines[doc.lineno - 1][: doc.col_offset].strip():
        return None
    tail = _after(lines[doc.end_lineno - 1], doc.end_col_offset).strip()
    if tail and not tail.startswith("#"):
        return None
    after = doc.end_lineno
    while after < node.end_lineno and not lines[after].strip():
        after += 1
    kept = [*lines[first - 1 : doc.lineno - 1], *lines[after : node.end_lineno]]
    indent = lines[node.lineno - 1][: node.col_offset]
    if all(line.startswith(indent) or not line.strip() for line in kept):
        # Whole statements removed, the rest shifted left as one block: it parses as the file did.
        return "\n".join(line[len(indent) :] for line in kept).rstrip()
    # Some line is less indented (the inside of a multi-line string or bracket): kept as is, checked by parsing.
    source = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in kept).rstrip()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return source


def _parameter(arg: ast.arg, default: Optional[ast.expr], prefix: str = "") -> str:
    text = prefix + arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation else "")
    if default is None:
        return text
    return text + (" = " if arg.annotation else "=") + ast.unparse(default)


def parameters(args: ast.arguments) -> str:
    """The parameter list on one line, spaced as PEP 8 asks (``ast.unparse`` writes ``b: int=1`` before 3.12)."""
    positional = [*args.posonlyargs, *args.args]
    defaults: list[Optional[ast.expr]] = [None] * (len(positional) - len(args.defaults))
    parts = [_parameter(arg, default) for arg, default in zip(positional, [*defaults, *args.defaults])]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg is not None:
        parts.append(_parameter(args.vararg, None, "*"))
    elif args.kwonlyargs:
        parts.append("*")
    parts.extend(_parameter(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults))
    if args.kwarg is not None:
        parts.append(_parameter(args.kwarg, None, "**"))
    return ", ".join(parts)


def signature(node: FunctionNode) -> str:
    """``name(parameters) -> annotation`` on one line, comments dropped (type parameters too, on Python 3.12+).

    Example::

        >>> signature(ast.parse("def f(a, /, b=2, *c: int, d: int = 1, **e) -> str: pass").body[0])
        'f(a, /, b=2, *c: int, d: int = 1, **e) -> str'
    """
    type_params = getattr(node, "type_params", None)
    params = f"[{', '.join(ast.unparse(p) for p in type_params)}]" if type_params else ""
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}{params}({parameters(node.args)}){returns}"


def user_prompt(node: FunctionNode, qualname: str, module: str, relative: str, docstring: str) -> str:
    """The user turn: what to write (kind, dotted name, signature, decorators), where it lives, and its docstring."""
    kind = "method" if "." in qualname else "function"
    if isinstance(node, ast.AsyncFunctionDef):
        kind = f"async {kind}"
    owner = qualname.rpartition(".")[0]
    dotted = ".".join(part for part in (module, owner, signature(node)) if part)
    lines = [f"Write the Python {kind} `{dotted}` from the standard library module `{module}` (file `{relative}`)."]
    if node.decorator_list:
        names = [f"`@{ast.unparse(d)}`" for d in node.decorator_list]
        lines.append(f"It is decorated with {' and '.join(names)}.")
    lines.append("Reply with its source code only, without the docstring.")
    return "\n".join(lines) + f"\n\nDocstring:\n{docstring}"


def _parse(text: str) -> Optional[ast.Module]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like in old code
            return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def file_records(path: Path, relative: str, max_source_lines: Optional[int], min_docstring_chars: int
                 ) -> Iterator[dict]:
    """The records of one file, in source order (none when it does not parse)."""
    text = path.read_text(encoding="utf-8", errors="replace")  # universal newlines, as ast counts lines
    tree = _parse(text)
    if tree is None:
        return
    lines = text.split("\n")
    module = module_name(relative)
    seen: dict[str, int] = {}
    for qualname, node in definitions(tree.body):
        seen[qualname] = seen.get(qualname, 0) + 1
        docstring = ast.get_docstring(node, clean=True)
        if not is_public(qualname) or docstring is None or len(docstring) < min_docstring_chars or is_stub(node):
            continue
        source = function_source(lines, node)
        if source is None or (max_source_lines is not None and source.count("\n") + 1 > max_source_lines):
            continue
        number = seen[qualname]
        yield {
            "id": f"{relative}::{qualname}" + (f"#{number}" if number > 1 else ""),
            "source_file": relative,
            "messages": [
                {"role": "user", "content": user_prompt(node, qualname, module, relative, docstring)},
                {"role": "assistant", "content": source},
            ],
        }


def _check_options(max_records: Optional[int], max_source_lines: Optional[int], min_docstring_chars: int) -> None:
    if max_records is not None and max_records < 0:
        raise ValueError(f"max_records must be >= 0 (or None for all), got {max_records!r}")
    if max_source_lines is not None and max_source_lines < 1:
        raise ValueError(f"max_source_lines must be >= 1 (or None for no limit), got {max_source_lines!r}")
    if min_docstring_chars < 0:
        raise ValueError(f"min_docstring_chars must be >= 0, got {min_docstring_chars!r}")


def stdlib_chat_records(
    *,
    max_records: Optional[int] = None,
    max_source_lines: Optional[int] = DEFAULT_MAX_SOURCE_LINES,
    min_docstring_chars: int = DEFAULT_MIN_DOCSTRING_CHARS,
    root: Optional[Union[str, Path]] = None,
) -> Iterator[dict]:
    """The chat records, lazily, in a fixed order (files by relative path, then definitions by line).

    The options are checked at the call (``ValueError``), the files read as the records are consumed.

    Args:
        max_records: stop after this many records (``None``: all). Files after the last record are not read.
        max_source_lines: skip functions whose answer (decorators, ``def``, body) is longer (``None``: no limit).
        min_docstring_chars: skip functions whose cleaned docstring is shorter.
        root: the folder to read (``None``: the running interpreter's standard library). Ids and ``source_file``
            are relative to it.

    Example::

        >>> records = list(stdlib_chat_records(max_records=3, max_source_lines=20))
        >>> len(records), all(r["messages"][1]["content"].count("\\n") < 20 for r in records)
        (3, True)
    """
    _check_options(max_records, max_source_lines, min_docstring_chars)
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise ValueError(f"root {str(base)!r} is not a folder")
    return _records(base, max_records, max_source_lines, min_docstring_chars)


def _records(base: Path, max_records: Optional[int], max_source_lines: Optional[int], min_docstring_chars: int
             ) -> Iterator[dict]:
    if max_records == 0:
        return
    count = 0
    for path in source_files(base):
        for record in file_records(path, path.relative_to(base).as_posix(), max_source_lines, min_docstring_chars):
            yield record
            count += 1
            if max_records is not None and count >= max_records:
                return


def _write_jsonl(path: Path, records: Iterator[dict]) -> tuple[int, int]:
    """Write ``records`` as UTF-8 JSON lines, atomically; return (records, distinct source files)."""
    files: set[str] = set()
    count = 0

    def write(fh: BinaryIO) -> None:
        nonlocal count
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
            files.add(record["source_file"])
            count += 1

    atomic_write(path, write)
    return count, len(files)


def write_stdlib_chat(path: Union[str, Path], **options: object) -> int:
    """Write :func:`stdlib_chat_records` (``options`` are its keywords) to a JSONL file; return how many records.

    The file is written to a temporary name in the same folder, then renamed, so a reader never sees half of it.

    Example::

        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "chat.jsonl"
        >>> write_stdlib_chat(out, max_records=2)
        2
        >>> len(out.read_text(encoding="utf-8").splitlines())
        2
    """
    return _write_jsonl(Path(path), stdlib_chat_records(**options))[0]  # type: ignore[arg-type]


def _optional_int(value: str) -> Optional[int]:
    return None if value.lower() in ("none", "null") else int(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mtp.data.stdlib_chat", allow_abbrev=False,  # a flag is its whole name
        description="Write a chat data set (JSONL, one {id, source_file, messages} per line) whose user turns ask "
        "for a standard library function from its signature and docstring and whose assistant turns are its source.",
    )
    parser.add_argument("--out", required=True, type=Path, help="the JSONL file to write (replaced atomically)")
    parser.add_argument("--max-records", type=_optional_int, default=None, help="at most this many (default: all)")
    parser.add_argument("--max-source-lines", type=_optional_int, default=DEFAULT_MAX_SOURCE_LINES,
                        help=f"skip longer functions; 'none' for no limit (default: {DEFAULT_MAX_SOURCE_LINES})")
    parser.add_argument("--min-docstring-chars", type=int, default=DEFAULT_MIN_DOCSTRING_CHARS,
                        help=f"skip shorter docstrings (default: {DEFAULT_MIN_DOCSTRING_CHARS})")
    parser.add_argument("--root", type=Path, default=None,
                        help="read this folder instead of the standard library (default: the running interpreter's)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        records = stdlib_chat_records(max_records=args.max_records, max_source_lines=args.max_source_lines,
                                      min_docstring_chars=args.min_docstring_chars, root=args.root)
        count, files = _write_jsonl(args.out, records)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk, a quota, a read-only folder: one line naming --out (no partial file)
        failure = cache_write_failure(error)
        if failure is None:
            raise
        print(f"error: --out {str(args.out)!r}: writing the chat records failed: {write_failure_reason(failure)[0]}: "
              "free space there, or write them to another disk (--out)", file=sys.stderr)
        return 2
    print(f"wrote {count} records from {files} files to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
