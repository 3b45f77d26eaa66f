"""``TextDataModule``: a text corpus as fixed windows of token ids, for training, validation and prompting.

Pipeline: find the corpus files → cap at ``max_bytes`` → split train/val by file → train (or load) the tokenizer on
the train split → tokenize each split, files joined by EOS → cache the ids as ``.npy`` → non-overlapping windows of
``seq_len`` tokens. Everything derived is cached under ``cache_dir`` and keyed by what it depends on::

    <cache_dir>/tokenizers/bpe-<vocab_size>-<key>.json       trained BPE tokenizers
    <cache_dir>/tokens/<tokenizer name>-<key>/train.npy      token ids (uint16, or int32 for vocabularies > 65536)
    <cache_dir>/tokens/<tokenizer name>-<key>/val.npy
    <cache_dir>/tokens/<tokenizer name>-<key>/meta.json      what was tokenized; written last (marks completion)

Example::

    >>> cache = getfixture("tmp_path")  # any directory
    >>> dm = TextDataModule(tokenizer="byte", seq_len=64, batch_size=4, max_bytes=50_000, cache_dir=cache)
    >>> dm.setup("fit")
    >>> batch = next(iter(dm.train_dataloader()))
    >>> batch["input_ids"].shape, batch["input_ids"].dtype, dm.vocab_size
    (torch.Size([4, 64]), torch.int64, 258)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.parsing import AttributeDict
from torch.utils.data import DataLoader, Dataset

from lightning_mtp.data.atomic import atomic_write
from lightning_mtp.data.cache_dir import check_writable, writing_cache
from lightning_mtp.data.corpus import (
    CORPUS_FLAG,
    FileSpan,
    UndecodableTally,
    check_corpus,
    corpus_root,
    find_corpus_files,
    plan_splits,
)
from lightning_mtp.data.documents import read_tallied, tokenize_documents
from lightning_mtp.data.loading import (
    EpochShuffleSampler,
    PaddingMarkedSampler,
    ResumableDataLoader,
    TokenWindowDataset,
    UnscoredPadding,
)
from lightning_mtp.data.pretrained_tokenizer import (
    check_tokenizer_path,
    is_tokenizer_path,
    load_pretrained_tokenizer,
    other_ids,
)
from lightning_mtp.data.prompts import (
    PROMPTS_FLAG,
    PromptCollator,
    PromptDataset,
    chat_prompt,
    check_prompts_path,
    read_numbered_prompts,
)
from lightning_mtp.data.record_files import record_files
from lightning_mtp.data.records import TRAIN_ON, RecordCorpus, RecordSettings, remove_stale_private
from lightning_mtp.data.tokenizer_choice import build_tokenizer
from lightning_mtp.data.tokenizers import TOKENIZER_KINDS, BPETokenizer, Tokenizer, files_fingerprint

DATA_SETTINGS = ("tokenizer", "vocab_size", "corpus", "max_bytes", "seed", "val_fraction", "suffixes", "seq_len",
                 "batch_size", "text_field", "messages_field", "train_on", "packing")
"""The init arguments that decide which tokens a fit saw; a checkpoint records them (``tokenizer_record``)."""

STREAM_SETTINGS = ("seed", "seq_len", "val_fraction", "packing", "text_field", "messages_field", "train_on")
"""The init arguments that decide which rows the training loader deals out and in which order (with the corpus,
whose changes are warned, and the batch size and processes, which the loader checks): a resume must keep them."""

_TOKENS_FORMAT_VERSION = 3  # 2: a model folder's tokenizer gives raw documents its BOS; 3: U+FFFD counts in meta
"""Bump when the token cache layout or the joining of files changes."""

DEFAULT_SUFFIXES = (".py",)
"""``--data.suffixes`` unset: a folder's Python files."""

_FINGERPRINT_FILES = 2000
"""A checkpoint lists the corpus files up to this many (to name what changed on resume); beyond, their digest only."""


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"--data.{field} {message}")


