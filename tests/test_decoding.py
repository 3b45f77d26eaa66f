"""Speculative decoding: lossless greedy output, drafter caches, ragged batches, EOS, stats, bad input, predict.

The models here are tiny and hand-set so that drafts are *sometimes* right (an untrained model's drafts are almost
never accepted, which would make the equality tests vacuous): the cascaded modules are copies of the one trunk block
reading the next token's embedding, so they predict what the trunk would predict with a slightly shorter context.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mtp import MTPConfig
from lightning_mtp.decoding import GenerationConfig, MTPDrafter, PredictionWriter, decode, predict_batch
from lightning_mtp.decoding.host import decoding_host
from lightning_mtp.decoding.speculative import prepare_prompts
from lightning_mtp.models import CausalLM, ModelConfig

VOCAB = 16
DIM = 32


def draftable_model(architecture: str = "cascaded", seed: int = 0, depth: int = 3) -> CausalLM:
    """1-layer model with decisive logits whose MTP modules agree with it part of the time."""
    torch.manual_seed(seed)
    model = CausalLM(
        ModelConfig(vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=4, max_seq_len=96, tie_embeddings=False),
        MTPConfig(depth=depth, architecture=architecture),
    )
    model.configure_model()
    with torch.no_grad():
        for name, param in model.layers.named_parameters():
            if name.startswith("0.attn."):
                param.mul_(16.0)  # strong attention: the next token depends on the context, not only the last token
        model.lm_head.weight.mul_(3.0 / 0.02 / DIM**0.5)
        embed = model.embed.weight
        embed.normal_().div_(embed.pow(2).mean(-1, keepdim=True).sqrt())  # RMS 1: enorm(Emb) == Emb
        for module in model.mtp_modules:
            module.block.load_state_dict(model.layers[0].state_dict())
            if architecture == "cascaded":
                eh = torch.zeros_like(module.eh_proj.weight)
                eh[:, :DIM] = torch.eye(DIM)  # h_k = Block(Emb(t(i+k))): the trunk one token later
                module.eh_proj.weight.copy_(eh)
            else:
                module.block.mlp.down.weight.mul_(0.3)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {arch: draftable_model(arch) for arch in ("cascaded", "parallel")}


def ragged_prompts(seed: int = 1, lengths=(6, 3, 9)):
    """Right-padded prompts (B, L) with an attention mask; row 1 is left-padded to exercise both layouts."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row == 1:
            mask[row, width - n :] = 1
        else:
            mask[row, :n] = 1
    prompts = [input_ids[row][mask[row].bool()] for row in range(len(lengths))]
    return input_ids, mask, prompts


def alone(model, prompt, max_new_tokens, **kwargs):
    """New tokens of decoding one prompt by itself, plainly."""
    out = model.generate(prompt.unsqueeze(0), max_new_tokens, speculative=False, **kwargs)
    return out.new_tokens[0, : out.num_new_tokens[0]].tolist()


def rows_of(out):
    return [out.new_tokens[b, : out.num_new_tokens[b]].tolist() for b in range(out.new_tokens.shape[0])]


# ----------------------------------------------------------------------------------------------- lossless greedy
@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("draft_tokens", [1, 2, 3])
def test_speculative_greedy_equals_plain_greedy(models, architecture, draft_tokens):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts()
    expected = [alone(model, p, 40) for p in prompts]

    single = model.generate(prompts[0].unsqueeze(0), 40, draft_tokens=draft_tokens, speculative=True)
    assert rows_of(single) == expected[:1]
    batched = model.generate(input_ids, 40, draft_tokens=draft_tokens, attention_mask=mask, speculative=True)
    assert rows_of(batched) == expected
    plain_batched = model.generate(input_ids, 40, speculative=False, attention_mask=mask)
    assert rows_of(plain_batched) == expected

    # the test means something: rows accepted different numbers of drafts
    histogram = batched.stats.accepted_length_histogram
    assert sum(1 for count in histogram if count) >= 2, histogram
    if draft_tokens == 3:
        assert batched.stats.tau > 1.1


