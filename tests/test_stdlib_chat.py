"""The standard library chat data set: well-formed records whose answers define the function asked for, unique ids,
the same bytes on every run, options honoured, the command, and a transformers chat template rendering a record.

The real standard library is read through its first records (``max_records``; a full run takes seconds), the rules
(what is left out, how ids are numbered) on a small folder written by the test.
"""

from __future__ import annotations

import ast
import doctest
import errno
import json
import os
import textwrap
from pathlib import Path

import pytest

from lightning_mtp.data import stdlib_chat
from lightning_mtp.data.corpus import stdlib_root
from lightning_mtp.data.stdlib_chat import main, stdlib_chat_records, write_stdlib_chat

PREFIX = 2000
"""Records read from the real standard library: enough to cross packages and a name defined twice in one file
(``configparser.ParsingError.filename``, getter and setter), in a second or two."""


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return list(stdlib_chat_records(max_records=PREFIX))


def qualname(record: dict) -> str:
    return record["id"].split("::", 1)[1].split("#", 1)[0]


def test_records_are_well_formed(records):
    assert len(records) == PREFIX
    root = stdlib_root()
    for record in records:
        assert set(record) == {"id", "source_file", "messages"}
        assert record["id"].startswith(record["source_file"] + "::")
        assert (root / record["source_file"]).is_file()
        assert [message["role"] for message in record["messages"]] == ["user", "assistant"]
        for message in record["messages"]:
            assert set(message) == {"role", "content"}
            assert isinstance(message["content"], str) and message["content"].strip()
        assert "\n\nDocstring:\n" in record["messages"][0]["content"]


def test_the_answer_defines_the_function_asked_for(records):
    for record in records:
        user, answer = (message["content"] for message in record["messages"])
        tree = ast.parse(answer)
        assert len(tree.body) == 1, record["id"]
        function = tree.body[0]
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)), record["id"]
        name = qualname(record)
        assert function.name == name.rsplit(".", 1)[-1]
        assert f"{name}(" in user.split("\n", 1)[0], record["id"]
        assert ast.get_docstring(function) is None, record["id"]  # the user turn has it; the answer leaves it out


def test_ids_are_unique(records):
    ids = [record["id"] for record in records]
    assert len(set(ids)) == len(ids)
    assert "configparser.py::ParsingError.filename#2" in ids  # the setter, after its getter


def test_a_known_function(records):
    (b64encode,) = [record for record in records if record["id"] == "base64.py::b64encode"]
    assert b64encode["source_file"] == "base64.py"
    user, answer = (message["content"] for message in b64encode["messages"])
    assert user.startswith(
        "Write the Python function `base64.b64encode(s, altchars=None)` from the standard library module `base64` "
        "(file `base64.py`).\nReply with its source code only, without the docstring.\n\nDocstring:\n"
        "Encode the bytes-like object s using Base64 and return a bytes object."
    )
    assert answer.startswith("def b64encode(s, altchars=None):\n    encoded = binascii.b2a_base64(s, newline=False)")


