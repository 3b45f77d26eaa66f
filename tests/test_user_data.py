"""The user's own data with the model's own tokenizer: records files read with ``datasets``, chat rendered with the
tokenizer's template and masked as ``transformers`` masks it, documents packed with restarting positions, and the
refusals (missing field, empty corpus, template without generation marks, tokenizer larger than the model, hub ids).

The model folders are built here (``tests/model_folders.py``): a BPE wrapped as ``PreTrainedTokenizerFast`` with a
ChatML template that marks the assistant's tokens, saved with ``save_pretrained``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from model_folders import (  # noqa: E402
    CHAT_TEMPLATE,
    PLAIN_TEMPLATE,
    chat_records,
    model_folder,
    text_records,
    tokenizer_folder,
    write_jsonl,
)
from transformers import AutoTokenizer  # noqa: E402

from lightning_mtp.data import TextDataModule  # noqa: E402
from lightning_mtp.data.pretrained_tokenizer import load_pretrained_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


def datamodule(corpus, tokenizer, tmp_path, **kwargs) -> TextDataModule:
    settings = dict(seq_len=48, batch_size=4, cache_dir=str(tmp_path / "cache"), num_proc=1, val_fraction=0.1)
    settings.update(kwargs)
    return TextDataModule(corpus=str(corpus), tokenizer=str(tokenizer), **settings)


def all_rows(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


# ----------------------------------------------------------------------------------------------- text records
def test_text_records_are_packed_with_positions_restarting_per_document(tok_dir, tmp_path):
    records = text_records(30)
    corpus = write_jsonl(tmp_path / "code.jsonl", records)
    dm = datamodule(corpus, tok_dir, tmp_path)
    dm.setup("fit")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    train_texts = [r["text"] for r in records if r["text"] in set(dm.records.splits()[0]["text"])]
    stream = [i for text in train_texts for i in hf(text)["input_ids"] + [hf.eos_token_id]]
    rows = all_rows(dm.train_dataset)
    assert [int(i) for row in rows for i in row["input_ids"]] == stream[: len(rows) * 48]  # in order, nothing lost
    for row in rows:
        assert torch.equal(row["labels"], row["input_ids"])  # text: every token trained
    positions = torch.cat([row["position_ids"] for row in rows])  # (N,)
    starts = torch.cat([torch.tensor([0]), torch.cumsum(torch.tensor([len(hf(t)["input_ids"]) + 1
                                                                       for t in train_texts]), 0)[:-1]])
    for index in range(len(positions)):  # the position is the offset in its document, restarting at each row
        document_start = int(starts[starts <= index].max())
        assert int(positions[index]) == index - max(document_start, index - index % 48)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (4, 48)


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".txt"])
def test_parquet_csv_and_text_files_give_the_same_rows_as_jsonl(tok_dir, tmp_path, suffix):
    import datasets

    records = text_records(30)
    reference = datamodule(write_jsonl(tmp_path / "a" / "code.jsonl", records), tok_dir, tmp_path / "a")
    if suffix == ".txt":
        folder = tmp_path / "b"
        folder.mkdir()
        for i, record in enumerate(records):  # one document per file
            (folder / f"{i:03d}.txt").write_text(record["text"], encoding="utf-8")
        corpus = str(folder / "*.txt")
    else:
        corpus = tmp_path / "b" / f"code{suffix}"
        corpus.parent.mkdir()
        table = datasets.Dataset.from_list(records)
        table.to_parquet(str(corpus)) if suffix == ".parquet" else table.to_csv(str(corpus), index=False)
    other = datamodule(corpus, tok_dir, tmp_path / "b")
    reference.setup("fit")
    other.setup("fit")
    assert len(other.train_dataset) + len(other.val_dataset) >= 1
    tokens = lambda dm: sorted(int(i) for row in all_rows(dm.train_dataset) + all_rows(dm.val_dataset)  # noqa: E731
                               for i in row["input_ids"])
    if suffix != ".txt":  # same records, same split: the same tokens
        assert tokens(other) == tokens(reference)
    else:
        assert set(tokens(other)) <= set(tokens(reference)) | {other.eos_id}


# ----------------------------------------------------------------------------------------------- chat records
def test_chat_labels_equal_the_templates_assistant_mask(tok_dir, tmp_path):
    records = chat_records(30)
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", records), tok_dir, tmp_path, seq_len=128)
    dm.setup("fit")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    by_ids = {}
    for record in records:
        out = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        by_ids[tuple(out["input_ids"])] = [i if m else -100 for i, m in zip(out["input_ids"], out["assistant_masks"])]
    rows = all_rows(dm.train_dataset)
    assert rows and dm.records.packed is False  # chat: one conversation per row
    for row in rows:
        expected = by_ids[tuple(row["input_ids"].tolist())]
        assert row["labels"].tolist() == expected
        assert -100 in expected and any(label != -100 for label in expected)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert ((batch["attention_mask"] == 0) <= (batch["labels"] == -100)).all()  # padding is never trained


def test_packed_chat_restarts_positions_per_conversation(tok_dir, tmp_path):
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(30)), tok_dir, tmp_path, packing=True,
                    seq_len=128)
    dm.setup("fit")
    row = dm.train_dataset[0]
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 2 and starts[0] == 0  # several conversations in one row
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    start_token = hf.convert_tokens_to_ids("<|im_start|>")
    assert all(int(row["input_ids"][s]) == start_token for s in starts[1:])  # each restart opens a conversation


def test_train_on_all_trains_every_chat_token(tok_dir, tmp_path):
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tok_dir, tmp_path, train_on="all")
    dm.setup("fit")
    for row in all_rows(dm.train_dataset):
        assert torch.equal(row["labels"], row["input_ids"])


def test_the_tokenized_records_are_cached(tok_dir, tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "chat.jsonl", chat_records(20))
    datamodule(corpus, tok_dir, tmp_path).setup("fit")
    import lightning_mtp.data.chat_records as chat_module

    monkeypatch.setattr(chat_module.ChatEncoder, "__call__", lambda *a: pytest.fail("tokenized again"))
    dm = datamodule(corpus, tok_dir, tmp_path)
    dm.setup("fit")
    assert len(dm.train_dataset) > 0


def test_a_model_folder_with_a_long_name_tokenizes_in_several_processes(tok_dir, tmp_path):
    """``datasets`` caps a map's fingerprint at 64 characters, shard suffixes included: a tokenizer folder named like
    a real model (``Meta-Llama-3.1-8B-Instruct``) must still tokenize with ``num_proc=2``, into the same rows as one
    process gives."""
    import shutil

    folder = shutil.copytree(tok_dir, tmp_path / "models" / "Meta-Llama-3.1-8B-Instruct")
    corpus = write_jsonl(tmp_path / "chat.jsonl", chat_records(600))
    two = datamodule(corpus, folder, tmp_path, num_proc=2, cache_dir=str(tmp_path / "two"))
    two.setup("fit")
    one = datamodule(corpus, folder, tmp_path, num_proc=1, cache_dir=str(tmp_path / "one"))
    one.setup("fit")
    assert len(two.train_dataset) > 0
    assert [row["input_ids"].tolist() for row in all_rows(two.train_dataset)] == \
        [row["input_ids"].tolist() for row in all_rows(one.train_dataset)]


def prompt_completion_records(count: int, conversational: bool = False) -> list[dict]:
    """``trl``'s prompt-completion records: plain strings, or lists of turns."""
    records = []
    for record in chat_records(count):
        user, assistant = record["messages"]
        records.append({"prompt": [user], "completion": [assistant]} if conversational else
                       {"prompt": user["content"] + "\n", "completion": assistant["content"]})
    return records


