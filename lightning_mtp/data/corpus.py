"""Finding, capping and splitting the text files a model trains on.

The default corpus (``--data.corpus null``) is the Python standard library of the running interpreter: real,
varied code that every machine already has. Any directory, glob pattern or single file works as well.

Example::

    >>> from lightning_mtp.data.corpus import find_corpus_files, split_files, stdlib_root
    >>> files = find_corpus_files(None)
    >>> any(f.name == "os.py" for f in files)
    True
    >>> train, val = split_files(files, val_fraction=0.05, seed=1234, root=stdlib_root())
    >>> len(train) + len(val) == len(files) and not set(train) & set(val)
    True
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

CORPUS_FLAG = "--data.corpus"

STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
"""Directory names skipped in the default (standard library) corpus: tests, installed packages, legacy tools."""

DIRECTORY_EXCLUDED_DIRS = frozenset({"__pycache__"})
"""Directory names skipped when ``--data.corpus`` is a directory (hidden directories such as ``.git`` are
skipped too)."""

_GLOB_CHARS = frozenset("*?[")


def stdlib_root() -> Path:
    """The directory holding the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_glob(corpus: str) -> bool:
    """Whether ``--data.corpus`` is a glob pattern (contains ``*``, ``?`` or ``[``)."""
    return any(c in _GLOB_CHARS for c in corpus)


def corpus_root(corpus: Optional[str]) -> Path:
    """The directory that file paths are made relative to when splitting (so the split is machine independent).

    The standard library root for ``None``, the directory itself, a file's parent, or the part of a glob pattern
    before its first wildcard.

    Example::

        >>> corpus_root("src/**/*.py")
        PosixPath('src')
    """
    if corpus is None:
        return stdlib_root()
    if is_glob(corpus):
        parts = Path(corpus).parts
        fixed = []
        for part in parts:
            if is_glob(part):
                break
            fixed.append(part)
        return Path(*fixed) if fixed else Path(".")
    path = Path(corpus)
    return path if path.is_dir() else path.parent


def check_corpus(corpus: Optional[str]) -> None:
    """Fail fast (before any reading) when ``--data.corpus`` names a path that does not exist."""
    if corpus is None:
        root = stdlib_root()
        if not root.is_dir():
            raise ValueError(f"{CORPUS_FLAG}: the default corpus (standard library at {root}) does not exist")
        return
    if not isinstance(corpus, str) or not corpus.strip():
        raise ValueError(f"{CORPUS_FLAG} must be a path, a glob pattern or null, got {corpus!r}")
    if is_glob(corpus):
        root = corpus_root(corpus)
        if not root.is_dir():
            raise ValueError(f"{CORPUS_FLAG}: the directory {str(root)!r} of glob pattern {corpus!r} does not exist")
        return
    if not Path(corpus).exists():
        raise ValueError(f"{CORPUS_FLAG}: path {corpus!r} does not exist")


COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
"""Endings of compressed files: never read raw (their compressed bytes would be trained on as text)."""


def is_compressed(path: Path) -> bool:
    """Whether ``path`` names a compressed file (by its last ending, ``COMPRESSED_SUFFIXES``)."""
    return Path(path).suffix.lower() in COMPRESSED_SUFFIXES


def walk_folder(root: Path, skip_dir: Callable[[str], bool]) -> tuple[list[tuple[Path, list[str]]], list[str]]:
    """Every folder under ``root`` (symlinked folders followed) with its file names, skipping folders whose name
    ``skip_dir`` picks; and the links skipped because they lead to a folder already read (a link to a folder above
    it, which would loop forever, or a second path to one), each as ``"link -> target"``.

    Example::

        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "sub").mkdir()
        >>> (root / "sub" / "up").symlink_to(root)
        >>> folders, skipped = walk_folder(root, lambda name: False)
        >>> len(folders), [link.split(" -> ")[0] == str(root / "sub" / "up") for link in skipped]
        (2, [True])
    """
    seen = {os.path.realpath(root)}
    folders, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(dirnames):
            if skip_dir(name):
                continue
            real = os.path.realpath(os.path.join(dirpath, name))
            if real in seen:
                skipped.append(f"{os.path.join(dirpath, name)} -> {real}")
                continue
            seen.add(real)
            kept.append(name)
        dirnames[:] = kept
        folders.append((Path(dirpath), filenames))
    return folders, skipped