def test_output_is_deterministic(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert write_stdlib_chat(first, max_records=300) == 300
    assert write_stdlib_chat(second, max_records=300) == 300
    assert first.read_bytes() == second.read_bytes()
    lines = first.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 300 and all(json.loads(line)["messages"] for line in lines)


def test_max_records_and_max_source_lines_are_honoured():
    assert len(list(stdlib_chat_records(max_records=7))) == 7
    assert list(stdlib_chat_records(max_records=0)) == []
    short = list(stdlib_chat_records(max_records=300, max_source_lines=8))
    assert len(short) == 300
    assert all(record["messages"][1]["content"].count("\n") < 8 for record in short)
    unlimited = {record["id"] for record in stdlib_chat_records(max_records=300, max_source_lines=None)}
    assert {record["id"] for record in short} != unlimited  # the limit did leave some out


def test_options_are_checked_at_the_call(tmp_path):
    for options in ({"max_records": -1}, {"max_source_lines": 0}, {"min_docstring_chars": -1},
                    {"root": tmp_path / "missing"}):
        with pytest.raises(ValueError):
            stdlib_chat_records(**options)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


TREE = {
    "pkg/__init__.py": '''
        def public(a, *, b: int = 1) -> int:
            """Add one to the sum of a and b, the documented way."""
            return a + b + 1


        def _private(a):
            """A private helper, documented but left out."""
            return a


        def undocumented(a):
            return a


        def short(a):
            """Too short."""
            return a


        def stub(a):
            """A stub whose body leaves nothing to write."""
            raise NotImplementedError


        def outer(a):
            """An outer function; the function nested in it is left out."""

            def inner(b):
                """Nested: depends on the enclosing a."""
                return a + b

            return inner(a)
    ''',
    "pkg/shapes.py": '''
        import sys

        if sys.platform == "win32":
            def native():
                """The native separator on this platform, documented twice."""
                return "\\\\"
        else:
            def native():
                """The native separator on this platform, documented twice."""
                return "/"


        class Shape:
            """A shape."""

            def __init__(self, size):
                """Remember the size of the shape being built."""
                self.size = size

            @property
            def area(self):
                """The area of the shape, in square units."""
                return self.size ** 2

            def _cache(self):
                """Private method, documented but left out."""
                return None

            class Side:
                def length(self):
                    """The length of this side of the shape."""
                    text = """
        a string whose lines start at column 0
        """
                    return len(text)

            async def fetch(self, url):
                """Fetch the shape's description from a url."""
                return url


        class _Hidden:
            def run(self):
                """A method of a private class, left out."""
                return 1
    ''',
    "long.py": "def long():\n    \"\"\"A documented function of many lines.\"\"\"\n" + "    x = 1\n" * 20,
    "broken.py": 'def broken(:\n    """Does not parse."""\n',
    "tests/test_pkg.py": 'def test_public():\n    """A test, in a test folder."""\n    assert True\n',
    "site-packages/other.py": 'def installed():\n    """An installed package."""\n    return 1\n',
    ".hidden/secret.py": 'def secret():\n    """In a hidden folder."""\n    return 1\n',
}


def test_what_is_left_out_and_how_ids_are_numbered(tmp_path):
    root = write_tree(tmp_path, TREE)
    records = list(stdlib_chat_records(root=root, max_source_lines=None))
    assert [record["id"] for record in records] == [
        "long.py::long",
        "pkg/__init__.py::public",
        "pkg/__init__.py::outer",
        "pkg/shapes.py::native",
        "pkg/shapes.py::native#2",
        "pkg/shapes.py::Shape.__init__",
        "pkg/shapes.py::Shape.area",
        "pkg/shapes.py::Shape.Side.length",
        "pkg/shapes.py::Shape.fetch",
    ]
    by_id = {record["id"]: [message["content"] for message in record["messages"]] for record in records}
    user, answer = by_id["pkg/__init__.py::public"]
    assert user == (
        "Write the Python function `pkg.public(a, *, b: int = 1) -> int` from the standard library module `pkg` "
        "(file `pkg/__init__.py`).\nReply with its source code only, without the docstring.\n\n"
        "Docstring:\nAdd one to the sum of a and b, the documented way."
    )
    assert answer == "def public(a, *, b: int = 1) -> int:\n    return a + b + 1"
    assert "def inner(b):" in by_id["pkg/__init__.py::outer"][1]  # kept inside its outer function
    user, answer = by_id["pkg/shapes.py::Shape.area"]
    assert "method `pkg.shapes.Shape.area(self)`" in user and "It is decorated with `@property`." in user
    assert answer == "@property\ndef area(self):\n    return self.size ** 2"
    assert by_id["pkg/shapes.py::native#2"][1] == 'def native():\n    return "/"'
    assert "\na string whose lines start at column 0\n" in by_id["pkg/shapes.py::Shape.Side.length"][1]
    assert "Python async method `pkg.shapes.Shape.fetch(self, url)`" in by_id["pkg/shapes.py::Shape.fetch"][0]
    assert [r["id"] for r in stdlib_chat_records(root=root, max_source_lines=10)][0] == "pkg/__init__.py::public"
    assert "pkg/__init__.py::short" in {r["id"] for r in stdlib_chat_records(root=root, min_docstring_chars=0)}


def test_the_command_writes_the_file(tmp_path, capsys):
    out = tmp_path / "data" / "chat.jsonl"
    assert main(["--out", str(out), "--max-records", "50", "--max-source-lines", "30"]) == 0
    printed = capsys.readouterr().out
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 50
    files = {json.loads(line)["source_file"] for line in lines}
    assert printed.strip() == f"wrote 50 records from {len(files)} files to {out}"
    assert [path.name for path in out.parent.iterdir()] == ["chat.jsonl"]  # no temporary file left behind
    assert main(["--out", str(tmp_path / "bad.jsonl"), "--max-records", "-1"]) == 2
    assert not (tmp_path / "bad.jsonl").exists()


def test_docstring_examples_run():
    assert doctest.testmod(stdlib_chat).failed == 0


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_chat_template_renders_a_record(records):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    record = records[0]
    user, answer = (message["content"] for message in record["messages"])
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|user|>", "<|assistant|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([user, answer], trainer)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|end|>", chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    text = wrapped.apply_chat_template(record["messages"], tokenize=False)
    assert text == f"<|user|>\n{user}<|end|>\n<|assistant|>\n{answer}<|end|>\n"
    ids = wrapped(text, add_special_tokens=False)["input_ids"]
    assert wrapped.convert_tokens_to_ids("<|assistant|>") in ids
    assert wrapped.decode(ids) == text


def test_a_full_disk_is_one_line_naming_out_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    """The disk fills while the records are written: the command says so in one line naming ``--out`` and exits 2;
    neither the file nor its temporary remains."""
    from lightning_mtp.data.atomic import atomic_write

    def filling_up(path, write):
        def write_until_full(fh):
            fh.write(b'{"partial": ')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        atomic_write(path, write_until_full)

    monkeypatch.setattr(stdlib_chat, "atomic_write", filling_up)
    out = tmp_path / "chat.jsonl"
    assert main(["--out", str(out), "--max-records", "3"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"error: --out {str(out)!r}: writing the chat records failed: the disk is full (ENOSPC): free "
                     "space there, or write them to another disk (--out)")
    assert list(tmp_path.iterdir()) == []


def test_a_flag_abbreviation_is_refused(tmp_path, capsys):
    """``--min 10`` would silently set --min-docstring-chars: every flag is its whole name."""
    out = tmp_path / "chat.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(out), "--min", "10", "--max-records", "2"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --min 10" in capsys.readouterr().err
    assert not out.exists()
