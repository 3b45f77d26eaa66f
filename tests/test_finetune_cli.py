"""``configs/finetune.yaml`` as a user runs it: a local model folder (its own tokenizer, chat template included) and a
JSONL file of chats or texts, through ``lightning-mtp fit`` -> ``predict`` (chat prompts) -> ``export``, with the
model folder moved away after the fit: the checkpoint carries the tokenizer and rebuilds the model alone."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from conftest import REPO, cli_refusal  # noqa: E402
from model_folders import chat_records, model_folder, text_records, write_jsonl  # noqa: E402

from lightning_mtp.cli import main  # noqa: E402


def finetune_args(workdir, folder, corpus, *extra: str) -> list[str]:
    return ["fit", "--config", os.path.join(REPO, "configs", "finetune.yaml"),
            "--model.init_args.pretrained", str(folder), "--data.init_args.corpus", str(corpus),
            "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(workdir),
            "--trainer.logger", "false", "--trainer.callbacks.init_args.dirpath", str(workdir / "ckpt"),
            "--data.init_args.seq_len", "96", "--data.init_args.batch_size", "4", "--data.init_args.num_proc", "1",
            "--data.init_args.cache_dir", str(workdir / "cache"), "--model.init_args.learning_rate", "1e-3", *extra]


def predict(workdir, ckpt, prompts, *extra: str) -> list[dict]:
    out = workdir / "predictions"
    given = [] if prompts is None else ["--data.init_args.predict_prompts", str(prompts)]
    main(["predict", "--config", os.path.join(REPO, "configs", "predict.yaml"), "--ckpt_path", str(ckpt),
          *given, "--trainer.callbacks.init_args.output_dir", str(out),
          "--trainer.enable_progress_bar", "false", "--model.init_args.generation.max_new_tokens", "6", *extra])
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


def chat_prompts(path):
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Write a function f7 returning x plus 7."}]})
                    + "\n" + json.dumps({"prompt": "def g(x):"}) + "\n", encoding="utf-8")
    return path


def test_chat_finetune_then_predict_from_the_checkpoint_alone(tmp_path):
    folder = model_folder(tmp_path / "model")
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "chat.jsonl", chat_records(40))))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["tokenizer"]["kind"] == "pretrained" and checkpoint["tokenizer"]["chat_template"]
    shutil.move(str(folder), str(tmp_path / "elsewhere"))  # predict needs nothing but the checkpoint

    rows = predict(tmp_path / "run", ckpt, chat_prompts(tmp_path / "prompts.jsonl"))
    assert [row["prompt"].startswith("<|im_start|>user") for row in rows] == [True, False]
    from lightning_mtp.data import tokenizer_from_spec

    tokenizer = tokenizer_from_spec(checkpoint["tokenizer"])
    for row in rows:  # texts decoded with the checkpoint's tokenizer
        assert row["completion"] == tokenizer.decode(row["tokens"]) and len(row["tokens"]) <= 6
    stats = json.loads((tmp_path / "run" / "predictions" / "stats.json").read_text())
    assert stats["generation"]["eos_token_id"] == tokenizer.stop_ids() == [tokenizer.eos_id,
                                                                          tokenizer.end_of_turn_id]  # what was used


def test_a_sentencepiece_chat_model_stops_at_its_end_of_turn_and_completions_keep_their_space(tmp_path):
    """Llama-2 / Mistral style: ``▁``-marked words, ``<s>`` BOS, ``</s>`` EOS, ChatML's ``<|im_end|>`` ending turns.
    The end of turn was not found (the answer encoded alone starts with ``▁``, inside the chat it does not), so
    predict did not stop there; and the completion decoded alone lost its first space ("brown" + "café")."""
    from lightning_mtp.data import tokenizer_from_spec

    folder = model_folder(tmp_path / "model", vocab_size=400, sentencepiece=True)
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "chat.jsonl", chat_records(40))))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    tokenizer = tokenizer_from_spec(torch.load(ckpt, weights_only=True)["tokenizer"])
    assert tokenizer.stop_ids() == [tokenizer.eos_id, tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]
    # a text fine-tune that learns to go on with a word: its completion starts with '▁fox'
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "The quick brown fox: café naïve."}] * 64)
    main(finetune_args(tmp_path / "text", folder, texts, "--trainer.max_steps", "30",
                       "--model.init_args.learning_rate", "3e-2"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\nThe quick brown\n", encoding="utf-8")  # a blank line first: the prompt is on line 2
    rows = predict(tmp_path / "text", tmp_path / "text" / "ckpt" / "last.ckpt", prompts,
                   "--model.init_args.generation.max_new_tokens", "4")
    assert (rows[0]["index"], rows[0]["line"]) == (0, 2)
    assert tokenizer.hf.convert_ids_to_tokens(rows[0]["tokens"][0]).startswith("▁")  # a space before the word
    for row in rows:  # the completion is what the tokens add to the prompt's text (an independent decode)
        ids = tokenizer.encode_prompt(row["prompt"])
        assert tokenizer.decode(ids) + row["completion"] == tokenizer.decode(ids + row["tokens"]), row


def test_text_finetune_packs_documents_and_resumes_with_the_same_command(tmp_path):
    folder = model_folder(tmp_path / "model")
    args = finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "code.jsonl", text_records(60)))
    main(args)
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["global_step"] == 4 and checkpoint["tokenizer"]["data"]["packing"] is None

    # the README's resume: the same command and --ckpt_path (the config's `tokenizer: null` is "unset", which the
    # checkpoint's tokenizer fills, not a tokenizer that contradicts it)
    main([*args, "--trainer.max_steps", "6", "--ckpt_path", str(ckpt)])
    assert torch.load(ckpt, weights_only=True)["global_step"] == 6
    # null given as a flag (README's hf_llama command gives it: "the model folder's own") resumes too; it was refused
    # as contradicting the folder's tokenizer the checkpoint records, and the advice (leave it unset) could not help
    main([*args, "--trainer.max_steps", "7", "--ckpt_path", "last", "--data.init_args.tokenizer", "null"])
    assert torch.load(ckpt, weights_only=True)["global_step"] == 7
    # the folder's tokenizer.json names the same tokenizer as the folder the checkpoint records (it was refused)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def g(x):\n", encoding="utf-8")
    assert predict(tmp_path / "run", ckpt, prompts, "--data.init_args.tokenizer", str(folder / "tokenizer.json"))


def test_native_layers_are_fine_tuned_and_exported_with_the_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(tmp_path / "glm", family="glm4_moe", mtp_layers=1)
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "chat.jsonl", chat_records(40))))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert any(key.startswith("mtp_modules.0.") for key in state)
    shutil.move(str(folder), str(tmp_path / "elsewhere"))

    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "exported")])
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert exported.config.num_nextn_predict_layers == 1
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    assert tokenizer.chat_template and len(tokenizer) == 320


@pytest.mark.parametrize("frozen", [False, True], ids=["full", "heads-only"])
def test_a_new_fit_starts_from_a_checkpoints_weights_with_init_from(tmp_path, frozen):
    """Resuming with another learning rate is refused, pointing to ``--model.init_args.init_from``; that flag then
    starts a new fit (new schedule, step 0) from the checkpoint's weights, a frozen trunk's heads-only one too."""
    folder = model_folder(tmp_path / "model")
    corpus = write_jsonl(tmp_path / "code.jsonl", text_records(60))
    freeze = ["--model.init_args.freeze_trunk", "true"] if frozen else []
    main(finetune_args(tmp_path / "run", folder, corpus, *freeze))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    with pytest.raises(SystemExit):  # the CLI's one-line refusal, exit status 2
        main(finetune_args(tmp_path / "run", folder, corpus, *freeze, "--model.init_args.learning_rate", "1e-12",
                           "--ckpt_path", str(ckpt)))

    main(finetune_args(tmp_path / "new", folder, corpus, *freeze, "--model.init_args.learning_rate", "1e-12",
                       "--model.init_args.init_from", str(ckpt), "--trainer.max_steps", "2"))
    before = torch.load(ckpt, weights_only=True)
    after = torch.load(tmp_path / "new" / "ckpt" / "last.ckpt", weights_only=True)
    assert after["global_step"] == 2 and before["global_step"] == 4
    assert set(after["state_dict"]) == set(before["state_dict"])
    assert any(key.startswith("trunk.") for key in after["state_dict"]) is not frozen
    for key, value in before["state_dict"].items():  # a learning rate of 1e-12 moves nothing measurably
        torch.testing.assert_close(after["state_dict"][key], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("remove, named", [
    ("config.json", r"--model.init_args.pretrained\) .*transformers cannot load a causal LM from it"),
    ("model.safetensors", r"--model.init_args.pretrained\) .*transformers cannot load a causal LM from it: .*"
                          r"model.safetensors"),
    ("everything", r"--model.init_args.pretrained\) .*transformers cannot load a causal LM from it"),
    ("tokenizer.json", r"--data.tokenizer: transformers cannot load a tokenizer from .*model' \(lightning-mtp needs "
                       r"a fast one, a tokenizer.json\): it has no tokenizer.json"),
])
def test_a_model_folder_missing_a_file_is_refused_in_one_line(tmp_path, capsys, remove, named):
    folder = model_folder(tmp_path / "model")
    for path in (folder.iterdir() if remove == "everything" else [folder / remove]):
        path.unlink()
    corpus = write_jsonl(tmp_path / "code.jsonl", text_records(20))
    err = cli_refusal(finetune_args(tmp_path / "run", folder, corpus), capsys)
    [line] = [line for line in err.splitlines() if "error:" in line]  # (transformers' progress bars aside)
    assert re.search(named, line), err


def test_a_model_folder_saved_without_its_tokenizer_is_refused_not_given_a_corpus_bpe(tmp_path, capsys):
    """``model.save_pretrained`` alone writes no tokenizer: the fit trained a BPE of the corpus on embedding rows that
    mean the original tokenizer's ids, without a word. Giving the tokenizer's folder fine-tunes."""
    folder = model_folder(tmp_path / "model")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            shutil.move(folder / name, tokenizer / name)
    corpus = write_jsonl(tmp_path / "code.jsonl", text_records(20))
    err = cli_refusal(finetune_args(tmp_path / "run", folder, corpus), capsys)
    assert "holds no tokenizer" in err and "--data.init_args.tokenizer" in err, err
    main(finetune_args(tmp_path / "given", folder, corpus, "--data.init_args.tokenizer", str(tokenizer)))
    trained = torch.load(tmp_path / "given" / "ckpt" / "last.ckpt", weights_only=True)["tokenizer"]
    assert trained["kind"] != "bpe" and trained["vocab_size"] == json.loads(
        (folder / "config.json").read_text())["vocab_size"]


def test_a_heads_only_checkpoint_whose_model_folder_is_gone_says_so(tmp_path, capsys):
    folder = model_folder(tmp_path / "model")
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "code.jsonl", text_records(40)),
                       "--model.init_args.freeze_trunk", "true", "--trainer.max_steps", "2"))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    shutil.move(str(folder), str(tmp_path / "elsewhere"))
    gone = (r"holds MTP heads only \(its trunk was frozen\) and gets its trunk from the model folder .*model, which "
            r"is gone")
    assert re.search(gone, cli_refusal(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out")], capsys))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    assert re.search(gone, cli_refusal(["predict", "--ckpt_path", str(ckpt), "--data.init_args.predict_prompts",
                                        str(prompts)], capsys))

    # the folder's new place, as the message says: the same tokens as before it moved; another model is refused
    moved = ["--model", "lightning_mtp.models.HFCausalLM", "--model.init_args.pretrained"]
    shutil.move(str(tmp_path / "elsewhere"), str(folder))
    before = predict(tmp_path / "run", ckpt, prompts)
    shutil.move(str(folder), str(tmp_path / "elsewhere"))
    assert predict(tmp_path / "run", ckpt, prompts, *moved, str(tmp_path / "elsewhere")) == before
    other = model_folder(tmp_path / "other", vocab_size=320)
    torch.manual_seed(1)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(other)).apply(lambda m: [p.data.normal_() for p in m.parameters(
        recurse=False)]).save_pretrained(str(other))  # the same shapes, other weights
    err = cli_refusal(["predict", "--config", os.path.join(REPO, "configs", "predict.yaml"), "--ckpt_path",
                       str(ckpt), "--data.init_args.predict_prompts", str(prompts), *moved, str(other)], capsys)
    assert "other weights" in err


def test_predict_and_validate_from_a_checkpoint_anywhere_with_the_training_config(tmp_path, monkeypatch):
    """A fit run with relative paths: predict with a prompts file works from another folder (the model folder is
    recorded absolute; the training corpus is not needed), and validate with the training config is not refused over
    its learning rate (which does not describe the weights)."""
    model_folder(tmp_path / "work" / "model")
    write_jsonl(tmp_path / "work" / "code.jsonl", text_records(40))
    monkeypatch.chdir(tmp_path / "work")
    main(finetune_args(tmp_path / "run", "model", "code.jsonl", "--trainer.max_steps", "2"))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["pretrained"] == str(tmp_path / "work" / "model")

    main(["validate", "--config", os.path.join(REPO, "configs", "finetune.yaml"), "--ckpt_path", str(ckpt),
          "--model.init_args.learning_rate", "0.5", "--model.init_args.pretrained", str(tmp_path / "work" / "model"),
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
          "--data.init_args.num_proc", "1", "--data.init_args.cache_dir", str(tmp_path / "run" / "cache"),
          "--data.init_args.seq_len", "96"])

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rows = predict(tmp_path / "run", ckpt, chat_prompts(tmp_path / "prompts.jsonl"))
    assert len(rows) == 2 and all(row["tokens"] for row in rows)

    # validate and predict with the checkpoint alone, from another folder: the corpus is recorded absolute (it was
    # looked up in this folder: 'code.jsonl does not exist', or another file of that name silently scored)
    assert torch.load(ckpt, weights_only=True)["tokenizer"]["data"]["corpus"] == str(tmp_path / "work" / "code.jsonl")
    write_jsonl(tmp_path / "elsewhere" / "code.jsonl", chat_records(40))  # another file of that name
    main(["validate", "--ckpt_path", str(ckpt), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.limit_val_batches", "1", "--data.init_args.cache_dir", str(tmp_path / "run" / "cache")])
    rows = predict(tmp_path / "run", ckpt, None)
    assert rows and rows[0]["prompt"].startswith("def g")  # held-out text records of the training corpus


def test_init_from_onto_a_folder_that_added_tokens_trains_with_the_folders_tokenizer(tmp_path, capsys):
    """A folder whose tokenizer gained special tokens (its embedding had spare rows, as real checkpoints pad to a
    multiple of 64) fine-tuned from a checkpoint of the folder before: the new fit tokenizes with the folder's
    tokenizer, which keeps every id of the checkpoint's, and records it; a folder whose tokenizer gives other ids is
    refused, not silently given the checkpoint's."""
    from model_folders import tokenizer_folder
    from transformers import AutoTokenizer

    from lightning_mtp.data.pretrained_tokenizer import load_pretrained_tokenizer

    folder = model_folder(tmp_path / "model")  # 320 embedding rows
    tokenizer_folder(folder, 300)  # a tokenizer of 300 ids: 20 spare rows
    corpus = write_jsonl(tmp_path / "code.jsonl", [{"text": r["text"] + " <|tool|>"} for r in text_records(60)])
    main(finetune_args(tmp_path / "run", folder, corpus))
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["tokenizer"]["vocab_size"] == 300

    added = tmp_path / "added"
    shutil.copytree(folder, added)
    tokenizer = AutoTokenizer.from_pretrained(str(added))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(str(added))
    main(finetune_args(tmp_path / "new", added, corpus, "--model.init_args.init_from", str(ckpt),
                       "--trainer.max_steps", "2"))
    recorded = torch.load(tmp_path / "new" / "ckpt" / "last.ckpt", weights_only=True)["tokenizer"]
    assert recorded["fingerprint"] == load_pretrained_tokenizer(str(added)).spec()["fingerprint"]
    assert recorded["vocab_size"] == 301

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    tokenizer_folder(other, 290)  # other merges: other ids
    err = cli_refusal(finetune_args(tmp_path / "other_run", other, corpus, "--model.init_args.init_from", str(ckpt)),
                      capsys)
    assert "--model.init_args.pretrained" in err and "other ids" in err