def test_compiled_decoding_keeps_greedy_output(models):
    """``compile=True``: same tokens as eager plain greedy on a ragged batch, for the fused compiled step (fixed draft
    length), the per-module compiled path (adaptive draft length) and plain decoding; checkpoints stay free of
    compiled wrappers."""
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    expected = [alone(model, p, 24) for p in prompts]
    speculative = model.generate(input_ids, 24, draft_tokens=2, attention_mask=mask, compile=True)
    assert rows_of(speculative) == expected
    assert speculative.stats.tau > 1.0
    assert sum(speculative.stats.accepted_per_depth) > 0  # the fused step records acceptance too
    adaptive = model.generate(input_ids, 24, adaptive_draft_tokens=True, attention_mask=mask, compile=True)
    assert rows_of(adaptive) == expected
    plain = model.generate(input_ids, 24, speculative=False, attention_mask=mask, compile=True)
    assert rows_of(plain) == expected
    assert not any("_orig_mod" in key for key in model.state_dict())
    copy.deepcopy(model)  # nothing compiled is attached to the module


@pytest.mark.parametrize("speculative", [False, True, "auto"])
def test_several_stop_ids_stop_a_row_at_the_first_of_them(models, speculative):
    """``eos_token_id`` as a list (EOS and a chat template's end of turn): each row stops right after the first of
    them it emits, whichever it is, and equals plain decoding without stop ids cut there."""
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    free = [alone(model, p, 30) for p in prompts]
    stops = [free[0][6], free[2][3]]  # tokens rows 0 and 2 emit part-way

    def cut(tokens):
        first = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
        return tokens[: first + 1]

    out = model.generate(input_ids, 30, attention_mask=mask, eos_token_id=stops, speculative=speculative)
    assert rows_of(out) == [cut(tokens) for tokens in free]
    assert speculative is not True or out.stats.tau > 1.1  # drafts accepted: a stop id can come in a drafted run
    assert any(len(cut(tokens)) < 30 for tokens in free)
    with pytest.raises(ValueError, match=r"eos_token_id .*a list of them"):
        model.generate(input_ids, 4, attention_mask=mask, eos_token_id=[])


def test_predict_stops_at_the_datamodules_stop_ids(models):
    """``predict_step`` defaults ``eos_token_id`` to the datamodule's ``stop_ids`` (EOS and a chat template's end of
    turn): a chat model's answer ends at its end-of-turn token instead of running on to ``max_new_tokens``."""
    from types import SimpleNamespace

    model = copy.deepcopy(models["cascaded"])
    prompt = ragged_prompts()[2][0]
    free = alone(model, prompt, 20)
    eos, turn = VOCAB - 1, free[4]  # EOS never emitted; the end of turn five tokens in
    model._trainer = SimpleNamespace(datamodule=SimpleNamespace(eos_id=eos, pad_id=0, stop_ids=[eos, turn],
                                                                tokenizer=None))
    try:
        out = predict_batch(model, prompt.unsqueeze(0), max_new_tokens=20)
    finally:
        model._trainer = None
    assert out["tokens"] == [free[: free.index(turn) + 1]]


def test_sequences_keep_the_input_layout_then_the_new_tokens(models):
    """``sequences`` is ``input_ids`` as given (row 1 left-padded, the others right-padded), then the new tokens;
    a row stopped by EOS is padded with ``pad_token_id`` after it."""
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    eos = alone(model, prompts[0], 12)[0]  # row 0 stops at once; the others never emit it
    out = model.generate(input_ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=VOCAB - 1)
    width = input_ids.shape[1]
    assert out.sequences.shape == (3, width + out.new_tokens.shape[1])
    assert torch.equal(out.sequences[:, :width], input_ids)
    assert torch.equal(out.sequences[:, width:], out.new_tokens)
    for row, prompt in enumerate(prompts):
        count = int(out.num_new_tokens[row])
        assert out.new_tokens[row, :count].tolist() == alone(model, prompt, 12, eos_token_id=eos)
        assert (out.new_tokens[row, count:] == VOCAB - 1).all()
    assert out.num_new_tokens[0] == 1 and out.new_tokens.shape[1] == 12  # row 0 holds padding
    assert out.prompt_lengths.tolist() == [len(p) for p in prompts]
    out.sequences.float().requires_grad_()  # plain tensors, not inference tensors