@pytest.mark.parametrize("train_on", [None, "all"])
def test_prompt_completion_records_train_on_the_completion_as_trl_does(tok_dir, tmp_path, train_on):
    """(They were refused: "name the field that holds the text", and --data.text_field prompt trained prompts only.)
    The prompt's ids as a prompt is encoded, then the completion's and EOS; only those trained by default."""
    records = prompt_completion_records(30)
    dm = datamodule(write_jsonl(tmp_path / "pc.jsonl", records), tok_dir, tmp_path, train_on=train_on, seq_len=96)
    dm.setup("fit")
    assert dm.records.packed is False  # one record per row by default: a packed record's tail lost its prompt
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    expected = {}
    for record in records:
        head = hf(record["prompt"], add_special_tokens=True)["input_ids"]
        tail = hf(record["completion"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        expected[tuple(head + tail)] = ([-100] * len(head) if train_on is None else head) + tail
    rows = all_rows(dm.train_dataset)
    assert len(rows) == len(dm.records.splits()[0])
    for row in rows:
        assert row["labels"].tolist() == expected[tuple(row["input_ids"].tolist())]
    dm.setup("predict")  # held-out prompts: each record's prompt, as training saw it
    held_out = dm.records.splits()[1]
    assert dm.prompt_dataset().prompts[0] == hf(held_out[0]["prompt"], add_special_tokens=True)["input_ids"]


def test_conversational_prompt_completion_records_are_the_chats_they_join(tok_dir, tmp_path):
    joined = [{"messages": r["prompt"] + r["completion"]} for r in prompt_completion_records(30, True)]
    rows = {}
    for name, records in (("pc", prompt_completion_records(30, True)), ("chat", joined)):
        dm = datamodule(write_jsonl(tmp_path / name / "data.jsonl", records), tok_dir, tmp_path / name, seq_len=128)
        dm.setup("fit")
        rows[name] = [(r["input_ids"].tolist(), r["labels"].tolist()) for r in all_rows(dm.train_dataset)]
    assert rows["pc"] == rows["chat"] and rows["pc"]


def test_prompt_completion_records_without_a_completion_are_refused_naming_it(tok_dir, tmp_path):
    records = prompt_completion_records(20)
    del records[3]["completion"]
    dm = datamodule(write_jsonl(tmp_path / "pc.jsonl", records), tok_dir, tmp_path)
    with pytest.raises(ValueError, match=r"1 of 20 records have no 'completion' field .*the first is record 3"):
        dm.setup("fit")


def test_chat_prompts_are_rendered_with_the_generation_prompt(tok_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Write f."}]}) + "\n"
                       + json.dumps({"prompt": "def g(x):"}) + "\n"
                       + json.dumps({"prompt": [{"role": "user", "content": "Write f."}]}) + "\n",  # trl's turns
                       encoding="utf-8")
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tok_dir, tmp_path,
                    predict_prompts=str(prompts))
    dm.setup("predict")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    chat = hf.apply_chat_template([{"role": "user", "content": "Write f."}], tokenize=True, add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert dm.prompt_dataset().prompts == [list(chat), hf("def g(x):", add_special_tokens=True)["input_ids"],
                                           list(chat)]
    assert dm.prompt_dataset().lines == [1, 2, 3]


def test_the_checkpoint_record_rebuilds_the_tokenizer_without_its_folder(tok_dir, tmp_path):
    from lightning_mtp.data import tokenizer_from_spec

    record = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(10)), tok_dir, tmp_path).tokenizer_record()
    assert json.loads(json.dumps(record)) == record  # plain types: a checkpoint can carry it
    rebuilt = tokenizer_from_spec(record)
    original = load_pretrained_tokenizer(str(tok_dir))
    messages = chat_records(1)[0]["messages"]
    assert rebuilt.fingerprint == original.fingerprint
    assert rebuilt.render_chat(messages, assistant_mask=True) == original.render_chat(messages, assistant_mask=True)