def warn_skipped_links(skipped: Sequence[str]) -> None:
    """Warn (rank zero) about the symlinked folders :func:`walk_folder` skipped, naming the first."""
    if skipped:
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"{CORPUS_FLAG}: {len(skipped)} symlinked folder(s) skipped, each leading to a folder already "
                       f"read (a link to a folder above it, or a second link to one), the first {skipped[0]}: their "
                       "files are read once, by the first path to them")


def _walk(root: Path, excluded: frozenset[str], suffixes: Optional[Sequence[str]],
          warn: bool = True) -> list[Path]:
    folders, skipped = walk_folder(root, lambda name: name in excluded or name.startswith("."))
    if warn:
        warn_skipped_links(skipped)
    return [folder / name for folder, names in folders for name in names
            if suffixes is None or name.endswith(tuple(suffixes))]


def find_corpus_files(corpus: Optional[str], suffixes: Optional[Sequence[str]] = (".py",)) -> list[Path]:
    """The sorted, non-empty text files of a corpus.

    Args:
        corpus: ``None`` for the standard library sources (``*.py``, without tests, ``site-packages``, ``idlelib``,
            ``lib2to3``); a directory (searched recursively for ``suffixes``, hidden and ``__pycache__``
            directories skipped); a glob pattern (``**`` allowed; the pattern filters instead of ``suffixes``,
            ``__pycache__`` is skipped, hidden files only match an explicit ``.``); or a single file.
        suffixes: file name endings read from a directory; ``None`` reads every file.

    Raises:
        ValueError: naming ``--data.corpus`` when the path does not exist, or nothing non-empty is found.

    Example::

        >>> files = find_corpus_files(None)
        >>> files == sorted(files) and all(f.suffix == ".py" for f in files)
        True
    """
    check_corpus(corpus)
    if corpus is None:
        files = _walk(stdlib_root(), STDLIB_EXCLUDED_DIRS, (".py",) if suffixes is None else suffixes)
        where = f"the default corpus (standard library at {stdlib_root()})"
    elif is_glob(corpus):
        files = [Path(p) for p in glob.glob(corpus, recursive=True)]
        files = [f for f in files if not DIRECTORY_EXCLUDED_DIRS & set(f.parts[:-1])]
        where = f"glob pattern {corpus!r}"
    elif Path(corpus).is_dir():
        files = _walk(Path(corpus), DIRECTORY_EXCLUDED_DIRS, suffixes)
        where = f"directory {corpus!r}" + (f" (files ending in {', '.join(suffixes)})" if suffixes else "")
    else:
        files = [Path(corpus)]
        where = f"file {corpus!r}"
    files = [f for f in files if f.is_file()]
    _refuse_compressed(files)
    if not files and suffixes and corpus is not None and Path(corpus).is_dir():
        others = sorted({f.suffix or f.name for f in _walk(Path(corpus), DIRECTORY_EXCLUDED_DIRS, None, warn=False)})
        if others:  # files there, of other kinds: say so, and how to read them
            raise ValueError(f"{CORPUS_FLAG}: {where} holds none, only files ending in {', '.join(others[:8])}: "
                             f"{_reading_advice(others)}")
    if not files:
        raise ValueError(f"{CORPUS_FLAG}: {where} is empty: it has no files")
    non_empty = sorted(f for f in files if f.stat().st_size > 0)
    if not non_empty:
        raise ValueError(f"{CORPUS_FLAG}: {where} is empty: all its {len(files)} file(s) are empty")
    return non_empty


COMPRESSED_RECORDS = ".jsonl.gz, .json.gz or .csv.gz"
"""The compressed record files read (decompressed): named in the advice for other compressed files."""


def _refuse_compressed(files: Sequence[Path]) -> None:
    """Refuse a compressed file among raw ``files``, naming it: read raw, its compressed bytes would be decoded as
    text (mostly U+FFFD) and trained on."""
    packed = sorted(f for f in files if is_compressed(f))
    if packed:
        raise ValueError(
            f"{CORPUS_FLAG}: {packed[0]} is compressed ({packed[0].suffix}), and raw files are read as text: its "
            f"compressed bytes would be trained on; decompress it, or leave it out (--data.suffixes for a directory, a "
            f"narrower --data.corpus glob pattern); records are read compressed from {COMPRESSED_RECORDS} files")


