"""The docs' Python examples run as written, so they cannot rot.

Every ```python block of README.md and of each guide under docs/ is executed, block after block in one namespace per
file (like a notebook), in a fresh working folder. A block that cannot run here (a GPU, a cluster, a long training, a
path of the reader's) is marked by the line ``<!-- not run: the reason -->`` right above it. Shell blocks are not run
(the two README commands are run by CI itself and by ``tests/test_end_to_end.py``'s path).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```python\n(.*?)```", re.S)


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, code, runs) of every ```python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text[: match.start(2)].count("\n") + 1, match.group(2), match.group(1) is None)
            for match in BLOCK.finditer(text)]


WITH_CODE = [path for path in DOCS if any(runs for _, _, runs in python_blocks(path))]


@pytest.mark.parametrize("path", WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in WITH_CODE])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    blocks = python_blocks(path)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for line, code, runs in blocks:
        if runs:
            exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)


def test_every_skipped_block_says_why():
    for path in DOCS:
        for marker in re.findall(r"<!-- not run:([^>]*)-->", path.read_text(encoding="utf-8")):
            assert marker.strip(), f"{path.name}: a '<!-- not run: -->' marker without its reason"


def test_the_readme_stays_a_users_guide():
    """At most 400 lines, and no narration of history (that is CHANGELOG.md's and git log's)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 400
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        narration = re.findall(r"\b(?:this|last|latest|earlier|previous) (?:round|stop|session)s?\b", text, re.I)
        assert not narration, f"{path.name} narrates history: {narration}"