# ----------------------------------------------------------------------------------------------- refusals
def test_records_without_the_field_are_refused_naming_the_fields(tok_dir, tmp_path):
    bodies = [{"body": record["text"]} for record in text_records(30)]
    dm = datamodule(write_jsonl(tmp_path / "x.jsonl", bodies), tok_dir, tmp_path)
    with pytest.raises(ValueError, match=r"neither a 'text' field \(--data.text_field\) nor a 'messages' field "
                                         r"\(--data.messages_field\), nor 'prompt' and 'completion' fields; their "
                                         r"fields are \['body'\]"):
        dm.setup("fit")
    dm = datamodule(tmp_path / "x.jsonl", tok_dir, tmp_path, text_field="body")
    dm.setup("fit")  # named: fine


def test_records_some_of_which_lack_the_field_are_refused_not_dropped(tok_dir, tmp_path):
    # a file mixing chats and documents: the documents used to vanish without a word
    mixed = write_jsonl(tmp_path / "mixed.jsonl", chat_records(12) + text_records(5))
    with pytest.raises(ValueError, match=r"^--data.corpus: 5 of 17 records have no 'messages' field "
                                         r"\(--data.messages_field\); the first is record 12 .* whose fields are "
                                         r"\['text'\]; the corpus mixes 'messages' and 'text' records"):
        datamodule(mixed, tok_dir, tmp_path).setup("fit")
    # a misspelt field in some records
    misspelt = text_records(20) + [{"content": record["text"]} for record in text_records(3)]
    with pytest.raises(ValueError, match=r"3 of 23 records have no 'text' field \(--data.text_field\); the first is "
                                         r"record 20 .* whose fields are \['content'\]: fix or remove"):
        datamodule(write_jsonl(tmp_path / "some.jsonl", misspelt), tok_dir, tmp_path).setup("fit")