def _reading_advice(endings: Sequence[str]) -> str:
    """How to read a folder holding files of ``endings`` only (none of the ``--data.suffixes`` read): name a raw
    text ending with ``--data.suffixes``; never a compressed one (its bytes would be trained on as text) or ``.tsv``
    (records, which raw reading would train on as text, separators and all)."""
    readable = [e for e in endings if e.lower() not in COMPRESSED_SUFFIXES and e.lower() != ".tsv"]
    if readable:
        return f"name the endings to read with --data.suffixes, e.g. '[{readable[0]}]'"
    if ".tsv" in (e.lower() for e in endings):
        return ("tab-separated records (.tsv) are not read: convert them to .csv or .jsonl (e.g. "
                "pandas.read_csv(path, sep='\\t', keep_default_na=False).to_json(out, orient='records', lines=True)) "
                "and give those")
    return f"compressed files are not read raw: decompress them (records are read compressed from {COMPRESSED_RECORDS})"


def cap_bytes(files: Sequence[Path], max_bytes: Optional[int] = None) -> dict[Path, int]:
    """How many bytes to read from each file so that at most ``max_bytes`` are read in all.

    The first files in the given (sorted) order are kept whole; the file that crosses the cap is cut short and the
    rest are dropped. ``None`` keeps everything.

    Example::

        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> for name in "abc":
        ...     _ = (d / name).write_text("x" * 10)
        >>> list(cap_bytes(sorted(d.iterdir()), max_bytes=15).values())
        [10, 5]
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"--data.max_bytes must be > 0 (or null for no cap), got {max_bytes!r}")
    budget: dict[Path, int] = {}
    left = max_bytes
    for f in files:
        size = f.stat().st_size
        if left is None:
            budget[f] = size
            continue
        if left <= 0:
            break
        budget[f] = min(size, left)
        left -= budget[f]
    return budget


UNDECODABLE_WARN_SHARE = 0.01
"""Share of the tokenized corpus characters that stand for undecodable bytes (U+FFFD put in by decoding) above which
tokenizing warns. Lower flags corpora of UTF-8 text with a few stray Latin-1 bytes, which cost the model little;
higher lets more binary or wrongly encoded files (whose replacement characters the model learns to predict) pass
unnoticed."""

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")


def decode_utf8(data: bytes, final: bool = True) -> tuple[str, int]:
    """``data`` decoded as UTF-8 with undecodable bytes replaced by U+FFFD, and how many U+FFFD decoding put in (the
    ones already in the text are not counted). ``final=False`` drops a multi-byte character cut off at the end.

    Example::

        >>> decode_utf8("caf\u00e9 \ufffd".encode("latin-1", errors="ignore") + "\ufffd".encode())
        ('caf\ufffd \ufffd', 1)
    """
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=final)
    return text, max(text.count(_REPLACEMENT) - data.count(_REPLACEMENT_UTF8), 0)


def _read_bytes(path: Path, stop: Optional[int], start: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read() if stop is None else fh.read(max(stop - start, 0))


def read_text(path: Path, stop: Optional[int] = None, start: int = 0) -> str:
    """The text of bytes ``[start, stop)`` of a file (``stop=None``: to the end), decoded as UTF-8 with undecodable
    bytes replaced. A multi-byte character cut by ``stop`` is dropped rather than replaced."""
    return decode_utf8(_read_bytes(path, stop, start), final=stop is None)[0]


class UndecodableTally:
    """Counts, per file, the characters read and the U+FFFD that stand for undecodable bytes, and words the warning
    when their share of the whole is above ``UNDECODABLE_WARN_SHARE``.

    Example::

        >>> tally = UndecodableTally()
        >>> tally.add(Path("/c/a.py"), chars=1000, replaced=0)
        >>> tally.add(Path("/c/logo.png"), chars=100, replaced=60)
        >>> round(tally.share(), 3)
        0.055
        >>> tally.warning(root=Path("/c"))  # doctest: +ELLIPSIS
        '--data.corpus: 5.5% of the corpus characters are U+FFFD ... (worst: logo.png 60.0%): those files are not ...'
    """

    def __init__(self) -> None:
        self.chars: dict[Path, int] = {}
        self.replaced: dict[Path, int] = {}

    def add(self, path: Path, chars: int, replaced: int) -> None:
        """Record a file (or a span of one) of ``chars`` characters, ``replaced`` of them U+FFFD from decoding."""
        self.chars[path] = self.chars.get(path, 0) + chars
        self.replaced[path] = self.replaced.get(path, 0) + replaced

    def share(self) -> float:
        """The replaced characters' share of all characters (0 for no characters)."""
        total = sum(self.chars.values())
        return sum(self.replaced.values()) / total if total else 0.0

    def worst(self, count: int = 3) -> list[tuple[Path, float]]:
        """Up to ``count`` files with replaced characters and their own shares, highest share first."""
        shares = [(path, self.replaced[path] / self.chars[path]) for path in self.chars if self.replaced[path]]
        return sorted(shares, key=lambda item: (-item[1], str(item[0])))[:count]

    def warning(self, root: Optional[Path] = None) -> Optional[str]:
        """The one-line warning when the share is above ``UNDECODABLE_WARN_SHARE``, else ``None``; file names are
        relative to ``root`` when inside it."""
        share = self.share()
        if share <= UNDECODABLE_WARN_SHARE:
            return None
        worst = ", ".join(f"{_shown(path, root)} {file_share:.1%}" for path, file_share in self.worst())
        files = sum(1 for count in self.replaced.values() if count)
        return (
            f"{CORPUS_FLAG}: {share:.1%} of the corpus characters are U+FFFD standing for bytes that are not UTF-8, in "
            f"{files} file(s) (worst: {worst}): those files are not UTF-8 text (binary files or another encoding) and "
            "the model would learn to predict replacement characters; select text files only (--data.suffixes for "
            "a directory, a narrower --data.corpus glob pattern) or convert the files to UTF-8"
        )