def test_sequences_equal_transformers_generate_left_padded():
    """A ``transformers`` Llama wrapped by ``HFCausalLM``: ``sequences`` equals ``transformers``' own ``generate``
    token for token, left padding and the ``pad_token_id`` after EOS-stopped rows included."""
    transformers = pytest.importorskip("transformers")
    from lightning_mtp.models import HFCausalLM

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    llama = transformers.LlamaForCausalLM(config).eval()
    model = HFCausalLM.from_model(llama, mtp=MTPConfig(depth=2))
    model.configure_model()
    model.eval()
    pad, width, new = 5, 7, 12
    lengths = torch.tensor([7, 3, 5, 6])
    mask = (torch.arange(width) >= width - lengths.unsqueeze(1)).long()  # (B, W) left padding
    input_ids = torch.randint(6, 64, (4, width), generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, pad)

    def reference(eos):
        return llama.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                              pad_token_id=pad, eos_token_id=eos)

    eos = int(reference(None)[1, width + 2])  # row 1 emits it third
    expected = reference(eos)
    assert (expected[:, -1] == pad).sum() >= 1 and (expected[:, -1] != pad).sum() >= 1  # some rows stopped early
    for speculative in (True, False):
        out = model.generate(input_ids, new, attention_mask=mask, eos_token_id=eos, pad_token_id=pad,
                             speculative=speculative)
        assert torch.equal(out.sequences, expected), speculative


@pytest.mark.parametrize("padding", ["left", "right"])
def test_sequences_decode_to_prompt_then_completion(make_tiny_model, padding):
    """``tokenizer.decode(row, skip_special_tokens=True)`` of ``sequences`` is the prompt text + the completion text;
    the default padding is the pad id of the tokenizer the module was trained with."""
    from lightning_mtp.data import ByteTokenizer

    tokenizer = ByteTokenizer()  # eos 256, pad 257
    model = make_tiny_model(depth=2, vocab_size=tokenizer.vocab_size).eval()
    model.bind_mtp_tokenizer(tokenizer.spec())
    with torch.no_grad():  # after an "o" the model emits EOS: that row stops at once, the others run on
        model.lm_head.weight[tokenizer.eos_id] = 2 * model.lm_head.weight[ord("o")]
    texts = ["def f(x):", "héllo", "import os\nx = 1"]
    encoded = [tokenizer.encode(text) for text in texts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(texts), width), tokenizer.pad_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for row, ids in enumerate(encoded):
        columns = slice(width - len(ids), width) if padding == "left" else slice(0, len(ids))
        input_ids[row, columns] = torch.tensor(ids)
        mask[row, columns] = 1
    out = model.generate(input_ids, 10, attention_mask=mask, eos_token_id=tokenizer.eos_id)
    assert out.num_new_tokens.tolist() == [10, 1, 10] and out.new_tokens[1, 0] == tokenizer.eos_id
    assert out.sequences[1, width + 1 :].eq(tokenizer.pad_id).all()
    assert torch.equal(out.sequences[:, :width], input_ids)
    for row, text in enumerate(texts):
        completion = tokenizer.decode(out.new_tokens[row, : out.num_new_tokens[row]].tolist())
        assert tokenizer.decode(out.sequences[row].tolist(), skip_special_tokens=True) == text + completion


# ----------------------------------------------------------------------------------------------- drafter caches
class RecordingDrafter(MTPDrafter):
    """Records the sequence buffer and each row's newest position right after every draft."""

    def __init__(self, module, max_depth=None):
        super().__init__(module, max_depth)
        self.records = []

    def draft(self, state, tokens, newest, num_drafts, params, generator=None, confidence_threshold=None):
        drafts = super().draft(state, tokens, newest, num_drafts, params, generator, confidence_threshold)
        self.records.append((tokens.clone(), newest.clone(), drafts.tokens.clone()))
        return drafts


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("policy", [{}, {"draft_confidence_threshold": 0.5}, {"adaptive_draft_tokens": True}])
def test_drafts_equal_teacher_forced_mtp_predictions(models, architecture, policy):
    """Each draft d_k is the argmax of depth k of ``mtp_forward`` over [committed tokens, d_1..d_(k-1)] at n - 1.

    Wrong drafts are merely rejected, so greedy equality cannot catch cache or offset bugs of the drafter; this does.
    """
    model = models[architecture]
    D = model.mtp_config.depth
    input_ids, mask, _ = ragged_prompts(seed=3, lengths=(7, 4))
    host = decoding_host(model)
    drafter = RecordingDrafter(model)
    prompts, lengths = prepare_prompts(input_ids, mask, VOCAB, torch.device("cpu"))
    decode(host, drafter, prompts, lengths, GenerationConfig(max_new_tokens=30, **policy))
    assert len(drafter.records) > 5
    head = model.mtp_output_head()
    checked = 0
    for tokens, newest, drafts in drafter.records:
        for row in range(tokens.shape[0]):
            n = int(newest[row])
            sequence = tokens[row, : n + D + 1].unsqueeze(0)  # committed tokens, then this step's drafts
            with torch.no_grad():
                forward = model.mtp_forward(model(sequence), sequence)
            for k in range(1, drafts.shape[1] + 1):
                if drafts[row, k - 1] < 0:  # withdrawn (dynamic draft length)
                    continue
                logits = head(forward.depth_hidden[k - 1][0, n - 1])  # depth k at position n - 1
                assert int(logits.argmax()) == int(drafts[row, k - 1]), (row, n, k)
                checked += 1
    assert checked > 20