def test_an_empty_csv_cell_is_an_empty_text_not_a_missing_field(tok_dir, tmp_path):
    import datasets

    corpus = tmp_path / "code.csv"  # every row has the column; an empty cell reads as null
    datasets.Dataset.from_list(text_records(30) + [{"text": None}] * 2).to_csv(str(corpus), index=False)
    dm = datamodule(corpus, tok_dir, tmp_path, val_fraction=0.05)
    with pytest.warns(UserWarning, match=r"records have no token to train on and are skipped"):
        dm.setup("fit")
    assert len(dm.train_dataset) > 0


def test_records_with_nothing_to_train_are_counted_in_a_warning(tok_dir, tmp_path):
    records = text_records(30) + [{"text": ""}] * 4
    dm = datamodule(write_jsonl(tmp_path / "x.jsonl", records), tok_dir, tmp_path, val_fraction=0.05)
    with pytest.warns(UserWarning, match=r"--data.corpus: \d of \d+ (train|val) records have no token to train on "
                                         r"and are skipped"):
        dm.setup("fit")


def test_an_empty_corpus_is_refused(tok_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"--data.corpus: .*/empty.jsonl is empty: it holds no records"):
        datamodule(empty, tok_dir, tmp_path).setup("fit")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    with pytest.raises(ValueError, match=r"--data.corpus: .*/blank.jsonl is empty: it holds no records"):
        datamodule(blank, tok_dir, tmp_path).setup("fit")
    blanks = write_jsonl(tmp_path / "blanks.jsonl", [{"text": ""}, {"text": ""}, {"text": ""}])
    with pytest.raises(ValueError, match=r"--data.corpus: no training record has a token to train on"):
        datamodule(blanks, tok_dir, tmp_path).setup("fit")


def test_a_line_that_is_not_json_is_named_with_its_number(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", text_records(10))
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[6] = lines[6][:-3]  # cut: not valid JSON
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^--data.corpus: cannot read the .jsonl files .* as records: .*x.jsonl: "
                                         r"line 7 is not valid JSON \("):
        datamodule(path, tok_dir, tmp_path).setup("fit")


def test_a_template_without_generation_marks_is_refused_for_assistant_training(tmp_path):
    folder = tokenizer_folder(tmp_path / "plain", template=PLAIN_TEMPLATE)
    corpus = write_jsonl(tmp_path / "chat.jsonl", chat_records(10))
    with pytest.raises(ValueError, match=r"--data.train_on assistant: the chat template does not mark .*"
                                         r"\{% generation %\}.*--data.train_on all"):
        datamodule(corpus, folder, tmp_path).setup("fit")
    datamodule(corpus, folder, tmp_path, train_on="all").setup("fit")