def _shown(path: Path, root: Optional[Path]) -> str:
    if root is not None:
        try:
            return Path(path).relative_to(root).as_posix()
        except ValueError:
            pass
    return str(path)


@dataclass(frozen=True)
class FileSpan:
    """Bytes ``[start, stop)`` of one corpus file: the unit that goes to the train or the val split."""

    path: Path
    start: int
    stop: int

    @classmethod
    def whole(cls, path: Path) -> FileSpan:
        """The whole file."""
        return cls(Path(path), 0, Path(path).stat().st_size)

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    def read(self) -> str:
        """The span's text (see ``read_text``)."""
        return read_text(self.path, self.stop, self.start)

    def read_counted(self) -> tuple[str, int]:
        """The span's text (the same as ``read``) and how many U+FFFD decoding put in for undecodable bytes."""
        return decode_utf8(_read_bytes(self.path, self.stop, self.start), final=False)


def as_span(item: Union[Path, str, FileSpan]) -> FileSpan:
    """A ``FileSpan`` as is, or the whole of a file given by path."""
    return item if isinstance(item, FileSpan) else FileSpan.whole(Path(item))


def read_texts(items: Iterable[Union[Path, str, FileSpan]]) -> list[str]:
    """The text of each file (whole) or span."""
    return [as_span(item).read() for item in items]


