"""A chat record's ``tools`` (``trl``'s column, ``transformers``' ``apply_chat_template(messages, tools=...)``) reach
the chat template: in the training rows, in the prompts of a prompts file and in the held-out prompts, as the file holds
them (a JSON string of the list too; the null keys Arrow adds to a struct column dropped); a ``tools`` of the wrong
type, or on records or prompts no template renders, is refused naming where it is."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from model_folders import CHAT_TEMPLATE, chat_records, tokenizer_folder, write_jsonl  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from lightning_mtp.data import TextDataModule  # noqa: E402

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
"""ChatML (assistant tokens marked) that opens with a system block printing each tool whole, as JSON: every key a tool
has, a null one included, changes the ids."""


def tool(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


SEARCH = tool("search", description="Find docs.", parameters={"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer", "default": None}}})
"""A tool with an explicit null (``default``, as pydantic writes an optional argument's): the file's own, kept."""
READ = tool("read", parameters={"type": "object", "properties": {"path": {"type": "string"}}})


def tool_records(count: int, as_text: bool = False) -> list[dict]:
    """Chat records offering no tools, one tool or two, of different shapes (``as_text``: a JSON string of the list)."""
    offers = [None, [SEARCH], [READ, tool("list")], [tool("list", description="Files.")]]
    records = []
    for i, record in enumerate(chat_records(count)):
        tools = offers[i % len(offers)]
        if tools is not None:
            record["tools"] = json.dumps(tools) if as_text else tools
        records.append(record)
    return records


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"), template=TOOLS_TEMPLATE)


def datamodule(corpus, tokenizer, tmp_path, **kwargs) -> TextDataModule:
    settings = dict(seq_len=512, batch_size=4, cache_dir=str(tmp_path / "cache"), num_proc=1, val_fraction=0.2)
    settings.update(kwargs)
    return TextDataModule(corpus=str(corpus), tokenizer=str(tokenizer), **settings)


def write_parquet(path, records: list[dict]):
    """``records`` as Parquet, as pyarrow types them: tools that are lists of dicts become one struct type whose keys
    are every record's (null where a record's tool lacks one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"tools": None, **record} for record in records]), str(path))
    return path


def offered(record: dict):
    tools = record.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


@pytest.mark.parametrize("layout", ["jsonl", "parquet struct", "parquet json text"])
def test_training_rows_render_each_records_tools_as_apply_chat_template_does(tools_dir, tmp_path, layout):
    records = tool_records(20, as_text=layout == "parquet json text")
    if layout == "parquet struct":  # Arrow cannot hold the file's own null there: those records use none
        records = [{**r, "tools": [READ]} if r.get("tools") == [SEARCH] else r for r in records]
    corpus = (write_jsonl(tmp_path / "chats.jsonl", records) if layout == "jsonl"
              else write_parquet(tmp_path / "chats.parquet", records))
    dm = datamodule(corpus, tools_dir, tmp_path)
    dm.setup("fit")
    hf = AutoTokenizer.from_pretrained(str(tools_dir), local_files_only=True)
    positions = dm.records.positions[0] + dm.records.positions[1]
    rows = [*dm.records.tokenized.train, *dm.records.tokenized.val]
    assert len(rows) == len(records)
    for position, row in zip(positions, rows):
        record = records[position]
        expected = hf.apply_chat_template(record["messages"], tools=offered(record), tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
        assert list(row["input_ids"]) == list(expected["input_ids"]), (position, hf.decode(row["input_ids"]))
        assert [label != -100 for label in row["labels"]] == [bool(m) for m in expected["assistant_masks"]]
    rendered = [hf.decode(row["input_ids"]) for row in rows]
    assert any('"name": "read"' in text for text in rendered) and any("system" not in text for text in rendered)
    if layout == "jsonl":
        assert any('"default": null' in text for text in rendered)  # the file's own null reaches the template


def test_a_chat_prompt_with_tools_is_rendered_with_them(tools_dir, tmp_path):
    turns = [{"role": "user", "content": "Find the docs of glob."}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in (
        {"messages": turns, "tools": [SEARCH, READ]},
        {"messages": turns, "tools": json.dumps([READ])},  # a JSON string of the list
        {"prompt": turns, "tools": [READ]},  # trl's conversational prompt
        {"messages": turns},
        {"prompt": "def g(x):", "tools": None})), encoding="utf-8")
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tools_dir, tmp_path,
                    predict_prompts=str(prompts))
    dm.setup("predict")
    hf = AutoTokenizer.from_pretrained(str(tools_dir), local_files_only=True)

    def chat(tools):
        return list(hf.apply_chat_template(turns, tools=tools, tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"])

    assert dm.prompt_dataset().prompts == [chat([SEARCH, READ]), chat([READ]), chat([READ]), chat(None),
                                           hf("def g(x):", add_special_tokens=True)["input_ids"]]
    assert '"name": "search"' in dm.prompt_dataset().texts[0]


def test_held_out_chat_prompts_are_rendered_with_their_tools(tools_dir, tmp_path):
    records = tool_records(20)
    dm = datamodule(write_jsonl(tmp_path / "chats.jsonl", records), tools_dir, tmp_path, num_predict_prompts=4)
    dm.setup("fit")
    hf = AutoTokenizer.from_pretrained(str(tools_dir), local_files_only=True)
    held_out = [records[position] for position in dm.records.positions[1][:4]]
    expected = [list(hf.apply_chat_template(r["messages"][:1], tools=offered(r), tokenize=True, return_dict=True,
                                            add_generation_prompt=True)["input_ids"]) for r in held_out]
    assert any(offered(r) for r in held_out)
    assert dm.prompt_dataset().prompts == expected


@pytest.mark.parametrize("tools, got", [(5, "got int 5"), ("search the docs", "a string that is not JSON"),
                                        (["search"], "got list of str"), ({"type": "function"}, "got dict")])
def test_tools_of_the_wrong_type_are_refused_naming_the_record_and_field(tools_dir, tmp_path, tools, got):
    records = tool_records(12)
    records[5]["tools"] = tools
    dm = datamodule(write_jsonl(tmp_path / "chats.jsonl", records), tools_dir, tmp_path)
    with pytest.raises(ValueError, match=r"^--data.corpus: the 'tools' field of chat record 5 of the corpus .*must be "
                                         rf"a list of JSON-schema function dicts.*{got}"):
        dm.setup("fit")


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": "search"}, r"the 'tools' field of .*prompts.jsonl:2 "
                                                                            r"must be a list .*not JSON"),
    ({"prompt": "def g(x):", "tools": [READ]}, r".*prompts.jsonl:2 offers 'tools' with a text prompt.*as a chat"),
])
def test_a_prompts_files_bad_tools_are_refused_naming_the_line(tools_dir, tmp_path, line, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1"}) + "\n" + json.dumps(line) + "\n", encoding="utf-8")
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tools_dir, tmp_path,
                    predict_prompts=str(prompts))
    with pytest.raises(ValueError, match=rf"^--data.predict_prompts: {message}"):
        dm.setup("predict")


