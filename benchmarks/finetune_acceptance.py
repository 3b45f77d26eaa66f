"""Does acceptance survive supervised fine-tuning? Three ways to fine-tune a model with native MTP layers on chat data.

Users of MTP training stacks report that speculative acceptance drops after supervised fine-tuning (SFT) when the MTP
layers stay frozen while the trunk moves. This script measures it on a model it builds and trains itself, in one run:

1. **Base**: a glm4_moe (mixture-of-experts trunk with ``--depth`` native MTP layers, the DeepSeek-V3 / GLM-4.5
   layout) with a BPE tokenizer and a chat template, trained trunk and MTP layers together on plain text (the
   Python standard library's sources) for ``--base-steps``, and saved as a ``transformers`` folder.
2. **Chat data**: the standard library's documented functions as chats (``lightning_mtp.data.stdlib_chat``: the user
   asks for a function from its signature and docstring, the assistant answers with its source), split by source
   file into training chats and held-out prompts.
3. Three fine-tunes of the base on the training chats for ``--sft-steps`` each, assistant tokens only:
   - ``mtp_frozen``: the trunk is fine-tuned, the MTP layers are left as they were (λ = 0, frozen): what the large
     frameworks do;
   - ``joint``: trunk and MTP layers together, λ = 0.1 (``configs/finetune.yaml``'s default);
   - ``frozen_then_heads``: ``mtp_frozen``, then the MTP layers alone re-trained on the frozen fine-tuned trunk for
     ``--heads-steps``.
   The base itself is measured too (before any fine-tune).
4. For each: the main (next-token) loss on the held-out chats, the acceptance of depth 1 and τ (tokens per main-model
   forward, the bonus token counted) of greedy speculative decoding (a chain of ``--depth`` drafts) on the held-out
   prompts, and tokens/s against plain decoding of the same model, decoded one prompt at a time, alternately.

Writes ``--out`` (default ``benchmarks/results/finetune_acceptance.json``), rendered by ``benchmarks/report.py``.

Usage::

    python benchmarks/finetune_acceptance.py                  # about 15 minutes on 2 CPU cores
    python benchmarks/finetune_acceptance.py --smoke          # seconds: a tiny run of every step
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
from model_folders import CHAT_TEMPLATE, tokenizer_folder  # noqa: E402
from report import provenance  # noqa: E402

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.data import TextDataModule  # noqa: E402
from lightning_mtp.data.corpus import find_corpus_files, read_texts  # noqa: E402
from lightning_mtp.data.stdlib_chat import stdlib_chat_records  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402

GLM = dict(hidden_size=128, intermediate_size=352, moe_intermediate_size=128, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=16,
           max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None)
"""The base model's shape (``model_type`` glm4_moe, every layer dense: ``first_k_dense_replace`` past the MTP
layers, for speed on CPU); vocabulary and special ids come from the tokenizer."""


def held_out(record: dict, fraction: float) -> bool:
    """Whether a chat's source file is held out (a stable hash: a module's functions stay on one side)."""
    return zlib.crc32(record["source_file"].encode()) % 1000 < fraction * 1000


def write_chats(folder: Path, args: argparse.Namespace) -> tuple[Path, list[list[dict]]]:
    """Training chats as JSONL, and the held-out chats' user turns as prompts."""
    train, prompts = [], []
    for record in stdlib_chat_records(max_source_lines=args.max_source_lines):
        if sum(len(turn["content"]) for turn in record["messages"]) > args.max_chat_chars:
            continue  # one row holds the whole chat
        if held_out(record, 0.1):
            if len(prompts) < args.prompts:
                prompts.append(record["messages"][:1])
        elif len(train) < args.chats:
            train.append({"messages": record["messages"]})
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in train), encoding="utf-8")
    return path, prompts


def fit(model: HFCausalLM, data: TextDataModule, steps: int) -> dict:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=1.0)
    start = time.perf_counter()
    trainer.fit(model, data)
    return {"steps": trainer.global_step, "seconds": round(time.perf_counter() - start, 1)}


def chat_data(corpus: Path, tokenizer: Path, args: argparse.Namespace, cache: Path) -> TextDataModule:
    return TextDataModule(corpus=str(corpus), tokenizer=str(tokenizer), seq_len=args.seq_len, batch_size=args.batch,
                          val_fraction=0.05, cache_dir=str(cache), num_proc=1)


def model_from(folder: Path, args: argparse.Namespace, **kwargs: Any) -> HFCausalLM:
    mtp = MTPConfig(depth=args.depth, loss_weight=kwargs.pop("loss_weight", 0.1))
    model = HFCausalLM(pretrained=str(folder), mtp=mtp, learning_rate=kwargs.pop("learning_rate", args.sft_lr),
                       weight_decay=0.0, warmup_steps=10, attn_implementation="sdpa", **kwargs)
    model.configure_model()
    return model


@torch.no_grad()
def held_out_loss(model: HFCausalLM, data: TextDataModule) -> float:
    """The main head's mean cross-entropy over the held-out chats' assistant tokens."""
    model.eval()
    data.setup("validate")
    total, count = 0.0, 0
    for batch in data.val_dataloader():
        labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
        out = model.compute_lm_loss(batch["input_ids"], labels)
        tokens = int((labels[:, 1:] != -100).sum())
        total, count = total + float(out.main_loss) * tokens, count + tokens
    return total / max(count, 1)