def test_a_chain_of_d_plus_1_re_applies_the_last_module(models):
    """The chain drafter's depth D + 1 (cascaded modules: the last module re-applied on its own output, with a
    cache of its own) drafts what the uncached reference does at every depth, and its decoding equals plain greedy
    decoding with drafts of depth D + 1 accepted. Parallel heads, which predict fixed offsets, refuse it."""
    from test_tree_decoding import reference_children

    model = models["cascaded"]
    D = model.mtp_config.depth
    input_ids, mask, rows = ragged_prompts(seed=3, lengths=(7, 4))
    drafter = RecordingDrafter(model, max_depth=D + 1)
    prompts, lengths = prepare_prompts(input_ids, mask, VOCAB, torch.device("cpu"))
    out = decode(decoding_host(model), drafter, prompts, lengths, GenerationConfig(max_new_tokens=30))
    assert rows_of(out) == [alone(model, p, 30) for p in rows]
    assert len(out.stats.accepted_per_depth) == D + 1 and out.stats.accepted_per_depth[D] > 0
    checked = 0
    for tokens, newest, drafts in drafter.records:
        for row in range(tokens.shape[0]):
            n = int(newest[row])
            for k in range(1, D + 2):  # d_k after the committed tokens and d_1..d_(k-1)
                assert reference_children(model, tokens[row, : n + k], n, k, 1) == [int(drafts[row, k - 1])]
                checked += 1
    assert checked == len(drafter.records) * 2 * (D + 1) and len(drafter.records) > 5
    with pytest.raises(ValueError, match="at most D = "):
        MTPDrafter(models["parallel"], max_depth=D + 1)


# ----------------------------------------------------------------------------------------------- batches and EOS
@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_each_row_stops_at_its_own_eos(models, architecture):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts()
    eos = alone(model, prompts[0], 40)[6]  # row 0 emits it early; other rows may never
    expected = [alone(model, p, 40, eos_token_id=eos) for p in prompts]
    assert expected[0][-1] == eos and len(expected[0]) <= 7
    assert any(len(e) > len(expected[0]) for e in expected[1:])
    out = model.generate(input_ids, 40, attention_mask=mask, eos_token_id=eos)
    assert rows_of(out) == expected
    assert out.new_tokens.shape[1] == max(len(e) for e in expected)
    assert (out.new_tokens[0, len(expected[0]) :] == eos).all()  # no pad_token_id nor tokenizer: EOS pads


def test_budget_shorter_than_a_step(models):
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    for budget in (1, 2, 3):
        out = model.generate(input_ids, budget, attention_mask=mask)
        assert rows_of(out) == [alone(model, p, budget) for p in prompts]
        assert out.num_new_tokens.tolist() == [budget] * 3


# ----------------------------------------------------------------------------------------------- dynamic drafts
@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize(
    "policy", [{"draft_confidence_threshold": 0.5}, {"adaptive_draft_tokens": True, "adaptive_min_reach": 0.6}]
)
def test_dynamic_draft_length_keeps_greedy_output(models, architecture, policy):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts()
    fixed = model.generate(input_ids, 40, attention_mask=mask, speculative=True)
    dynamic = model.generate(input_ids, 40, attention_mask=mask, **policy)
    assert rows_of(dynamic) == [alone(model, p, 40) for p in prompts]
    # it did draft less than the full depth at some steps
    assert sum(dynamic.stats.drafted_per_depth) < sum(fixed.stats.drafted_per_depth)