def _check_int(field: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _fail(field, f"must be an integer >= {least}, got {value!r}")


def corpus_change(saved: dict[str, Any], now: dict[str, Any]) -> Optional[str]:
    """How the corpus ``now`` differs from the ``saved`` one (both :meth:`TextDataModule.corpus_fingerprint`), in a
    few words; ``None`` when it is the same.

    Example::

        >>> before = {"digest": "a", "count": 1, "bytes": 10, "files": [["x.jsonl", 10, 1, 0, 10]]}
        >>> after = {"digest": "b", "count": 2, "bytes": 25,
        ...          "files": [["x.jsonl", 20, 2, 0, 20], ["y.jsonl", 5, 3, 0, 5]]}
        >>> corpus_change(before, after)
        '1 file(s) added (first y.jsonl), 1 changed (first x.jsonl: 10 -> 20 bytes)'
    """
    if saved.get("digest") == now.get("digest"):
        return None
    if saved.get("files") is None or now.get("files") is None:
        return f"{saved.get('count')} file(s) of {saved.get('bytes')} bytes then, {now['count']} of {now['bytes']} now"
    old = {row[0]: row for row in saved["files"]}
    new = {row[0]: row for row in now["files"]}
    parts = []
    added = [name for name in new if name not in old]
    removed = [name for name in old if name not in new]
    changed = [name for name in new if name in old and new[name] != old[name]]
    if added:
        parts.append(f"{len(added)} file(s) added (first {added[0]})")
    if removed:
        parts.append(f"{len(removed)} removed (first {removed[0]})")
    if changed:
        first = changed[0]
        how = (f"{old[first][1]} -> {new[first][1]} bytes" if old[first][1] != new[first][1] else "modified")
        parts.append(f"{len(changed)} changed (first {first}: {how})")
    return ", ".join(parts) or "the files' order changed"


class TextDataModule(L.LightningDataModule):
    """A text corpus as windows of ``seq_len`` token ids: ``{"input_ids": LongTensor[B, seq_len]}`` batches.

    For ``predict``, ``setup("predict")`` reads and tokenizes the prompts (``predict_dataset``; from a prompts file,
    without reading the corpus); the LightningModule can then refuse a prompt that leaves no room to generate with
    ``check_prompts_fit(max_prompt_tokens, why)`` from its own ``setup`` hook (Lightning runs the datamodule's
    ``setup`` first). Tokenizing the corpus warns when many of its bytes are not UTF-8
    (``corpus.UNDECODABLE_WARN_SHARE``).

    Args:
        corpus: ``None`` uses the Python standard library's sources; else a file, folder (symlinked folders
            followed) or glob. ``.jsonl``, ``.ndjson``, ``.json``, ``.parquet`` and ``.csv`` files, gzip'd
            ``.jsonl.gz``, ``.json.gz`` and ``.csv.gz`` ones (and ``.txt`` files beside them) are read as records with
            ``datasets`` (:mod:`~lightning_mtp.data.records`: text or chat, packed or padded rows with labels); other
            files (source code, ``.txt`` files alone) are read whole, joined by EOS and cut into windows (a compressed
            one is refused).
        tokenizer: ``"bpe"`` (byte-level BPE trained on the train split), ``"byte"`` (raw UTF-8 bytes), a local
            model folder or ``tokenizer.json`` (:mod:`~lightning_mtp.data.pretrained_tokenizer`), or ``None``: the
            model folder's own when the model is loaded from one (``HFCausalLM(pretrained=DIR)``), else ``"bpe"``.
        vocab_size: BPE vocabulary size incl. special tokens (≥ 258); ignored by ``"byte"`` (always 258).
        seq_len: tokens per training window (≥ 2).
        batch_size: windows (or prompts) per batch.
        val_fraction: share of records (a record corpus) or of files held out for validation (a single raw file
            holds out its tail).
        max_bytes: read at most this many corpus bytes (first files in sorted order), for quick runs; raw corpora
            only: records are read whole (a record corpus with it set warns; cap a quick run with
            ``--trainer.max_steps`` or ``--trainer.limit_train_batches``).
        cache_dir: where tokenizers and token ids are cached; it must be a folder this process can write (else
            refused naming ``--data.cache_dir``), a complete cache included.
        num_workers: ``DataLoader`` worker processes.
        seed: seeds the train/val split and the shuffling of training windows.
        suffixes: file endings read when ``corpus`` is a directory of raw files; ``None`` reads every file. A record
            corpus reads its record files whatever they are (set otherwise, it warns).
        predict_prompts: a ``.txt`` / ``.jsonl`` prompts file for ``predict``; ``None`` takes prompts from the
            held-out data.
        num_predict_prompts: how many held-out windows give prompts when ``predict_prompts`` is ``None``.
        prompt_tokens: how many tokens of each held-out window form its prompt (at most ``seq_len``).
        text_field: the records' field holding a document's text.
        messages_field: the records' field holding chat turns (``[{"role", "content"}, ...]``); records with it are
            chat, rendered with the tokenizer's chat template.
        train_on: ``"assistant"`` (only the tokens the chat template marks as generated) or ``"all"``; ``None``:
            ``"assistant"`` for chat, ``"all"`` for text.
        packing: pack documents into ``seq_len`` rows with ``position_ids`` restarting per document (``None``: for
            text records, not for chat); ``False``: one record per row, right-padded with an ``attention_mask``.
        num_proc: processes that tokenize records (``None``: up to 4, fewer for small data).
    """

    def __init__(
        self,
        corpus: Optional[str] = None,
        tokenizer: Optional[str] = None,
        vocab_size: int = 4096,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        cache_dir: str = ".cache/lightning_mtp",
        num_workers: int = 0,
        seed: int = 1234,
        suffixes: Optional[tuple[str, ...]] = DEFAULT_SUFFIXES,
        predict_prompts: Optional[str] = None,
        num_predict_prompts: int = 8,
        prompt_tokens: int = 32,
        text_field: str = "text",
        messages_field: str = "messages",
        train_on: Optional[str] = None,
        packing: Optional[bool] = None,
        num_proc: Optional[int] = None,
    ) -> None:
        super().__init__()
        if is_tokenizer_path(tokenizer):
            check_tokenizer_path(tokenizer)
        elif tokenizer is not None and tokenizer not in TOKENIZER_KINDS:
            raise _fail("tokenizer", f"must be one of {TOKENIZER_KINDS}, a local model folder or a tokenizer.json, "
                                     f"got {tokenizer!r}")
        if train_on is not None and train_on not in TRAIN_ON:
            raise _fail("train_on", f"must be one of {TRAIN_ON} or null, got {train_on!r}")
        for name, value in (("text_field", text_field), ("messages_field", messages_field)):
            if not isinstance(value, str) or not value:
                raise _fail(name, f"must be a field name, got {value!r}")
        if num_proc is not None:
            _check_int("num_proc", num_proc, 1)
        if tokenizer in (None, "bpe"):
            BPETokenizer.check_vocab_size(vocab_size)
        _check_int("seq_len", seq_len, 2)
        _check_int("batch_size", batch_size, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("num_predict_prompts", num_predict_prompts, 1)
        _check_int("prompt_tokens", prompt_tokens, 1)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise _fail("val_fraction", f"must be in (0, 1), got {val_fraction!r}")
        if max_bytes is not None:
            _check_int("max_bytes", max_bytes, 1)
        if isinstance(suffixes, str):
            raise _fail("suffixes", f"must be a list of file endings such as ['.py'], got the string {suffixes!r}")
        check_corpus(corpus)
        if predict_prompts is not None:
            check_prompts_path(predict_prompts)
        self.save_hyperparameters()

        self.corpus = corpus
        self.tokenizer_kind = tokenizer
        self.requested_vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.max_bytes = max_bytes
        self.cache_dir = Path(cache_dir)
        self.num_workers = num_workers
        self.seed = seed
        self.suffixes = None if suffixes is None else tuple(suffixes)
        self.predict_prompts = predict_prompts
        self.num_predict_prompts = num_predict_prompts
        self.prompt_tokens = prompt_tokens
        self.num_proc = num_proc
        files = record_files(corpus)
        self.records: Optional[RecordCorpus] = None if files is None else RecordCorpus(
            files, RecordSettings(text_field, messages_field, train_on, packing, seq_len, float(val_fraction), seed),
            self.cache_dir)

        self._splits: Optional[tuple[list[FileSpan], list[FileSpan]]] = None
        self._tokenizer: Optional[Tokenizer] = None
        self._token_dir: Optional[Path] = None
        self.train_dataset: Optional[TokenWindowDataset] = None
        self.val_dataset: Optional[TokenWindowDataset] = None
        self.train_tokens: Optional[np.ndarray] = None
        self.val_tokens: Optional[np.ndarray] = None
        self.predict_dataset: Optional[PromptDataset] = None
        self._train_loader: Optional[ResumableDataLoader] = None
        self._train_loader_state: Optional[dict[str, int]] = None
        self._corpus_state: Optional[dict[str, Any]] = None
        self._cache_dir_checked = False

    # ----------------------------------------------------------------- corpus and tokenizer

    def corpus_splits(self) -> tuple[list[FileSpan], list[FileSpan]]:
        """The (train, val) file spans of the corpus (found and split once per object)."""
        if self._splits is None:
            files = find_corpus_files(self.corpus, self.suffixes)
            root = corpus_root(self.corpus)
            self._splits = plan_splits(files, self.val_fraction, self.seed, root, self.max_bytes)
        return self._splits

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer, built on first use: BPE is trained on the train split, or loaded from the cache; unset, the
        model folder's own (see ``tokenizer``)."""
        if self._tokenizer is None:
            folder, kind = self._model_folder(), self.tokenizer_kind
            if kind is None:
                self._refuse_folder_without_tokenizer()
                self.tokenizer_kind = folder or "bpe"
            elif kind in ("bpe", "byte") and folder:
                raise ValueError(
                    f"--data.tokenizer {kind}: the model is loaded from {folder!r}, which has its own "
                    f"tokenizer, and its embedding rows mean that tokenizer's ids, not {kind} ones: leave "
                    "--data.tokenizer unset (null: the model folder's tokenizer) or give the folder")
            if self.tokenizer_kind == "bpe":
                self.check_cache_dir()  # the BPE (and a record corpus's Arrow tables) are cached there
            if self.tokenizer_kind == "bpe" and self.records is not None:
                self._tokenizer = BPETokenizer.train(self.records.files, self.requested_vocab_size, self.cache_dir,
                                                     texts=self.records.training_texts,
                                                     texts_key=self.records.training_texts_key())
            else:
                train = self.corpus_splits()[0] if self.tokenizer_kind == "bpe" else []
                self._tokenizer = build_tokenizer(self.tokenizer_kind, train, self.requested_vocab_size,
                                                  self.cache_dir)
            if folder and kind is not None and is_tokenizer_path(kind):
                self._refuse_other_ids(folder, kind)
        return self._tokenizer

    def _refuse_other_ids(self, folder: str, kind: str) -> None:
        """A tokenizer given for a model folder that has its own must map the folder's tokens to the same ids: the
        embedding rows mean those ids (it may add tokens or another chat template)."""
        if Path(kind).expanduser().resolve() == Path(folder).expanduser().resolve():
            return
        problem = other_ids(self._tokenizer, load_pretrained_tokenizer(folder))
        if problem is not None:
            raise ValueError(
                f"--data.tokenizer {kind}: the model is loaded from {folder!r}, whose embedding rows mean its own "
                f"tokenizer's ids, and this tokenizer gives other ids ({problem}): leave --data.tokenizer unset "
                "(null: the model folder's tokenizer) or give one with the same ids")

    def _refuse_folder_without_tokenizer(self) -> None:
        """A pretrained model folder without tokenizer files (``model.save_pretrained`` alone) and no tokenizer given:
        a BPE trained on the corpus would give ids its embedding rows do not mean, and train without a word."""
        folder = getattr(getattr(getattr(self, "trainer", None), "lightning_module", None), "pretrained", None)
        if isinstance(folder, str) and Path(folder).is_dir() and self._model_folder() is None:
            raise ValueError(
                f"--model.init_args.pretrained {folder!r} holds no tokenizer (no tokenizer.json or "
                "tokenizer_config.json), and its embedding rows mean the ids of the tokenizer it was trained with: "
                "give that tokenizer with --data.init_args.tokenizer PATH (a folder its save_pretrained wrote, or the "
                "model's hub folder), or save it into the model folder (tokenizer.save_pretrained(folder))")

    def _model_folder(self) -> Optional[str]:
        """The local folder the trainer's model was loaded from, when it holds a tokenizer."""
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        folder = getattr(module, "pretrained", None)
        if isinstance(folder, str) and Path(folder).is_dir() and (
                (Path(folder) / "tokenizer.json").is_file() or (Path(folder) / "tokenizer_config.json").is_file()):
            return folder
        return None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer (built on demand, see ``load_tokenizer``)."""
        return self.load_tokenizer()

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Use ``tokenizer`` instead of building one from ``--data.tokenizer`` / ``--data.vocab_size``: the one a
        checkpoint was trained with (``lightning-mtp predict/validate/fit --ckpt_path`` do this for you).

        Example::

            >>> from lightning_mtp.data.tokenizers import ByteTokenizer
            >>> dm = TextDataModule(tokenizer="bpe", vocab_size=512)
            >>> dm.use_tokenizer(ByteTokenizer())
            >>> dm.vocab_size
            258
        """
        if self.train_dataset is not None or self._token_dir is not None:
            raise RuntimeError("TextDataModule.use_tokenizer must be called before prepare_data/setup")
        self._tokenizer = tokenizer
        self.tokenizer_kind = tokenizer.kind if tokenizer.kind in TOKENIZER_KINDS else self.tokenizer_kind

    def tokenizer_record(self) -> dict:
        """The tokenizer itself and the data settings it was built with, in plain types, for checkpoints."""
        settings = {name: getattr(self.hparams, name, None) for name in DATA_SETTINGS}
        settings["tokenizer"] = self.tokenizer_kind
        for name in ("corpus", "tokenizer"):  # paths as absolute ones: validate / predict may run in another folder
            value = settings[name]
            if isinstance(value, str) and (name == "corpus" or is_tokenizer_path(value)):
                settings[name] = str(Path(value).expanduser().absolute())
        if settings["suffixes"] is not None:
            settings["suffixes"] = list(settings["suffixes"])
        return {**self.load_tokenizer().spec(), "data": settings,
                "datamodule": f"{type(self).__module__}.{type(self).__qualname__}"}

    @property
    def hparams_initial(self) -> AttributeDict:
        """The init arguments as the loggers receive them. Lightning merges them with the LightningModule's and refuses
        a name both have with other values; a module may well have its own (``vocab_size``: its embedding rows, which
        may differ from the tokenizer's, which ``"byte"`` ignores anyway), so such a setting is logged as
        ``data/<name>`` here. ``hparams`` (what a checkpoint saves, ``datamodule_hyper_parameters``) keeps every name.

        Example::

            >>> import lightning as L
            >>> class Module(L.LightningModule):
            ...     def __init__(self, vocab_size=300):
            ...         super().__init__()
            ...         self.save_hyperparameters()
            >>> dm = TextDataModule(tokenizer="byte")
            >>> trainer = L.Trainer(logger=False)
            >>> trainer.strategy.connect(Module())
            >>> dm.trainer = trainer
            >>> dm.hparams_initial["data/vocab_size"], "vocab_size" in dm.hparams_initial, dm.hparams["vocab_size"]
            (4096, False, 4096)
        """
        initial = super().hparams_initial
        trainer = getattr(self, "trainer", None)
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        theirs = getattr(module, "hparams_initial", None) or {}
        for key in [key for key in initial if key in theirs and key != "_class_path"]:
            mine, other = initial[key], theirs[key]
            if type(mine) is not type(other) or isinstance(mine, torch.Tensor) or mine != other:
                initial[f"data/{key}"] = initial.pop(key)
        return initial

    @property
    def vocab_size(self) -> int:
        """The tokenizer's actual vocabulary size incl. special tokens (258 for ``"byte"``; BPE may come out below
        ``--data.vocab_size`` on a tiny corpus)."""
        return self.load_tokenizer().vocab_size

    @property
    def eos_id(self) -> int:
        return self.load_tokenizer().eos_id

    @property
    def pad_id(self) -> int:
        return self.load_tokenizer().pad_id

    @property
    def stop_ids(self) -> list[int]:
        """What ``predict`` stops a row at by default: EOS, and a chat template's end of turn (see
        ``PretrainedTokenizer.end_of_turn_id``)."""
        tokenizer = self.load_tokenizer()
        return tokenizer.stop_ids() if hasattr(tokenizer, "stop_ids") else [tokenizer.eos_id]

    # ----------------------------------------------------------------- token cache

    def token_cache_dir(self) -> Path:
        """``<cache_dir>/tokens/<tokenizer>-<key>``: the key hashes the files (paths, sizes, mtimes, byte ranges),
        the tokenizer, ``max_bytes``, ``seed`` and ``val_fraction``."""
        train, val = self.corpus_splits()
        tokenizer = self.load_tokenizer()
        payload = {
            "train": files_fingerprint(train),
            "val": files_fingerprint(val),
            "tokenizer": tokenizer.fingerprint,
            "max_bytes": self.max_bytes,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "format": _TOKENS_FORMAT_VERSION,
        }
        key = hashlib.sha1(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()
        return self.cache_dir / "tokens" / f"{tokenizer.name}-{key[:16]}"

    def prepare_data(self) -> None:
        """Find and split the corpus, train/load the tokenizer, tokenize both splits and cache the ids on disk.

        Does nothing beyond hashing file metadata when the cache is already there. Lightning calls it on one process
        per node (for every stage); ``setup`` calls it too when it has not run in this process. Nothing to do when the
        trainer predicts from a prompts file (``--data.predict_prompts``): the corpus is not needed.
        """
        if self._predicting_from_file():
            return
        self.check_cache_dir()
        self._corpus_fingerprint()  # the files as they are read (a file still being written: a resume compares)
        if self.records is not None:
            self.records.build(self.load_tokenizer(), self.num_proc)
            return
        self._token_dir = self._prepare()

    def _predicting_from_file(self) -> bool:
        """Whether the trainer runs ``predict`` with prompts from a file (which needs the tokenizer, not the corpus)."""
        stage = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)  # TrainerFn: a str
        return self.predict_prompts is not None and stage == "predict"

    def check_cache_dir(self) -> None:
        """Refuse a ``--data.cache_dir`` this process cannot write (a file, under a file, read-only, not permitted),
        naming it and why, before anything is read into it; checked once per object. A complete cache on a read-only
        mount is refused too: ``datasets`` takes lock files even to read its tables."""
        if not self._cache_dir_checked:
            check_writable(self.cache_dir)
            self._cache_dir_checked = True

    def _prepare(self) -> Path:
        """The token cache folder, tokenized first when missing; warns (each fit, cached or not) when many of the
        corpus characters stand for bytes that are not UTF-8 (``meta.json`` keeps the counts and the warning)."""
        out = self.token_cache_dir()
        if not (out / "meta.json").is_file():
            with writing_cache(self.cache_dir, out, "token ids of the corpus"):
                self._tokenize_corpus(out)
        undecodable = json.loads((out / "meta.json").read_text(encoding="utf-8")).get("undecodable") or {}
        if undecodable.get("warning"):
            rank_zero_warn(undecodable["warning"])
        return out

    def _tokenize_corpus(self, out: Path) -> None:
        """Tokenize both splits into ``out`` (``train.npy``, ``val.npy``, then ``meta.json``, which marks it done)."""
        train, val = self.corpus_splits()
        tokenizer = self.load_tokenizer()
        out.mkdir(parents=True, exist_ok=True)
        remove_stale_private(out)  # the private files of a build killed part-way
        counts = {}
        tally = UndecodableTally()
        for split, spans in (("train", train), ("val", val)):
            ids = tokenize_documents(read_tallied(spans, tally), tokenizer)
            atomic_write(out / f"{split}.npy", lambda fh, ids=ids: np.save(fh, ids))
            counts[split] = {"files": len(spans), "bytes": sum(s.nbytes for s in spans), "tokens": int(ids.size)}
        undecodable = {"chars": sum(tally.chars.values()), "replaced": sum(tally.replaced.values()),
                       "warning": tally.warning(corpus_root(self.corpus))}
        meta = {
            "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
            "corpus": self.corpus,
            "max_bytes": self.max_bytes,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            **counts,
            "val_files": [str(s.path) for s in val],
            "undecodable": undecodable,
        }
        atomic_write(out / "meta.json", lambda fh: fh.write(json.dumps(meta, indent=1).encode("utf-8")))

    def setup(self, stage: Optional[str] = None) -> None:
        """Load the cached ids (preparing them first if needed) and build the window datasets; for ``"predict"`` read
        and tokenize the prompts (``predict_dataset``). With a prompts file, ``"predict"`` reads the prompts alone:
        the corpus is neither read nor tokenized (the prompts need only the tokenizer)."""
        if stage == "predict" and self.predict_prompts is not None:
            self.prompt_dataset()
            return
        self._setup_windows()
        if stage == "predict":
            self.prompt_dataset()

    def _setup_windows(self) -> None:
        if self.train_dataset is not None:
            return
        self.check_cache_dir()
        self._corpus_fingerprint()  # the files as they are read, for the checkpoint (a resume compares)
        if self.records is not None:
            self._warn_raw_only_settings()
            self.records.build(self.load_tokenizer(), self.num_proc)
            self.train_dataset, self.val_dataset = self.records.train_rows, self.records.val_rows
            return
        out = self._token_dir or self._prepare()
        train = np.load(out / "train.npy", mmap_mode="r")
        val = np.load(out / "val.npy", mmap_mode="r")
        if len(train) < self.seq_len:
            raise ValueError(
                f"--data.seq_len: the train split has {len(train)} tokens, fewer than --data.seq_len={self.seq_len}; "
                "use a larger --data.corpus / --data.max_bytes or a smaller --data.seq_len"
            )
        if len(val) < self.seq_len:
            raise ValueError(
                f"--data.val_fraction: the val split has {len(val)} tokens, fewer than --data.seq_len={self.seq_len}; "
                "raise --data.val_fraction or --data.max_bytes, or lower --data.seq_len"
            )
        self.train_tokens, self.val_tokens = train, val
        self.train_dataset = TokenWindowDataset(train, self.seq_len)
        self.val_dataset = TokenWindowDataset(val, self.seq_len)
        self._corpus_fingerprint()

    def _warn_raw_only_settings(self) -> None:
        """Warn that ``--data.max_bytes`` and ``--data.suffixes`` (when set otherwise than their defaults) have no
        effect on a record corpus, which is read whole."""
        flags = [] if self.max_bytes is None else [f"--data.max_bytes {self.max_bytes}"]
        if self.suffixes != DEFAULT_SUFFIXES:
            flags.append(f"--data.suffixes {None if self.suffixes is None else list(self.suffixes)}")
        if flags:
            rank_zero_warn(
                f"{' and '.join(flags)}: {'these apply' if len(flags) > 1 else 'it applies'} to raw corpora only, and "
                f"{CORPUS_FLAG} {self.corpus!r} is records, read whole (every record of its "
                f"{len(self.records.files)} record file(s)): for a quick run, cap the steps with --trainer.max_steps "
                "or --trainer.limit_train_batches")

    # ----------------------------------------------------------------- loaders

    def _loader(self, dataset: Dataset, shuffle: bool, drop_last: bool = False, **kwargs: Any) -> DataLoader:
        if self.records is not None and "collate_fn" not in kwargs:
            kwargs["collate_fn"] = self.records.collate(dataset, self.pad_id)
        options = dict(
            batch_size=self.batch_size,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )
        if not shuffle:
            return DataLoader(dataset, shuffle=False, **options)
        # The generator only seeds workers (the windows need no randomness); the order comes from the sampler.
        trainer = self.trainer  # the batches a step's gradient is accumulated over read together
        return ResumableDataLoader(dataset, sampler=EpochShuffleSampler(len(dataset), self.seed),
                                   generator=torch.Generator().manual_seed(self.seed),
                                   accumulate=getattr(trainer, "accumulate_grad_batches", 1),
                                   limit_batches=getattr(trainer, "limit_train_batches", None), **options)

    def train_dataloader(self) -> DataLoader:
        """Shuffled windows (seeded, a new order each pass); the last partial batch is dropped when there is at least
        one full batch. The loader is resumable mid-epoch (:class:`ResumableDataLoader`)."""
        self.setup("fit")
        loader = self._loader(self.train_dataset, shuffle=True, drop_last=len(self.train_dataset) >= self.batch_size)
        if self._train_loader_state is not None:
            loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position and the corpus the rows come from (:meth:`corpus_fingerprint`). Lightning
        saves it in the checkpoint; it also saves the loader's position with the loop state, and keeping it here as
        well restores it when the loader is built before the loops are restored (``configure_optimizers`` asking
        ``trainer.estimated_stepping_batches``, Lightning #20550)."""
        state: dict[str, Any] = {"settings": self._stream_settings()}
        if self.train_dataset is not None:
            state["corpus"] = self._corpus_fingerprint()
        loader = self._iterated_train_loader()
        if loader is not None:
            state["train_loader"] = loader.state_dict()
        return state

    def _stream_settings(self) -> dict[str, Any]:
        """The settings that decide which rows the training loader deals out, and in which order."""
        return {name: getattr(self.hparams, name, None) for name in STREAM_SETTINGS}

    def _refuse_other_stream(self, saved: Optional[dict[str, Any]]) -> None:
        """Refuse to resume a fit whose rows or their order these settings change (the loader's position would point
        into another stream: rows trained twice, others never, another validation split). The CLI refuses them
        before the fit starts; this is the same rule for a ``Trainer.fit(ckpt_path=...)`` of one's own."""
        changed = [(name, saved[name], value) for name, value in self._stream_settings().items()
                   if saved and name in saved and saved[name] != value]
        if changed:
            what = ", ".join(f"--data.{name} {old!r} -> {new!r}" for name, old, new in changed)
            raise ValueError(
                f"ckpt_path: the checkpoint's fit read its data with other settings ({what}): resumed, it would "
                "continue on other rows than the ones it stopped in (some trained twice, others never). Resume with "
                "the settings it was saved with, or start a new fit from its weights (init_from)")

    def _iterated_train_loader(self) -> Optional[ResumableDataLoader]:
        """The training loader being iterated: under DDP / FSDP the copy Lightning made with a distributed sampler
        (the one built here never runs), else the one built here."""
        iterated = getattr(self.trainer, "train_dataloader", None) if self.trainer is not None else None
        return iterated if isinstance(iterated, ResumableDataLoader) else self._train_loader

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training loader's position; warn (rank zero) when resuming a fit on a corpus whose files
        changed since the checkpoint was saved: the loader's position then points into other rows."""
        saved = state_dict.get("corpus")
        stage = getattr(getattr(getattr(self, "trainer", None), "state", None), "fn", None)  # TrainerFn: a str
        if stage in (None, "fit"):
            self._refuse_other_stream(state_dict.get("settings"))
        if isinstance(saved, dict) and stage in (None, "fit"):
            change = corpus_change(saved, self._corpus_fingerprint())
            if change is not None:
                rank_zero_warn(
                    f"{CORPUS_FLAG}: the corpus changed since the checkpoint was saved ({change}): the resumed fit "
                    "trains on the corpus as it is now, so the rest of the interrupted epoch continues on other rows "
                    "than it would have (an exact resume is impossible), and the validation split may differ; "
                    "resume on the checkpoint's files for an exact resume")
        self._train_loader_state = state_dict.get("train_loader")
        loader = self._iterated_train_loader()  # (FSDP2 / DeepSpeed restore after Lightning made its copy: that one)
        if loader is not None and self._train_loader_state is not None:
            loader.load_state_dict(self._train_loader_state)

    def corpus_fingerprint(self) -> dict[str, Any]:
        """The corpus files the rows are made of, as the caches key them: each file's path (relative to the corpus
        root), size, modification time and byte range, with their digest, count and total bytes."""
        items = self.records.files if self.records is not None else [*self.corpus_splits()[0],
                                                                      *self.corpus_splits()[1]]
        root = corpus_root(self.corpus).resolve()
        rows = []
        for path, *rest in files_fingerprint(items):
            try:
                path = Path(path).relative_to(root).as_posix()
            except ValueError:
                pass
            rows.append([str(path), *rest])
        digest = hashlib.sha1(json.dumps(rows).encode("utf-8")).hexdigest()
        return {"digest": digest, "count": len(rows), "bytes": sum(row[1] for row in rows),
                "files": rows if len(rows) <= _FINGERPRINT_FILES else None}

    def _corpus_fingerprint(self) -> dict[str, Any]:
        if self._corpus_state is None:
            self._corpus_state = self.corpus_fingerprint()
        return self._corpus_state

    def val_dataloader(self) -> DataLoader:
        """All held-out windows, in order. On several processes each takes every world-size-th row, and the padding
        that evens their shares out scores nothing (:class:`PaddingMarkedSampler`): Lightning's own sampler repeats
        the first rows there, which the token-weighted ``val/`` means then counted twice."""
        self.setup("validate")
        sampler = self._padding_marked_sampler(self.val_dataset)
        if sampler is None:
            return self._loader(self.val_dataset, shuffle=False)
        kwargs = {} if self.records is None else {"collate_fn": self.records.collate(self.val_dataset, self.pad_id)}
        return self._loader(sampler.dataset, shuffle=False, sampler=sampler, **kwargs)

    def _padding_marked_sampler(self, rows: Dataset) -> Optional[PaddingMarkedSampler]:
        """On several processes (with Lightning's distributed sampling on): each process's share of ``rows`` in order,
        evened out by padding indices past the end (:class:`UnscoredPadding` gives them row 0, scoring nothing);
        ``None`` on one process."""
        trainer = self.trainer
        connector = getattr(trainer, "_accelerator_connector", None)
        if trainer is None or trainer.world_size <= 1 or not getattr(connector, "use_distributed_sampler", True):
            return None
        return PaddingMarkedSampler(UnscoredPadding(rows), trainer.world_size, trainer.global_rank)

    def test_dataloader(self) -> DataLoader:
        """Same as ``val_dataloader`` (the corpus has no separate test split)."""
        return self.val_dataloader()

    def prompt_dataset(self) -> PromptDataset:
        """Prompts from ``--data.predict_prompts``, or the first ``prompt_tokens`` of the first
        ``num_predict_prompts`` held-out windows; read and tokenized once (``setup("predict")`` or first use)."""
        if self.predict_dataset is None:
            self.predict_dataset = self._read_prompts()
        return self.predict_dataset

    def _read_prompts(self) -> PromptDataset:
        tokenizer = self.load_tokenizer()
        if self.predict_prompts is not None:
            lines, prompts = zip(*read_numbered_prompts(self.predict_prompts))
            ids = [chat_prompt(tokenizer, p, self.predict_prompts, line) if isinstance(p, list)
                   else tokenizer.encode_prompt(p) for line, p in zip(lines, prompts)]
            texts = [tokenizer.decode(i, skip_special_tokens=False) if isinstance(p, list) else p
                     for i, p in zip(ids, prompts)]
            return PromptDataset(ids, texts, lines)
        if self.records is not None:
            return PromptDataset(*self.records.held_out_prompts(tokenizer, self.num_predict_prompts,
                                                                self.prompt_tokens))
        self._setup_windows()
        count = min(self.num_predict_prompts, len(self.val_dataset))
        length = min(self.prompt_tokens, self.seq_len)
        prompts = [self.val_dataset[i]["input_ids"][:length].tolist() for i in range(count)]
        return PromptDataset(prompts, [tokenizer.decode(p) for p in prompts])

    def check_prompts_fit(self, max_prompt_tokens: int, why: str) -> None:
        """Refuse a prompt longer than ``max_prompt_tokens`` tokens, naming where it comes from.

        Call it after ``setup("predict")`` (the prompts are tokenized there and not again); before, it reads them.
        ``why`` says where the limit comes from, e.g. ``"the model's context of 256 tokens
        (--model.init_args.model.max_seq_len) minus --model.init_args.generation.max_new_tokens 128"``.

        Raises:
            ValueError: naming ``--data.predict_prompts``, the file, the line (from 1) of the first prompt that is
                too long and its token count; or ``--data.prompt_tokens`` for prompts cut from held-out windows.
        """
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
            raise TypeError(f"check_prompts_fit: max_prompt_tokens must be an int, got {max_prompt_tokens!r}")
        dataset = self.prompt_dataset()
        too_long = dataset.too_long(max_prompt_tokens)
        if not too_long:
            return
        first = too_long[0]
        tokens = len(dataset.prompts[first])
        limit = f"more than the {max_prompt_tokens} token(s) a prompt may have: {why}"
        if dataset.lines is None:
            raise ValueError(
                f"--data.prompt_tokens: the held-out prompts are {tokens} tokens long (--data.prompt_tokens "
                f"{self.prompt_tokens}, --data.seq_len {self.seq_len}), {limit}; lower --data.prompt_tokens to at most "
                f"{max_prompt_tokens}, or lower --model.init_args.generation.max_new_tokens"
            )
        others = f" (the first of {len(too_long)} too long)" if len(too_long) > 1 else ""
        raise ValueError(
            f"{PROMPTS_FLAG}: the prompt on line {dataset.lines[first]} of {self.predict_prompts!r} is {tokens} tokens "
            f"long{others}, {limit}; shorten that prompt, or lower --model.init_args.generation.max_new_tokens"
        )

    def predict_dataloader(self) -> DataLoader:
        """Batches ``{"input_ids": LongTensor[B, L] right-padded with pad_id, "lengths": LongTensor[B],
        "prompt_text": list[str]}``."""
        prompts, collate = self.prompt_dataset(), PromptCollator(self.pad_id)
        sampler = self._padding_marked_sampler(prompts)  # several processes: the same number of batches on each (the
        # decoding steps and the writer's stop check are collectives); PredictionWriter drops the padding rows
        if sampler is None:
            return self._loader(prompts, shuffle=False, collate_fn=collate)
        return self._loader(sampler.dataset, shuffle=False, collate_fn=collate, sampler=sampler)
