"""Which tokenizer ``--data.tokenizer`` names, and rebuilding the one a checkpoint records.

Example::

    >>> build_tokenizer("byte").vocab_size
    258
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer

from lightning_mtp.data.pretrained_tokenizer import (
    load_pretrained_tokenizer,
    other_ids,
    pretrained_tokenizer_from_spec,
)
from lightning_mtp.data.tokenizers import (
    EOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_KINDS,
    BPETokenizer,
    ByteTokenizer,
    CorpusItem,
    PathLike,
    Tokenizer,
)

__all__ = ["TOKENIZER_KINDS", "build_tokenizer", "ids_changed", "save_for_transformers", "tokenizer_from_spec"]


def build_tokenizer(
    kind: str,
    files: Sequence[CorpusItem] = (),
    vocab_size: int = 4096,
    cache_dir: Optional[PathLike] = None,
) -> Tokenizer:
    """The tokenizer named by ``--data.tokenizer``: ``"byte"`` (``files``/``vocab_size`` unused), ``"bpe"``
    (trained on ``files``, cached under ``cache_dir``), or a local model folder / ``tokenizer.json``
    (:mod:`~lightning_mtp.data.pretrained_tokenizer`).

    Example::

        >>> build_tokenizer("byte").vocab_size
        258
        >>> build_tokenizer("wordpiece")
        Traceback (most recent call last):
        ...
        ValueError: --data.tokenizer must be 'byte', 'bpe', a local model folder or a tokenizer.json, got 'wordpiece'
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.train(files, vocab_size, cache_dir)
    if kind is not None and ("/" in kind or kind.endswith(".json") or Path(kind).exists()):
        return load_pretrained_tokenizer(kind)
    raise ValueError(f"--data.tokenizer must be 'byte', 'bpe', a local model folder or a tokenizer.json, got {kind!r}")


def tokenizer_from_spec(spec: dict) -> Tokenizer:
    """Rebuild the tokenizer that :meth:`Tokenizer.spec` described (e.g. the one a checkpoint was trained with).

    Raises:
        ValueError: when the spec is not one (unknown kind, or a BPE spec without its JSON), or the rebuilt tokenizer
            does not map text to the same ids as the described one (its fingerprint differs).
    """
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "byte":
        tokenizer: Tokenizer = ByteTokenizer()
    elif kind == "bpe" and isinstance(spec.get("json"), str):
        tokenizer = BPETokenizer(HFTokenizer.from_str(spec["json"]))
    elif kind == "pretrained" and isinstance(spec.get("json"), str):
        tokenizer = pretrained_tokenizer_from_spec(spec)
    else:
        raise ValueError(f"not a tokenizer description (kind {kind!r}); expected one written by Tokenizer.spec()")
    if spec.get("fingerprint") not in (None, tokenizer.fingerprint):
        raise ValueError(f"the rebuilt {tokenizer.name} tokenizer does not match its description (fingerprint "
                         f"{tokenizer.fingerprint[:12]} != {str(spec['fingerprint'])[:12]})")
    return tokenizer


def ids_changed(used: dict, trained: dict) -> Optional[str]:
    """How the model-folder tokenizer ``used`` maps the tokens of ``trained`` (both :meth:`Tokenizer.spec` records)
    to other ids; ``None`` when it keeps every one of them (it may add tokens: special tokens added to a folder whose
    embedding was resized for them, or another chat template). Tokenizers of other kinds always "change" ids unless
    their fingerprints are equal.

    Example::

        >>> ids_changed(build_tokenizer("byte").spec(), build_tokenizer("byte").spec()) is None
        True
    """
    if used.get("fingerprint") == trained.get("fingerprint"):
        return None
    if used.get("kind") != "pretrained" or trained.get("kind") != "pretrained":
        return f"{used.get('name')} is another tokenizer than {trained.get('name')}"
    return other_ids(tokenizer_from_spec(used), tokenizer_from_spec(trained))


def save_for_transformers(spec: dict, folder: str) -> bool:
    """Write the tokenizer a checkpoint records into ``folder`` as ``transformers`` reads it (``tokenizer.json``,
    ``tokenizer_config.json``, the chat template), beside an exported model; ``False`` for the byte tokenizer,
    which has no ``transformers`` form."""
    tokenizer = tokenizer_from_spec(spec)
    if isinstance(tokenizer, BPETokenizer):
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(spec["json"]), eos_token=EOS_TOKEN,
                                     pad_token=PAD_TOKEN)
        hf.save_pretrained(folder)
        return True
    save = getattr(tokenizer, "save", None)
    if save is None:
        return False
    save(folder)
    return True