# ----------------------------------------------------------------------------------------------- stats
def test_stats_count_forwards_and_the_bonus_token(models):
    model = models["cascaded"]
    prompt = ragged_prompts()[2][0].unsqueeze(0)
    plain = model.generate(prompt, 20, speculative=False).stats
    assert plain.main_forwards == 20 and plain.tau == 1.0 and plain.max_drafts == 0
    spec = model.generate(prompt, 20, speculative=True).stats
    hist = spec.accepted_length_histogram
    assert len(hist) == 4 and sum(hist) == spec.main_forwards - 1  # one verify per step after the prefill
    # every step emits its accepted drafts plus one token, except a step cut by the budget
    emitted = 1 + sum(a * c for a, c in enumerate(hist)) + sum(hist)
    assert emitted >= 20 and spec.total_new_tokens == 20
    assert spec.tau == pytest.approx(20 / spec.main_forwards)
    assert spec.accepted_per_depth == [sum(hist[k:]) for k in range(1, 4)]
    assert spec.drafted_per_depth == [sum(hist)] * 3
    assert 0 <= min(spec.acceptance_per_depth) and max(spec.acceptance_per_depth) <= 1
    assert spec.tokens_per_s > 0 and spec.elapsed_s > 0
    summary = spec.to_dict()
    assert summary["tau"] == spec.tau and json.dumps(summary)


# ----------------------------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_and_top_k_1_is_greedy(models):
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    runs = [
        model.generate(input_ids, 20, attention_mask=mask, temperature=1.0, generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].new_tokens, runs[1].new_tokens)
    greedy = [alone(model, p, 20) for p in prompts]
    for speculative in (False, True):
        out = model.generate(input_ids, 20, attention_mask=mask, temperature=0.7, top_k=1, speculative=speculative)
        assert rows_of(out) == greedy


def test_typical_acceptance_is_opt_in(models):
    assert GenerationConfig().acceptance == "exact"
    model = models["cascaded"]
    input_ids, mask, _ = ragged_prompts()
    out = model.generate(input_ids, 20, attention_mask=mask, temperature=1.0, acceptance="typical",
                         generator=torch.Generator().manual_seed(0))
    assert out.num_new_tokens.tolist() == [20] * 3
    assert out.new_tokens.min() >= 0 and out.new_tokens.max() < VOCAB
    assert out.stats.tau > 1


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.zeros(1, 0, dtype=torch.long), 4), {}, "input_ids: empty prompt"),
        ((torch.ones(2, 3, dtype=torch.long), 4), {"attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])},
         r"attention_mask: empty prompt in row\(s\) \[1\]"),
        ((torch.ones(1, 3, dtype=torch.long), 0), {}, "max_new_tokens"),
        ((torch.ones(1, 3, dtype=torch.long), -2), {}, "max_new_tokens"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"temperature": -0.5}, "temperature"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"temperature": float("nan")}, "temperature"),
        ((torch.tensor([[1, VOCAB]]), 4), {}, r"input_ids: token ids must lie in \[0, 16\)"),
        ((torch.tensor([[1, -3]]), 4), {}, "input_ids: token ids"),
        ((torch.ones(1, 90, dtype=torch.long), 7), {}, "max_new_tokens: prompt .* exceeds the model's context of 96"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"draft_tokens": 17},
         r"draft_tokens .* must be an integer in \[1, 16\]"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"draft_tokens": 0}, "draft_tokens"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"top_p": 1.5}, "top_p"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"top_k": 0}, "top_k"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"pad_token_id": -1},
         r"pad_token_id \(GenerationConfig.pad_token_id, --model.generation.pad_token_id\) must be a token id >= 0"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"acceptance": "typical"}, "acceptance"),
        ((torch.ones(3, dtype=torch.long), 4), {}, r"input_ids must be a \(batch, length\) tensor"),
        ((torch.ones(1, 3), 4), {}, "input_ids must hold integer token ids"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"speculative": True, "draft_tree": [VOCAB + 1]},
         rf"draft_tree: {VOCAB + 1} candidates per node, more than the {VOCAB} token ids"),  # was a torch error
        ((torch.ones(1, 3, dtype=torch.long), 4), {"attention_mask": [[1, 1, 1]]},
         r"attention_mask must be a tensor of input_ids' shape \(1, 3\), got list"),
        ((torch.ones(1, 3, dtype=torch.long), 4), {"attention_mask": torch.ones(1, 4)},
         r"attention_mask must be a tensor of input_ids' shape \(1, 3\), got \(1, 4\)"),
    ],
)
def test_bad_input_raises_a_clear_error(models, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        models["cascaded"].generate(*args, **kwargs)


def test_prompt_padding_outside_the_vocabulary_is_ignored(models):
    model = models["cascaded"]
    input_ids = torch.tensor([[3, 4, 5], [7, -1, -1]])  # -1 padding, masked out
    out = model.generate(input_ids, 5, attention_mask=input_ids >= 0)
    assert rows_of(out)[1] == alone(model, torch.tensor([7]), 5)
    assert torch.equal(out.sequences[:, :3], input_ids)  # the prompt columns are input_ids as given


# ----------------------------------------------------------------------------------------------- predict
class PromptData(L.LightningDataModule):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches
        self.eos_id = None

    def predict_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def test_predict_batch_and_writer(models, tmp_path):
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    lengths = mask.sum(1)
    right = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        right[row, : len(prompt)] = prompt
    batch = {"input_ids": right, "lengths": lengths, "prompt_text": ["a", "b", "c"]}
    result = predict_batch(model, batch, max_new_tokens=10)
    assert result["tokens"] == [alone(model, p, 10) for p in prompts]
    assert result["texts"] is None and result["stats"].total_new_tokens == 30

    model.mtp_generate_kwargs = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=3).to_kwargs()
    writer = PredictionWriter(str(tmp_path / "out"))
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[writer], enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.predict(model, datamodule=PromptData([batch, batch]), return_predictions=False)
    lines = (tmp_path / "out" / "generations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["a", "b", "c"] * 2
    assert all(len(r["tokens"]) == 6 for r in records)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["total_new_tokens"] == 36 and stats["calls"] == 2 and stats["tau"] >= 1
    assert stats["generation"]["temperature"] == 1.0


def test_predict_takes_a_tensor_dataset_as_training_does(models):
    """``trainer.predict`` over a ``TensorDataset`` (the batches ``fit`` took) used to fail in ``predict_batch``."""
    model = models["cascaded"]
    prompts = torch.tensor([[5, 9, 2, 7], [3, 1, 4, 1]])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(prompts), batch_size=2)
    model.mtp_generate_kwargs = GenerationConfig(max_new_tokens=5).to_kwargs()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (result,) = trainer.predict(model, loader)
    assert result["tokens"] == [alone(model, row, 5) for row in prompts]