@torch.no_grad()
def decode(model: HFCausalLM, prompts: list[torch.Tensor], args: argparse.Namespace) -> dict:
    """Greedy plain vs speculative decoding (a chain of D drafts) of each prompt alone, alternately."""
    model.eval()
    times: dict[str, list[float]] = {"plain": [], "speculative": []}
    drafted = accepted = forwards = emitted = 0
    same = True
    for _ in range(args.repeats):
        for ids in prompts:
            outs = {}
            for mode in ("plain", "speculative"):
                start = time.perf_counter()
                outs[mode] = model.generate(ids, args.max_new_tokens, speculative=mode == "speculative")
                times[mode].append(time.perf_counter() - start)
            same &= torch.equal(outs["plain"].sequences, outs["speculative"].sequences)
            stats = outs["speculative"].stats
            drafted += stats.drafted_per_depth[0]
            accepted += stats.accepted_per_depth[0]
            forwards += stats.main_forwards
            emitted += sum(stats.new_tokens)
    plain, spec = sum(times["plain"]), sum(times["speculative"])
    return {"accept_depth1": accepted / max(drafted, 1), "tau": emitted / max(forwards, 1),
            "speedup": plain / spec, "equals_plain": bool(same)}


def prompt_ids(tokenizer: Any, prompts: list[list[dict]]) -> list[torch.Tensor]:
    return [torch.tensor([tokenizer.render_chat(turns, generation_prompt=True)[0]]) for turns in prompts]


def run(args: argparse.Namespace, work: Path, argv: Optional[list[str]] = None) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    code = read_texts(find_corpus_files(None)[: args.base_files])
    tokenizer_dir = tokenizer_folder(work / "tokenizer", vocab_size=args.vocab, template=CHAT_TEMPLATE, texts=code)
    corpus, prompts = write_chats(work, args)

    # 1. The base: trunk and native MTP layers trained together on plain text.
    text = work / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in code), encoding="utf-8")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = AutoConfig.for_model("glm4_moe", vocab_size=len(hf_tok), eos_token_id=hf_tok.eos_token_id,
                                  pad_token_id=hf_tok.pad_token_id, num_nextn_predict_layers=args.depth, **GLM)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(work / "init"))
    hf_tok.save_pretrained(str(work / "init"))
    base_model = model_from(work / "init", args, learning_rate=args.base_lr, loss_weight=0.3)
    base_data = TextDataModule(corpus=str(text), tokenizer=str(tokenizer_dir), seq_len=args.base_seq_len,
                               batch_size=args.batch, val_fraction=0.05, cache_dir=str(work / "cache"), num_proc=1)
    base_training = fit(base_model, base_data, args.base_steps)
    base_model.save_pretrained(str(work / "base"))
    hf_tok.save_pretrained(str(work / "base"))

    data = chat_data(corpus, tokenizer_dir, args, work / "cache")
    data.setup("fit")
    ids = prompt_ids(data.tokenizer, prompts)
    rows: dict[str, dict] = {}

    def measure(name: str, model: HFCausalLM, training: dict) -> None:
        rows[name] = {"held_out_main_loss": held_out_loss(model, data), **decode(model, ids, args),
                      "training": training}
        print(name, {k: v for k, v in rows[name].items() if k != "training"}, flush=True)

    measure("base", model_from(work / "base", args), base_training)

    # 2. MTP frozen: the trunk moves, the MTP layers keep the base's weights.
    frozen = model_from(work / "base", args, loss_weight=0.0)
    for parameter in frozen.mtp_modules.parameters():
        parameter.requires_grad_(False)
    training = fit(frozen, data, args.sft_steps)
    measure("mtp_frozen", frozen, training)
    frozen.save_pretrained(str(work / "frozen"))
    hf_tok.save_pretrained(str(work / "frozen"))

    # 3. Joint: trunk and MTP layers together, lambda 0.1.
    joint = model_from(work / "base", args, loss_weight=0.1)
    measure("joint", joint, fit(joint, data, args.sft_steps))

    # 4. The frozen fine-tune's MTP layers re-trained alone on its trunk.
    heads = model_from(work / "frozen", args, freeze_trunk=True, learning_rate=args.heads_lr)
    measure("frozen_then_heads", heads, fit(heads, data, args.heads_steps))

    return {"rows": rows, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "prompts": len(ids), "chats": sum(1 for _ in corpus.open()), **provenance(__file__, argv)}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=2, help="native MTP layers")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--base-files", type=int, default=300, help="standard-library files the base trains on")
    parser.add_argument("--base-steps", type=int, default=500)
    parser.add_argument("--base-seq-len", type=int, default=256)
    parser.add_argument("--base-lr", type=float, default=3e-3)
    parser.add_argument("--chats", type=int, default=3000)
    parser.add_argument("--max-source-lines", type=int, default=25)
    parser.add_argument("--max-chat-chars", type=int, default=800, help="longer chats are left out (one row each)")
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--heads-steps", type=int, default=150)
    parser.add_argument("--heads-lr", type=float, default=2e-3)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny run of every step (seconds)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "finetune_acceptance.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.vocab, args.base_files, args.base_steps, args.chats, args.sft_steps, args.heads_steps = (
            320, 4, 3, 60, 2, 2)
        args.max_chat_chars = 300
        args.seq_len, args.batch, args.prompts, args.max_new_tokens, args.repeats = 320, 2, 2, 6, 1
        args.base_seq_len = 96
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as scratch:
        result = run(args, Path(scratch), argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