def _unit_score(relative: str, seed: int) -> float:
    digest = hashlib.sha1(f"{seed}\0{relative}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _relative_key(path: Path, root: Optional[Path]) -> str:
    if root is not None:
        try:
            return Path(os.path.relpath(path, root)).as_posix()
        except ValueError:  # different drive on Windows
            pass
    return Path(path).as_posix()


def split_files(
    files: Sequence[Path], val_fraction: float, seed: int, root: Optional[Path] = None
) -> tuple[list[Path], list[Path]]:
    """Split files into (train, val) by a stable hash of each file's path relative to ``root``.

    A file goes to val when ``sha1(seed, relative path)`` mapped to [0, 1) is below ``val_fraction``, so each
    file's side depends only on its own path: adding or removing other files never moves it. With two or more
    files both sides get at least one (the file with the lowest / highest score is moved over if needed). A single
    file is returned as ``([file], [])``: ``plan_splits`` then splits inside it (see ``split_point``).

    Args:
        files: the corpus files, e.g. from ``find_corpus_files``.
        val_fraction: expected share of files held out, in (0, 1).
        seed: changes the split.
        root: paths are hashed relative to it (default: their common directory), so the split is the same on
            every machine.

    Example::

        >>> fs = [Path(f"/corpus/{i}.py") for i in range(100)]
        >>> train, val = split_files(fs, 0.1, seed=0)
        >>> train2, val2 = split_files(fs + [Path("/corpus/new.py")], 0.1, seed=0)
        >>> set(val) <= set(val2) and set(train) <= set(train2)
        True
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--data.val_fraction must be in (0, 1), got {val_fraction!r}")
    files = sorted(dict.fromkeys(Path(f) for f in files))
    if len(files) <= 1:
        return list(files), []
    if root is None:
        root = Path(os.path.commonpath([str(Path(f).parent) for f in files]))
    scores = {f: _unit_score(_relative_key(f, root), seed) for f in files}
    val = [f for f in files if scores[f] < val_fraction]
    train = [f for f in files if scores[f] >= val_fraction]
    if not val:
        moved = min(train, key=lambda f: scores[f])
        train.remove(moved)
        val.append(moved)
    elif not train:
        moved = max(val, key=lambda f: scores[f])
        val.remove(moved)
        train.append(moved)
    return train, val


def split_point(data: bytes, val_fraction: float) -> int:
    """Byte offset where the held-out tail of a single document starts: about ``val_fraction`` of the bytes are
    held out, starting at a line start when one is near (see ``_line_snap``), else at a UTF-8 character boundary.
    Both parts get at least one byte. Used when the corpus is a single file (there is nothing to split by file).

    Example::

        >>> split_point(b"a\\nb\\nc\\nd\\n", 0.25)
        6
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--data.val_fraction must be in (0, 1), got {val_fraction!r}")
    if len(data) < 2:
        raise ValueError(f"{CORPUS_FLAG}: a single file of {len(data)} byte(s) is too short to split in two")
    cut = min(max(round(len(data) * (1.0 - val_fraction)), 1), len(data) - 1)
    line_start = data.rfind(b"\n", 0, cut) + 1
    if line_start > 0 and cut - line_start <= _line_snap(len(data), cut):
        return line_start
    while cut > 1 and (data[cut] & 0xC0) == 0x80:  # do not start inside a multi-byte character
        cut -= 1
    return cut


def _line_snap(size: int, cut: int) -> int:
    """How many bytes the cut at ``cut`` of a ``size``-byte file may move back to start the held-out part at a line:
    under 256 bytes or 1% of the file, and at most half the smaller part. The half keeps the held-out share within
    1.5 ``val_fraction`` and the training part at least half its size: a small file's lines are long next to its
    parts (a 236-byte file of two lines would otherwise hold out its whole last line, 66%, at any fraction).

    Example::

        >>> _line_snap(100_000, 95_000), _line_snap(236, 224)
        (999, 6)
    """
    return min(max(256, size // 100) - 1, min(cut, size - cut) // 2)


def plan_splits(
    files: Sequence[Path],
    val_fraction: float,
    seed: int,
    root: Optional[Path] = None,
    max_bytes: Optional[int] = None,
) -> tuple[list[FileSpan], list[FileSpan]]:
    """Which bytes of the corpus are trained on and which are held out.

    Caps the corpus at ``max_bytes`` (``cap_bytes``), then splits it by file (``split_files``). A corpus of a
    single file is split inside the file instead: its last ``val_fraction`` (``split_point``) is held out.

    Example::

        >>> train, val = plan_splits(find_corpus_files(None), 0.05, seed=0, max_bytes=100_000)
        >>> sum(s.nbytes for s in train + val)
        100000
    """
    stops = cap_bytes(files, max_bytes)
    kept = list(stops)
    if len(kept) == 1:
        path = kept[0]
        with open(path, "rb") as fh:
            data = fh.read(stops[path])
        cut = split_point(data, val_fraction)
        return [FileSpan(path, 0, cut)], [FileSpan(path, cut, stops[path])]
    train, val = split_files(kept, val_fraction, seed, root)
    return [FileSpan(f, 0, stops[f]) for f in train], [FileSpan(f, 0, stops[f]) for f in val]