def test_prediction_writer_records_the_prompts_own_indices(tmp_path):
    """Under several processes each rank writes its share of the prompts (``generations.rank<N>.jsonl``): the
    ``index`` is the prompt's own (Lightning's ``batch_indices``), so the files merge; it was counted per rank."""
    from types import SimpleNamespace

    writer = PredictionWriter(str(tmp_path / "out"))
    strategy = SimpleNamespace(root_device="cpu", all_gather=lambda t: t.unsqueeze(0))  # (the stop flag's gather)
    rank1 = SimpleNamespace(global_rank=1, world_size=2, is_global_zero=False, strategy=strategy)
    writer.on_predict_start(rank1, None)
    prediction = {"tokens": [[4], [5]], "texts": ["x", "y"], "prompt_text": ["p1", "p3"], "stats": None}
    writer.write_on_batch_end(rank1, None, prediction, [1, 3], None, 0)
    writer.write_on_batch_end(rank1, None, {**prediction, "tokens": [[6]], "texts": ["z"], "prompt_text": ["p5"]},
                              None, None, 1)  # no indices known: counted on from the rows written
    lines = (tmp_path / "out" / ".generations.rank1.jsonl.partial").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [1, 3, 2]


def test_predict_config_parses_with_the_cli(tmp_path):
    from lightning_mtp.cli import MTPLightningCLI

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    config = Path(__file__).resolve().parents[1] / "configs" / "predict.yaml"
    cli = MTPLightningCLI(
        L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--config", str(config), "--data.init_args.predict_prompts", str(prompts),
              "--trainer.callbacks.init_args.output_dir", str(tmp_path / "out")],
        auto_configure_optimizers=False,
    )
    assert isinstance(cli.model, CausalLM)
    assert cli.model.generation_config.speculative
    writers = [c for c in cli.trainer.callbacks if isinstance(c, PredictionWriter)]
    assert len(writers) == 1 and writers[0].output_dir == tmp_path / "out"


