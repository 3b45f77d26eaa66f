"""Tokenizers with one small interface: raw UTF-8 bytes, or a byte-level BPE trained locally on the corpus.

Both are lossless: ``decode(encode(text)) == text`` for any text. Special tokens are never produced by ``encode``
(a literal ``<|endoftext|>`` in a source file is just text); the data pipeline inserts ``eos_id`` between files.

Example::

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode(tok.encode("hé") + [tok.eos_id])
    'hé'
    >>> tok.vocab_size, tok.eos_id, tok.pad_id
    (258, 256, 257)
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Optional, Union

import tokenizers as hf_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lightning_mtp.data.atomic import atomic_write
from lightning_mtp.data.cache_dir import writing_cache
from lightning_mtp.data.corpus import FileSpan, as_span, read_texts

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
TOKENIZER_KINDS = ("byte", "bpe")

_BPE_FORMAT_VERSION = 1
"""Bump when the way BPE tokenizers are built changes, so old cached ones are not reused."""

PathLike = Union[str, os.PathLike]


class Tokenizer(ABC):
    """What the data pipeline and decoding need from a tokenizer."""

    name: str
    """Short identifier, e.g. ``"byte"`` or ``"bpe-4096"``."""
    kind: str
    """What ``--data.tokenizer`` names it: ``"byte"`` or ``"bpe"``."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (every id is ``< vocab_size``)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """End-of-text id, inserted between documents."""

    @property
    @abstractmethod
    def pad_id(self) -> int:
        """Padding id for right-padded batches."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """A hash that changes whenever the mapping text → ids changes (keys caches of token ids)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text → ids, without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids → text. Special tokens are dropped unless ``skip_special_tokens=False``."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (parallel where the implementation allows)."""
        return [self.encode(t) for t in texts]

    def decode_continuation(self, prompt: Sequence[int], new: Sequence[int]) -> str:
        """The text ``new`` ids add after ``prompt``: decoded with the prompt, which is then cut off, as
        ``transformers``' text-generation pipeline does. Decoded alone, a SentencePiece tokenizer strips the first
        word's space ("brown" + "café" read "browncafé").

        Example::

            >>> ByteTokenizer().decode_continuation(list(b"The quick"), list(b" brown"))
            ' brown'
        """
        before, whole = self.decode(prompt), self.decode([*prompt, *new])
        return whole[len(before):] if whole.startswith(before) else self.decode(new)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as a document starts in training (a pretrained tokenizer adds its model's BOS)."""
        return self.encode(text)

    def spec(self) -> dict:
        """The tokenizer itself as plain types (``tokenizer_from_spec`` rebuilds it), so a checkpoint can carry it.

        Example::

            >>> from lightning_mtp.data.tokenizer_choice import tokenizer_from_spec
            >>> tokenizer_from_spec(ByteTokenizer().spec()).fingerprint
            'byte-v1'
        """
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "pad_id": self.pad_id, "fingerprint": self.fingerprint, **self._spec_payload()}

    def _spec_payload(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is ``<|endoftext|>``, 257 is ``<|pad|>``.

    Decoding replaces invalid UTF-8 (e.g. a sequence a model produced) with U+FFFD.
    """

    name = "byte"
    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_id(self) -> int:
        return 256

    @property
    def pad_id(self) -> int:
        return 257

    @property
    def fingerprint(self) -> str:
        return "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        chunk = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                chunk.append(i)
                continue
            if not skip_special_tokens and i in (self.eos_id, self.pad_id):
                out.append(chunk.decode("utf-8", errors="replace"))
                chunk = bytearray()
                out.append(EOS_TOKEN if i == self.eos_id else PAD_TOKEN)
            elif not 0 <= i < self.vocab_size:
                raise ValueError(f"ByteTokenizer: id {i} is outside the vocabulary [0, {self.vocab_size})")
        out.append(chunk.decode("utf-8", errors="replace"))
        return "".join(out)


CorpusItem = Union[Path, str, FileSpan]


def files_fingerprint(items: Sequence[CorpusItem]) -> list[list]:
    """(absolute path, size, mtime in ns, start, stop) of each file or span: what data derived from them depends on.

    Example::

        >>> from lightning_mtp.data.corpus import find_corpus_files
        >>> [row[1] > 0 for row in files_fingerprint(find_corpus_files(None)[:2])]
        [True, True]
    """
    rows = []
    for item in items:
        span = as_span(item)
        st = span.path.stat()
        rows.append([str(span.path.resolve()), st.st_size, st.st_mtime_ns, span.start, span.stop])
    return rows


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenization, no prefix space) trained with Hugging Face ``tokenizers``.

    Ids 0 and 1 are ``<|endoftext|>`` and ``<|pad|>``; the 256 byte symbols follow, then the merges.

    Example::

        >>> import tempfile
        >>> from lightning_mtp.data.corpus import find_corpus_files
        >>> files = [f for f in find_corpus_files(None) if f.name in ("os.py", "glob.py")]
        >>> tok = BPETokenizer.train(files, vocab_size=512, cache_dir=tempfile.mkdtemp())
        >>> text = "def f(x):\\n    return 'héllo'  # 日本\\n"
        >>> tok.decode(tok.encode(text)) == text
        True
        >>> tok.vocab_size, tok.eos_id, tok.pad_id
        (512, 0, 1)
    """

    kind = "bpe"

    def __init__(self, hf: HFTokenizer, name: Optional[str] = None) -> None:
        eos, pad = hf.token_to_id(EOS_TOKEN), hf.token_to_id(PAD_TOKEN)
        if eos is None or pad is None:
            raise ValueError(f"BPETokenizer: the tokenizer lacks the special tokens {EOS_TOKEN!r} and {PAD_TOKEN!r}")
        hf.encode_special_tokens = True  # text is always plain text; not serialized, so set on every load
        self._hf = hf
        self._eos, self._pad = eos, pad
        self._fingerprint = hashlib.sha1(hf.to_str().encode("utf-8")).hexdigest()
        self.name = name or f"bpe-{hf.get_vocab_size(with_added_tokens=True)}"

    @property
    def hf(self) -> HFTokenizer:
        """The underlying Hugging Face tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _spec_payload(self) -> dict:
        return {"json": self._hf.to_str()}

    @staticmethod
    def check_vocab_size(vocab_size: int) -> None:
        """Raise unless ``vocab_size`` leaves room for the 256 bytes and the special tokens."""
        least = 256 + len(SPECIAL_TOKENS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < least:
            raise ValueError(
                f"--data.vocab_size must be >= {least} for the BPE tokenizer (256 bytes + {len(SPECIAL_TOKENS)} "
                f"special tokens), got {vocab_size!r}"
            )

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train on texts (no caching; a sequence or a stream). The result may have fewer than ``vocab_size`` ids
        when the texts do not offer enough merges."""
        cls.check_vocab_size(vocab_size)
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer, length=len(texts) if isinstance(texts, Sequence) else None)
        return cls(hf)

    @staticmethod
    def cache_key(files: Sequence[CorpusItem], vocab_size: int, texts_key: Optional[str] = None) -> str:
        """Hash of what a trained tokenizer depends on: the files (paths, sizes, mtimes, byte ranges read), the
        vocab size, the versions of ``tokenizers`` and of this recipe, and ``texts_key`` (see :meth:`train`)."""
        payload = {
            "files": files_fingerprint(files),
            "vocab_size": vocab_size,
            "tokenizers": hf_tokenizers.__version__,
            "format": _BPE_FORMAT_VERSION,
            **({"texts": texts_key} if texts_key is not None else {}),
        }
        return hashlib.sha1(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()

    @classmethod
    def cache_path(cls, files: Sequence[CorpusItem], vocab_size: int, cache_dir: PathLike,
                   texts_key: Optional[str] = None) -> Path:
        """Where ``train`` stores (and looks for) the tokenizer: ``<cache_dir>/tokenizers/bpe-<V>-<key>.json``."""
        key = cls.cache_key(files, vocab_size, texts_key)
        return Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{key[:16]}.json"

    @classmethod
    def train(
        cls,
        files: Sequence[CorpusItem],
        vocab_size: int,
        cache_dir: Optional[PathLike] = None,
        texts: Optional[Callable[[], Iterable[str]]] = None,
        texts_key: Optional[str] = None,
    ) -> BPETokenizer:
        """Train on the files' text, or load the tokenizer cached for exactly these files and settings.

        Args:
            files: training files or ``FileSpan``s (the train split only, so held-out text stays unseen).
            vocab_size: requested vocabulary size, special tokens included (``--data.vocab_size``).
            cache_dir: where trained tokenizers are kept; ``None`` disables caching.
            texts: what to train on instead of the files' raw text (records: their train split's text fields);
                the files still key the cache.
            texts_key: what ``texts`` depends on beyond the files (records: how they are split), in the cache key,
                so that a tokenizer trained on another split's train records (which saw this one's held-out ones)
                is not reused.
        """
        cls.check_vocab_size(vocab_size)
        if not files:
            raise ValueError("--data.corpus: no training files to train the BPE tokenizer on")
        path = None if cache_dir is None else cls.cache_path(files, vocab_size, cache_dir, texts_key)
        if path is not None and path.is_file():
            return cls.load(path)
        tok = cls.train_from_texts(read_texts(files) if texts is None else texts(), vocab_size)
        if path is not None:  # a full disk: one line naming --data.cache_dir, no partial file (atomic_write)
            with writing_cache(Path(cache_dir), path.parent, "BPE tokenizer trained on --data.corpus"):
                tok.save(path)
        return tok

    @classmethod
    def load(cls, path: PathLike) -> BPETokenizer:
        """Load a tokenizer saved by ``save`` (a Hugging Face ``tokenizer.json``)."""
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: PathLike) -> None:
        """Write the tokenizer as JSON (atomically, so concurrent readers never see a partial file)."""
        atomic_write(Path(path), lambda fh: fh.write(self._hf.to_str().encode("utf-8")))