def test_text_records_offering_tools_are_refused(tools_dir, tmp_path):
    records = [{"text": f"def f{i}(x):\n    return x\n", **({"tools": [READ]} if i == 3 else {})} for i in range(12)]
    dm = datamodule(write_jsonl(tmp_path / "docs.jsonl", records), tools_dir, tmp_path)
    with pytest.raises(ValueError, match=r"^--data.corpus: 1 of 12 records have a 'tools' field, and they are not "
                                         r"chats"):
        dm.setup("fit")


def test_a_chat_prompt_ending_in_a_tool_result_is_rendered_as_transformers_renders_it(tools_dir, tmp_path):
    """OpenAI's format: the assistant turn that calls a tool has a null content; the prompt ends in the tool's result,
    and the model answers from it (the same turns a training record may hold)."""
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "glob"}}}
    turns = [{"role": "user", "content": "Find the docs of glob."},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "name": "search", "content": "glob.glob(pattern): paths matching pattern"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": turns, "tools": [SEARCH]}) + "\n", encoding="utf-8")
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tools_dir, tmp_path,
                    predict_prompts=str(prompts))
    dm.setup("predict")
    hf = AutoTokenizer.from_pretrained(str(tools_dir), local_files_only=True)
    expected = hf.apply_chat_template(turns, tools=[SEARCH], tokenize=True, return_dict=True,
                                      add_generation_prompt=True)["input_ids"]
    assert dm.prompt_dataset().prompts == [list(expected)]
    assert "paths matching pattern" in dm.prompt_dataset().texts[0]


@pytest.mark.parametrize("turn, problem", [({"role": "user", "content": None}, "has NoneType content"),
                                           ({"content": "Hi"}, "has no 'role' string")])
def test_a_prompts_files_bad_turn_is_refused_naming_the_line_and_turn(tools_dir, tmp_path, turn, problem):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1"}) + "\n" + json.dumps({"messages": [turn]}) + "\n",
                       encoding="utf-8")
    dm = datamodule(write_jsonl(tmp_path / "chat.jsonl", chat_records(20)), tools_dir, tmp_path,
                    predict_prompts=str(prompts))
    with pytest.raises(ValueError, match=rf"^--data.predict_prompts: turn 0 of .*prompts.jsonl:2 {problem}"):
        dm.setup("predict")