def test_predict_stops_at_the_stop_ids_of_the_folders_generation_config(tmp_path):
    """A folder's ``generation_config.json`` may list stop ids besides the tokenizer's EOS (Llama 3.1's
    ``<|eom_id|>``): ``predict`` stops where ``transformers``' ``generate`` on the same folder stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(tmp_path / "model")
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "code.jsonl", text_records(40)),
                       "--model.init_args.freeze_trunk", "true"))  # the trunk stays the folder's: transformers' own
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n", encoding="utf-8")
    free = predict(tmp_path / "run", ckpt, prompts)[0]["tokens"]  # 6 tokens: no stop id among them
    assert len(free) == 6
    stop = free[2]
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [config.get("eos_token_id", 0), stop]
    (folder / "generation_config.json").write_text(json.dumps(config))

    row = predict(tmp_path / "run", ckpt, prompts)[0]
    reference = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = AutoTokenizer.from_pretrained(str(folder))(row["prompt"], return_tensors="pt").input_ids
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert row["tokens"] == expected == free[: free.index(stop) + 1]


def test_validate_with_the_bundled_config_the_fit_used_runs_the_checkpoints_model(tmp_path, capsys):
    """``validate --config finetune --ckpt_path CK`` of a fit that overrode the config's depth (and seq_len): the
    bundled config's values are templates, so the checkpoint's model and data settings run (the same val/loss as
    ``validate --ckpt_path CK`` alone); a flag that contradicts the checkpoint is still refused."""
    folder = model_folder(tmp_path / "model")
    main(finetune_args(tmp_path / "run", folder, write_jsonl(tmp_path / "code.jsonl", text_records(40)),
                       "--model.init_args.mtp.depth", "2", "--trainer.max_steps", "2"))
    ckpt = str(tmp_path / "run" / "ckpt" / "last.ckpt")
    common = ["--ckpt_path", ckpt, "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "1", "--data.init_args.cache_dir", str(tmp_path / "run" / "cache")]

    def val_loss(*args: str) -> str:
        capsys.readouterr()
        main(["validate", *args, *common])
        return re.search(r"val/loss\s*│\s*([0-9.]+)", capsys.readouterr().out).group(1)

    bundled = os.path.join(REPO, "configs", "finetune.yaml")
    assert val_loss("--config", bundled) == val_loss()
    err = cli_refusal(["validate", "--config", bundled, "--model.init_args.mtp.depth", "1", *common], capsys)
    assert "--model.init_args.mtp.depth" in err