def test_chat_records_with_a_tokenizer_without_a_template_are_refused(tmp_path):
    corpus = write_jsonl(tmp_path / "chat.jsonl", chat_records(10))
    with pytest.raises(ValueError, match=r"--data.messages_field: .* has no chat template"):
        TextDataModule(corpus=str(corpus), tokenizer="byte", seq_len=48, cache_dir=str(tmp_path / "c"),
                       num_proc=1).setup("fit")


@pytest.mark.parametrize("name, reason", [("Qwen/Qwen3-0.6B", "hub id, and lightning-mtp downloads nothing"),
                                          ("no/such/folder", "is not an existing file or folder")])
def test_a_tokenizer_that_is_not_local_is_refused_before_anything_is_read(name, reason):
    with pytest.raises(ValueError, match=rf"--data.tokenizer '{name}' .*{reason}"):
        TextDataModule(tokenizer=name)


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both_sizes(tmp_path):
    import lightning as L

    from lightning_mtp import MTPConfig
    from lightning_mtp.models import HFCausalLM

    folder = model_folder(tmp_path / "model", vocab_size=320)
    small = HFCausalLM("llama", dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4), mtp=MTPConfig(depth=1))
    dm = datamodule(write_jsonl(tmp_path / "code.jsonl", text_records(20)), folder, tmp_path)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"the data's vocabulary \(\d+ tokens.*\) is larger than the model's \(300, "
                                         r"--model.init_args.config.vocab_size\)"):
        trainer.fit(small, dm)


def test_the_model_folders_tokenizer_is_the_default(tmp_path):
    import lightning as L

    from lightning_mtp import MTPConfig
    from lightning_mtp.models import HFCausalLM

    folder = model_folder(tmp_path / "model")
    model = HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=1))
    dm = TextDataModule(corpus=str(write_jsonl(tmp_path / "chat.jsonl", chat_records(12))), seq_len=64,
                        batch_size=4, cache_dir=str(tmp_path / "cache"), num_proc=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, dm)
    assert dm.tokenizer.fingerprint == load_pretrained_tokenizer(str(folder)).fingerprint
    assert model.mtp_tokenizer["kind"] == "pretrained"


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_a_local_tokenizer_for_a_model_folder_with_its_own_is_refused(tmp_path, kind):
    # hf_llama.yaml sets tokenizer: bpe; with --model.init_args.pretrained DIR its ids would have fed a model whose
    # embedding rows mean another tokenizer's (silently, when the model's vocabulary is the larger)
    import lightning as L

    from lightning_mtp import MTPConfig
    from lightning_mtp.models import HFCausalLM

    folder = model_folder(tmp_path / "model", vocab_size=4096)
    model = HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=1))
    dm = TextDataModule(corpus=str(write_jsonl(tmp_path / "code.jsonl", text_records(40))), tokenizer=kind,
                        vocab_size=300, seq_len=32, batch_size=4, cache_dir=str(tmp_path / "cache"), num_proc=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=rf"^--data.tokenizer {kind}: the model is loaded from .*model', which has "
                                         r"its own tokenizer.*leave --data.tokenizer unset"):
        trainer.fit(model, dm)


def test_another_folders_tokenizer_for_a_model_with_its_own_is_refused_unless_its_ids_agree(tmp_path):
    """A tokenizer folder whose ids differ from the model folder's would feed the embedding rows other tokens'
    ids; one with the same ids and another chat template (a base model's tokenizer given a template) is taken."""
    import lightning as L

    from lightning_mtp import MTPConfig
    from lightning_mtp.models import HFCausalLM

    folder = model_folder(tmp_path / "model", template=None)
    other = tokenizer_folder(tmp_path / "other", texts=[r["text"] for r in text_records(40)])  # other merges
    templated = tmp_path / "templated"  # the model's own tokenizer, given a chat template
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(templated))
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_TEMPLATE
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    corpus = write_jsonl(tmp_path / "code.jsonl", text_records(40))

    def fit(tokenizer):
        dm = TextDataModule(corpus=str(corpus), tokenizer=str(tokenizer), seq_len=32, batch_size=4,
                            cache_dir=str(tmp_path / "cache"), num_proc=1)
        trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=1)), dm)
        return dm

    with pytest.raises(ValueError, match=r"^--data.tokenizer .*other: the model is loaded from .*model', whose "
                                         r"embedding rows mean its own tokenizer's ids.*\d+ of the model's 320 tokens "
                                         r"differ, the first .*leave --data.tokenizer unset"):
        fit(other)
    assert fit(templated).tokenizer.hf.chat_template == PLAIN_TEMPLATE
    assert fit(folder).tokenizer.fingerprint == load_pretrained_tokenizer(str(folder)).fingerprint


