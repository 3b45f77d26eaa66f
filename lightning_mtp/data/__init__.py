"""Text data for training and evaluating multi-token prediction models.

Example (LightningCLI YAML)::

    data:
      class_path: lightning_mtp.data.TextDataModule
      init_args: {tokenizer: bpe, vocab_size: 4096, seq_len: 256, batch_size: 16}
"""

from lightning_mtp.data.corpus import (
    FileSpan,
    cap_bytes,
    find_corpus_files,
    plan_splits,
    read_texts,
    split_files,
    stdlib_root,
)
from lightning_mtp.data.datamodule import TextDataModule
from lightning_mtp.data.documents import tokenize_documents
from lightning_mtp.data.loading import EpochShuffleSampler, ResumableDataLoader, TokenWindowDataset
from lightning_mtp.data.prompts import PromptCollator, PromptDataset, read_prompts_file
from lightning_mtp.data.tokenizer_choice import build_tokenizer, tokenizer_from_spec
from lightning_mtp.data.tokenizers import BPETokenizer, ByteTokenizer, Tokenizer

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "EpochShuffleSampler",
    "FileSpan",
    "PromptCollator",
    "PromptDataset",
    "ResumableDataLoader",
    "TextDataModule",
    "TokenWindowDataset",
    "Tokenizer",
    "build_tokenizer",
    "cap_bytes",
    "find_corpus_files",
    "plan_splits",
    "read_prompts_file",
    "read_texts",
    "split_files",
    "stdlib_root",
    "tokenize_documents",
    "tokenizer_from_spec",
]
