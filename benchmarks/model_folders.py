"""Local ``transformers`` model folders for the tests and benchmarks (nothing comes from a hub): a byte-level BPE
trained on code, wrapped as ``PreTrainedTokenizerFast`` with a chat template that marks the assistant's tokens, and
a tiny Llama or glm4_moe saved with ``save_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with ``{% generation %}`` marks around the assistant's content and its end token."""
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same template without the marks (``train_on="assistant"`` must refuse it)."""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def chat_records(count: int = 40, start: int = 0) -> list[dict]:
    """Chat records with a learnable answer: the user names a function, the assistant writes it."""
    return [{"messages": [{"role": "user", "content": f"Write a function f{i} returning x plus {i}."},
                          {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}\n"}]}
            for i in range(start, start + count)]


def text_records(count: int = 40) -> list[dict]:
    return [{"text": f"def g{i}(x):\n    y = x * {i}\n    return y - {i % 7}\n"} for i in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def tokenizer_folder(folder: Path, vocab_size: int = 320, template: Optional[str] = CHAT_TEMPLATE,
                     texts: Optional[list[str]] = None) -> Path:
    """``folder`` with ``tokenizer.json`` / ``tokenizer_config.json`` (and the chat template) of a BPE of
    ``vocab_size`` ids trained on ``texts`` (default: two standard-library modules and the test records)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lightning_mtp.data.corpus import stdlib_root

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if texts is None:
        texts = [(stdlib_root() / name).read_text(encoding="utf-8") for name in ("glob.py", "fnmatch.py")]
        texts += [r["messages"][1]["content"] for r in chat_records(40)] + [r["text"] for r in text_records(40)]
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        chat_template=template)
    tokenizer.save_pretrained(str(folder))
    return folder


def sentencepiece_tokenizer_folder(folder: Path, vocab_size: int = 400, template: Optional[str] = CHAT_TEMPLATE
                                   ) -> Path:
    """``folder`` with a SentencePiece-style tokenizer as Llama 2 and Mistral ship it: a BPE over ``▁``-marked words
    whose decoder strips a text's leading space, ``<s>`` added in front of every text, ``</s>`` as EOS, ChatML's
    tokens added as specials (no byte fallback: the training texts hold every character the tests use)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=["▁"],
                                  show_progress=False)
    texts = [r["messages"][1]["content"] for r in chat_records(40)] + [r["text"] for r in text_records(40)]
    texts += [r["messages"][0]["content"] for r in chat_records(40)] + ["The quick brown fox: café naïve. Yes, Hi"] * 4
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", backend.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                        chat_template=template)
    tokenizer.save_pretrained(str(folder))
    return folder


def model_folder(folder: Path, family: str = "llama", vocab_size: int = 320, template: Optional[str] = CHAT_TEMPLATE,
                 mtp_layers: int = 1, sentencepiece: bool = False) -> Path:
    """A tiny ``family`` model (llama, or glm4_moe with ``mtp_layers`` native MTP layers) and its tokenizer (the
    byte-level BPE, or with ``sentencepiece`` :func:`sentencepiece_tokenizer_folder`'s), saved in ``folder`` as
    ``save_pretrained`` does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if sentencepiece:
        sentencepiece_tokenizer_folder(folder, vocab_size, template)
        special = dict(eos_token_id=2, pad_token_id=None, bos_token_id=1)  # </s>, <s>
    else:
        tokenizer_folder(folder, vocab_size, template)
        special = dict(eos_token_id=0, pad_token_id=3, bos_token_id=None)
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=False, **special)
    if family == "glm4_moe":
        settings.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, num_nextn_predict_layers=mtp_layers, head_dim=8,
                        partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings))
    model.save_pretrained(str(folder))
    return folder