def test_a_chat_templates_end_of_turn_is_a_stop_id(tok_dir, tmp_path):
    """The token a chat template ends an answer with (ChatML's ``<|im_end|>``, which the assistant mask trains) is
    where ``predict`` stops a chat answer, besides EOS; without a template there is none."""
    chatml = load_pretrained_tokenizer(str(tok_dir))
    end = chatml.hf.convert_tokens_to_ids("<|im_end|>")
    assert chatml.end_of_turn_id == end and chatml.stop_ids() == [chatml.eos_id, end]
    rendered, mask = chatml.render_chat(chat_records(1)[0]["messages"], assistant_mask=True)
    assert rendered[max(i for i, m in enumerate(mask) if m)] == end  # what training taught the model to emit last
    bare = load_pretrained_tokenizer(str(tokenizer_folder(tmp_path / "bare", template=None)))
    assert bare.end_of_turn_id is None and bare.stop_ids() == [bare.eos_id]
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(10)), tok_dir, tmp_path)
    assert dm.stop_ids == [chatml.eos_id, end]


def test_a_tokenizer_json_takes_the_special_tokens_saved_beside_it_and_alone_is_refused(tok_dir, tmp_path):
    """``--data.tokenizer DIR/tokenizer.json`` (documented) was always refused for want of an EOS, which only the
    ``tokenizer_config.json`` beside it names; a file alone is refused saying so."""
    from_file, from_folder = (load_pretrained_tokenizer(str(path)) for path in (tok_dir / "tokenizer.json", tok_dir))
    assert from_file.fingerprint == from_folder.fingerprint and from_file.eos_id == from_folder.eos_id
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="alone names no EOS token.*tokenizer_config.json"):
        load_pretrained_tokenizer(str(alone / "tokenizer.json"))


def test_a_sentencepiece_continuation_keeps_the_space_before_its_first_word(tmp_path):
    """``decode`` of new ids alone strips a SentencePiece text's leading space; a completion is decoded after its
    prompt (what ``predict`` writes) and reads as the two decoded together."""
    from model_folders import sentencepiece_tokenizer_folder

    tokenizer = load_pretrained_tokenizer(str(sentencepiece_tokenizer_folder(tmp_path / "sp")))
    prompt, new = tokenizer.encode_prompt("The quick brown"), tokenizer.encode("fox: café")  # '▁fox', ...
    assert tokenizer.decode(prompt + new) == "The quick brown fox: café"
    assert tokenizer.decode(new) == "fox: café"  # the space is gone when decoded alone
    assert tokenizer.decode_continuation(prompt, new) == " fox: café"


def test_a_sentencepiece_chat_templates_end_of_turn_is_found(tmp_path):
    """The answer encoded alone ('▁Ye', 's') differs from the rendered one after a newline ('Ye', 's'): matching
    those ids found no end of turn, so decoding did not stop at ``<|im_end|>``."""
    from model_folders import sentencepiece_tokenizer_folder

    tokenizer = load_pretrained_tokenizer(str(sentencepiece_tokenizer_folder(tmp_path / "sp")))
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.end_of_turn_id == end and tokenizer.stop_ids() == [tokenizer.eos_id, end]