def test_cli_predict_writes_generations_and_stats(tmp_path):
    """``lightning-mtp predict --config configs/predict.yaml --ckpt_path ...`` end to end on a tiny byte-level model.

    The checkpoint's saved generation settings must not override the predict config (here: 5 new tokens, sampling).
    """
    from lightning_mtp.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 40)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "import os\\nx = "}\n')
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=4, max_seq_len=64),
                     MTPConfig(depth=2), generation=GenerationConfig(max_new_tokens=50))
    model.configure_model()
    trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu")
    trainer.strategy.connect(model)
    ckpt = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)

    config = Path(__file__).resolve().parents[1] / "configs" / "predict.yaml"
    out = tmp_path / "out"
    main(["predict", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.accelerator", "cpu",
          "--trainer.default_root_dir", str(tmp_path),
          "--trainer.enable_progress_bar", "false", "--trainer.callbacks.init_args.output_dir", str(out),
          "--data.init_args.tokenizer", "byte", "--data.init_args.corpus", str(corpus),
          "--data.init_args.seq_len", "16", "--data.init_args.val_fraction", "0.3",
          "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.predict_prompts", str(prompts),
          "--model.init_args.generation.max_new_tokens", "5", "--model.init_args.generation.temperature", "1.0"])
    records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["def f(x):", "import os\nx = "]
    assert all(len(r["tokens"]) <= 5 and isinstance(r["completion"], str) for r in records)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] == 2 and stats["tau"] >= 1 and stats["tau_counts_bonus_token"]
    assert stats["generation"]["max_new_tokens"] == 5 and stats["generation"]["temperature"] == 1.0


def test_a_model_built_lazily_by_generate_decodes_again():
    """``generate`` on a CausalLM whose ``configure_model`` has not run builds it outside inference mode: a second
    call (which checks the weights' versions) works, and equals the first."""
    from lightning_mtp.models import CausalLM
    from lightning_mtp.models.causal_lm import ModelConfig

    torch.manual_seed(0)
    lm = CausalLM(model=ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=54),
                  mtp=MTPConfig(depth=2, architecture="cascaded")).eval()
    prompt = torch.randint(0, 64, (1, 12))
    first = lm.generate(prompt, 6, speculative=False)
    assert not any(t.is_inference() for t in [*lm.parameters(), *lm.buffers()])
    assert torch.equal(lm.generate(prompt, 6).sequences, first.sequences)


def test_sampling_settings_at_temperature_zero_are_said_to_be_ignored():
    with pytest.warns(UserWarning, match=r"top_k / top_p .* with temperature 0 decoding is greedy and ignores them"):
        GenerationConfig(top_p=0.5, top_k=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig(top_p=0.5, temperature=0.7)
        GenerationConfig()


@pytest.mark.parametrize("options", [{}, {"speculative": "auto"}, {"draft_tree": [2, 1]}, {"draft_tokens": 4},
                                     {"draft_tree_nodes": 5}])
def test_speculative_decoding_runs_under_autocast_as_bf16_mixed_predict_does(options):
    """``predict`` under ``--trainer.precision bf16-mixed`` decodes inside autocast: the MTP modules' outputs are
    bfloat16 there while the drafter's buffers follow the weights (float32), and storing them failed ("Index put
    requires the source and destination dtypes match"). Greedy output equals plain decoding under the same autocast."""
    model = draftable_model().eval()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model.generate(ids, 12, speculative=False).new_tokens
        drafted = model.generate(ids, 12, **{"speculative": True, **options})
    assert drafted.new_tokens.tolist() == plain.tolist()
    assert drafted.stats.tau > 1.5  # drafts were accepted: the equality covers accepted paths (2.0-2.7 measured)


def test_auto_at_batch_1_keeps_greedy_output_where_drafts_are_accepted():
    """``speculative="auto"`` on one row (its loop reads no per-row summary) equals plain greedy decoding, on a briefly
    trained model whose drafts are accepted: a fresh model's first call measures every option (2.2-3.1 tokens per
    forward measured), later calls may go plain on this CPU and prove less."""
    for seed in range(3):
        model = draftable_model().eval()
        ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            plain = model.generate(ids, 40, speculative=False).new_tokens
            first = model.generate(ids, 40, speculative="auto")
            later = model.generate(ids, 40, speculative="auto")
        assert first.new_tokens.tolist() == plain.tolist() and later.new_tokens.tolist() == plain.tolist()
        assert first.stats.tau > 1.5 and sum(first.stats.accepted_per_depth) > 0, first.stats
