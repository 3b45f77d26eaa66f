"""Raw corpus files (source code, ``.txt``) as documents: read, with undecodable bytes tallied, and tokenized into
one stream of ids, each file (or held-out tail) a document."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_mtp.data.corpus import FileSpan, UndecodableTally
from lightning_mtp.data.tokenizers import Tokenizer

_TOKENIZE_CHUNK = 64
"""Files encoded per ``encode_batch`` call (bounds peak memory of the encodings)."""


def read_tallied(spans: Sequence[FileSpan], tally: UndecodableTally) -> list[str]:
    """The text of each span, its undecodable bytes (replaced) counted in ``tally``."""
    texts = []
    for span in spans:
        text, replaced = span.read_counted()
        tally.add(span.path, len(text), replaced)
        texts.append(text)
    return texts


def tokenize_documents(texts: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """Encode documents and join them as one 1-D array of ids: a model folder's tokenizer gives each document its own
    special tokens (its BOS, as records and prompts get them) and EOS last (``encode_document``); the project's own
    tokenizers (no BOS) put ``tokenizer.eos_id`` between documents.

    Example::

        >>> from lightning_mtp.data.tokenizers import ByteTokenizer
        >>> tokenize_documents(["ab", "c"], ByteTokenizer()).tolist()
        [97, 98, 256, 99]
    """
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    parts: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    encode_document = getattr(tokenizer, "encode_document", None)
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = list(texts[start : start + _TOKENIZE_CHUNK])
        if encode_document is not None:
            parts.extend(np.asarray(ids, dtype=dtype) for ids in encode_document(chunk))
            continue
        for ids in tokenizer.encode_batch(chunk):
            if parts:
                parts.append(eos)
            parts.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