def test_split_special_tokens_changes_the_fingerprint_and_travels_with_the_checkpoint_record(tok_dir, tmp_path):
    """``split_special_tokens`` (tokenizer_config.json) changes the ids of a text that holds "<|im_end|>", but the
    fingerprint (token caches) and the checkpoint's record ignored it: a stale cache was reused, and predict encoded
    prompts otherwise than training had."""
    import shutil

    from lightning_mtp.data import tokenizer_from_spec

    split = tmp_path / "split"
    shutil.copytree(tok_dir, split)
    config = json.loads((split / "tokenizer_config.json").read_text())
    (split / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    plain, splitting = load_pretrained_tokenizer(str(tok_dir)), load_pretrained_tokenizer(str(split))
    text = "x<|im_end|>y"
    assert plain.encode(text) != splitting.encode(text)  # the setting matters
    assert plain.fingerprint != splitting.fingerprint
    rebuilt = tokenizer_from_spec(splitting.spec())
    assert rebuilt.encode(text) == splitting.encode(text) and rebuilt.fingerprint == splitting.fingerprint
    assert "settings" not in plain.spec()  # records of tokenizers without it are unchanged


def bos_tokenizer_folder(folder):
    """The test tokenizer, made to add a BOS to every text it encodes with special tokens (as Llama's does)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer_folder(folder)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", backend.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|endoftext|>",
                                 pad_token="<|pad|>")
    hf.save_pretrained(str(folder))
    return folder


def test_raw_source_files_get_the_model_tokenizers_bos_as_records_do(tmp_path):
    """Each raw file is a document with the model's own special tokens (BOS first, EOS last), like a text record and
    a prompt: a tokenizer that adds a BOS gives one per document either way (raw files had none)."""
    folder = bos_tokenizer_folder(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    bos = hf.bos_token_id
    texts = [r["text"] for r in text_records(12)]
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, text in enumerate(texts):
        (raw / f"m{i:02d}.py").write_text(text, encoding="utf-8")
    dm = datamodule(raw, folder, tmp_path / "a", seq_len=16, val_fraction=0.25)
    dm.setup("fit")
    train_files, _ = dm.corpus_splits()
    ids = np.asarray(dm.train_tokens).tolist()
    expected = [i for span in train_files for i in hf(span.path.read_text(encoding="utf-8"))["input_ids"]
                + [hf.eos_token_id]]
    assert ids == expected and ids.count(bos) == len(train_files) > 0
    records = datamodule(write_jsonl(tmp_path / "code.jsonl", [{"text": t} for t in texts]), folder, tmp_path / "b")
    records.setup("fit")
    rows = all_rows(records.train_dataset) + all_rows(records.val_dataset)
    assert sum(int((row["input_ids"] == bos).sum()) for row in rows) == len(texts)


TOOL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if 'tool_calls' in message %}{% for call in message['tool_calls'] %}<call>{{ call['function']['name'] }}"
    "</call>{% endfor %}{% endif %}{% if message['content'] %}{{ message['content'] }}{% endif %}<|im_end|>"
    "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose assistant turns may call tools (``'tool_calls' in message``: a null key on other turns would crash
it at ``message['tool_calls']``)."""


def tool_chats(count: int) -> list[dict]:
    calls = [{"type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    return [{"messages": [{"role": "user", "content": f"What is f{i}?"},
                          {"role": "assistant", "content": None, "tool_calls": calls},
                          {"role": "tool", "content": f"x + {i}"},
                          {"role": "assistant", "content": f"def f{i}(x):\n    return x + {i}\n"}]}
            if i % 2 else chat_records(1, start=i)[0] for i in range(count)]


def test_assistant_turns_that_call_tools_are_rendered_as_the_template_renders_the_record(tmp_path):
    """A turn with ``tool_calls`` and no content is taken (OpenAI's format), and the keys Arrow adds to the other turns
    (null) are not passed to the template: every record's ids are what ``apply_chat_template`` makes of it."""
    folder = tokenizer_folder(tmp_path / "tok", template=TOOL_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    records = tool_chats(20)
    dm = datamodule(write_jsonl(tmp_path / "chats.jsonl", records), folder, tmp_path, seq_len=96, val_fraction=0.2)
    dm.setup("fit")
    positions = dm.records.positions[0] + dm.records.positions[1]
    rows = all_rows(dm.records.tokenized.train) + all_rows(dm.records.tokenized.val)
    for position, row in zip(positions, rows):
        expected = hf.apply_chat_template(records[position]["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert list(row["input_ids"]) == list(expected["input_ids"])
        assert [label != -100 for label in row["labels"]] == [bool(m) for m in expected["assistant_masks"]]
    assert any("<call>lookup</call>" in hf.decode(row["input_ids"]) for row in rows)


def test_a_record_the_chat_template_refuses_is_named(tmp_path):
    """A template that raises on a record (a system turn where it has no system role) names the record and the
    template's reason, instead of a bare Jinja traceback."""
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = tokenizer_folder(tmp_path / "tok", template=template + CHAT_TEMPLATE)
    records = chat_records(12)
    records[7]["messages"].insert(0, {"role": "system", "content": "Be brief."})
    dm = datamodule(write_jsonl(tmp_path / "chats.jsonl", records), folder, tmp_path)
    with pytest.raises(ValueError, match=r"^--data.messages_field: the chat template refused chat record 7 of the "
                                         r"corpus .*\['system', 'user', 'assistant'\].*System role not supported"):
        dm.setup("fit")


@pytest.mark.parametrize("turn, problem", [({"role": "assistant", "content": None}, "NoneType content"),
                                           ({"content": "hi"}, "no 'role'"),
                                           ({"role": "user", "content": ["hi"]}, "list content")])
def test_a_turn_without_a_role_or_string_content_is_refused_naming_it(tok_dir, tmp_path, turn, problem):
    records = chat_records(12)
    records[3]["messages"].append(turn)
    dm = datamodule(write_jsonl(tmp_path / "chats.jsonl", records), tok_dir, tmp_path)
    with pytest.raises(ValueError, match=rf"turn 2 of chat record 3 of the corpus .*{problem}"):
        dm.setup("fit")


def test_records_of_token_ids_are_refused_saying_what_to_give_instead(tok_dir, tmp_path):
    corpus = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 10)
    with pytest.raises(ValueError, match=r"token ids \('input_ids'\), not text.*--data.text_field.*"
                                         r"--data.messages_field.*your own DataLoader"):
        datamodule(corpus, tok_dir, tmp_path).setup("fit")


def test_a_validation_split_of_empty_records_is_refused(tok_dir, tmp_path):
    """The record held out is empty: the fit would run without validation, said only in Lightning's warnings."""
    from lightning_mtp.data.records import split_positions

    records = text_records(3)
    _, held_out = split_positions(3, 0.1, 0)
    for position in held_out:
        records[position]["text"] = ""
    dm = datamodule(write_jsonl(tmp_path / "code.jsonl", records), tok_dir, tmp_path, seed=0)
    with pytest.raises(ValueError, match=r"no validation record has a token to train on \(its 1 record\(s\) are empty.*"
                                         r"raise --data.val_fraction"):
        dm.setup("fit")


def test_a_template_whose_end_of_turn_is_outside_its_generation_marks_is_warned(tmp_path):
    """ChatML marking only the content: ``<|im_end|>`` gets no loss, so the model never learns to end an answer,
    while predict stops there; the ChatML test template marks it, and is not warned."""
    outside = CHAT_TEMPLATE.replace("{{ message['content'] }}<|im_end|>{% endgeneration %}",
                                    "{{ message['content'] }}{% endgeneration %}<|im_end|>")
    assert outside != CHAT_TEMPLATE
    folder = tokenizer_folder(tmp_path / "tok", template=outside)
    corpus = write_jsonl(tmp_path / "chats.jsonl", chat_records(12))
    with pytest.warns(UserWarning, match=r"end of turn '<\|im_end\|>' lies outside its \{% generation %\} marks"):
        datamodule(corpus, folder, tmp_path / "a").setup("fit")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        datamodule(corpus, tokenizer_folder(tmp_path / "ok"), tmp_path / "b").setup("fit")
    assert not any("end of turn" in str(w.message) for w in caught)
