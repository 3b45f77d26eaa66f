"""Tree drafting, drafts beyond the MTP depth and ``speculative="auto"``: lossless against plain decoding.

Greedy: token equality with plain greedy decoding (each prompt decoded alone) on ragged, left- and right-padded
batches, for static trees, dynamic (EAGLE-2) trees, chains longer than D and ``auto``, both architectures.
Sampling: the exact marginals of the first three emitted tokens of the tiny hand-set CausalLM (vocabulary 16,
enumerable) against 12288 sampled rows, with the chi-square / 6σ check of ``test_decoding_sampling``.
"""

from __future__ import annotations

import pytest
import torch
from test_decoding import alone, draftable_model, ragged_prompts, rows_of
from test_decoding_sampling import check_first_three_tokens

from lightning_mtp.decoding import GenerationConfig
from lightning_mtp.decoding.tree import TreeShape, static_layout, tree_attention_mask
from lightning_mtp.kernels.tree_verify_torch import ancestors


@pytest.fixture(scope="module")
def models():
    return {arch: draftable_model(arch) for arch in ("cascaded", "parallel")}


TREES = [
    {"draft_tree": [1, 1, 1]},
    {"draft_tree": [2]},
    {"draft_tree": [3, 2, 1]},
    {"draft_tree": [2, 2, 2]},
    {"draft_tree_nodes": 7},
    {"draft_tree_nodes": 12, "draft_tree_top_k": 3},
]


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("tree", TREES, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
def test_tree_greedy_equals_plain_greedy(models, architecture, tree):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts()
    expected = [alone(model, p, 40) for p in prompts]
    out = model.generate(input_ids, 40, attention_mask=mask, speculative=True, **tree)
    assert rows_of(out) == expected
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for count in histogram if count) >= 2, histogram  # rows accepted different path lengths
    single = model.generate(prompts[2].unsqueeze(0), 40, speculative=True, **tree)
    assert rows_of(single) == expected[2:]


def test_wider_trees_accept_more(models):
    model = models["cascaded"]
    input_ids, mask, _ = ragged_prompts()
    chain = model.generate(input_ids, 40, attention_mask=mask, speculative=True, draft_tree=[1, 1, 1])
    tree = model.generate(input_ids, 40, attention_mask=mask, speculative=True, draft_tree=[4, 2, 1])
    assert tree.stats.tau > chain.stats.tau
    assert tree.stats.main_forwards < chain.stats.main_forwards


@pytest.mark.parametrize("draft_tokens", [4, 6])
def test_drafts_beyond_the_depth_stay_lossless(models, draft_tokens):
    model = models["cascaded"]
    input_ids, mask, prompts = ragged_prompts()
    expected = [alone(model, p, 40) for p in prompts]
    out = model.generate(input_ids, 40, attention_mask=mask, speculative=True, draft_tokens=draft_tokens)
    assert rows_of(out) == expected
    assert len(out.stats.accepted_per_depth) == draft_tokens
    assert out.stats.accepted_per_depth[3] > 0  # depth 4 (module 3 re-applied) is accepted sometimes
    deep = model.generate(input_ids, 40, attention_mask=mask, speculative=True, draft_tree=[2, 1, 1, 1, 1])
    assert rows_of(deep) == expected


def test_parallel_heads_refuse_drafts_beyond_the_depth(models):
    with pytest.raises(ValueError, match="beyond the MTP depth need cascaded"):
        models["parallel"].generate(torch.tensor([[1, 2, 3]]), 8, speculative=True, draft_tokens=4)


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_auto_greedy_equals_plain_greedy(models, architecture):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts(seed=4)
    expected = [alone(model, p, 48) for p in prompts]
    for _ in range(2):  # the second call starts from what the first learned
        out = model.generate(input_ids, 48, attention_mask=mask)  # speculative="auto" is the default
        assert rows_of(out) == expected
    assert GenerationConfig().speculative == "auto"


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_auto_equals_plain_greedy_where_its_drafts_are_accepted(models, architecture, monkeypatch):
    """``auto`` on costs that make drafting pay (a drafting call priced at 2% of a plain step and no timing learned,
    so noise on the test machine cannot make it decode plainly): it drafts, switching between chains of 1..D by the
    acceptance it learns for each row of a ragged batch, and its output equals plain greedy decoding while many drafts
    are accepted (τ well above 1), so the equality means something."""
    from lightning_mtp.decoding import tree_policy
    from lightning_mtp.decoding.auto import SWITCHES

    model = models[architecture]
    monkeypatch.setattr(tree_policy, "draft_cost_share", lambda module: 0.02)
    monkeypatch.setattr(SWITCHES, "fit", False)
    monkeypatch.delitem(model.__dict__, "_mtp_auto_memory", raising=False)  # other tests' memories
    input_ids, mask, prompts = ragged_prompts(seed=4)
    expected = [alone(model, p, 48) for p in prompts]
    chosen = set()
    for _ in range(2):
        out = model.generate(input_ids, 48, attention_mask=mask)
        assert rows_of(out) == expected
        assert out.stats.tau > 1.3, out.stats.tau
        chosen.update(key for key, (_, tried) in next(iter(model.__dict__["_mtp_auto_memory"].values()))
                      .acceptance.items() if tried > 0)
    assert len({depth for depth, _ in chosen}) >= 2  # drafted more than one depth
    model.__dict__.pop("_mtp_auto_memory", None)  # the next tests learn for themselves


class MixedSteps:
    """A step policy cycling through every kind of step (plain, chains up to beyond D, static and dynamic trees) in
    an irregular order, as ``auto`` may: each kind leaves the MTP modules' caches in its own state for the next."""

    OPTIONS = [None, TreeShape.chain(1), TreeShape(branching=(3, 2, 1)), TreeShape.chain(3), None, TreeShape.chain(4),
               TreeShape(branching=(2,)), TreeShape.chain(2), TreeShape(nodes=6, top_k=2, max_depth=3),
               TreeShape(branching=(1, 1, 1, 1, 1)), TreeShape.chain(1), TreeShape(branching=(2, 2))]

    def __init__(self, parallel: bool = False) -> None:
        self.options = [o for o in self.OPTIONS if not (parallel and o is not None and o.depth > 3)]
        self.max_nodes = max(o.num_nodes for o in self.options if o is not None) + 1
        self.steps = 0

    def next(self):
        self.steps += 1
        return self.options[(self.steps * 5) % len(self.options)]

    def observe_step(self, option, extra, active_rows, seconds) -> None:
        pass


def decode_with(model, drafter, policy, input_ids, mask, max_new_tokens, **config):
    """Decode with ``drafter`` and a step ``policy`` of the test's own (``speculative=True`` and ``config``)."""
    from lightning_mtp.decoding.host import decoding_host
    from lightning_mtp.decoding.speculative import decode, prepare_prompts

    host = decoding_host(model)
    prompts, lengths = prepare_prompts(input_ids, mask, host.vocab_size, torch.device("cpu"))
    generator = config.pop("generator", None)
    config = GenerationConfig(max_new_tokens=max_new_tokens, speculative=True, **config)
    return decode(host, drafter, prompts, lengths, config, generator, policy=policy)


def decode_mixed(model, input_ids, mask, max_new_tokens, **config):
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter

    policy = MixedSteps(parallel=model.mtp_config.architecture == "parallel")
    drafter = MTPTreeDrafter(model, max(o.depth for o in policy.options if o is not None))
    return decode_with(model, drafter, policy, input_ids, mask, max_new_tokens, **config)


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_mixed_step_kinds_in_one_call_equal_plain_greedy(models, architecture):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts(seed=6)
    expected = [alone(model, p, 48) for p in prompts]
    out = decode_mixed(model, input_ids, mask, 48)
    assert rows_of(out) == expected
    assert sum(out.stats.accepted_per_depth) > 0


def test_mixed_step_kinds_in_one_call_keep_the_sampling_distribution():
    """Chains write their nodes at their own positions, trees at scratch slots: any order of the two stays exact."""
    model = draftable_model("cascaded")
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    rows = 12288
    out = decode_mixed(model, prompt.expand(rows, -1), None, 3, temperature=1.0, top_k=8,
                       generator=torch.Generator().manual_seed(1))
    check_first_three_tokens(model, prompt, out.new_tokens, "mixed steps")


class MixedChains:
    """The chain drafter's steps as ``auto`` takes them: plain steps (0 drafts: no drafting, no verification kernel)
    between chains of every length, in an irregular order."""

    COUNTS = [0, 1, 3, 0, 0, 2, 3, 0, 1, 2, 0, 3, 3, 1]

    def __init__(self) -> None:
        self.steps = 0

    def next(self) -> int:
        self.steps += 1
        return self.COUNTS[(self.steps * 5) % len(self.COUNTS)]

    def observe_step(self, option, reached, active_rows, seconds) -> None:
        pass


def decode_mixed_chains(model, input_ids, mask, max_new_tokens, **config):
    from lightning_mtp.decoding.native_drafting import chain_drafter

    return decode_with(model, chain_drafter(model), MixedChains(), input_ids, mask, max_new_tokens, **config)


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_plain_steps_between_chains_equal_plain_greedy(models, architecture):
    model = models[architecture]
    input_ids, mask, prompts = ragged_prompts(seed=7)
    expected = [alone(model, p, 48) for p in prompts]
    out = decode_mixed_chains(model, input_ids, mask, 48)
    assert rows_of(out) == expected
    assert all(out.stats.accepted_per_depth) and out.stats.tau > 1.3  # drafts of every depth really accepted


def test_the_chain_drafters_depth_d_plus_1_keeps_the_sampling_distribution():
    """D = 1 and the chain drafter's chain of 2 (the module re-applied on its own output: ``auto``'s deepest chain):
    the first step's second draft is the third token, whose marginal stays the model's."""
    from lightning_mtp.decoding.drafting import MTPDrafter

    model = draftable_model("cascaded", depth=1)
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    out = decode_with(model, MTPDrafter(model, max_depth=2), None, prompt.expand(12288, -1), None, 3,
                      temperature=1.0, top_k=8, generator=torch.Generator().manual_seed(4))
    assert out.stats.drafted_per_depth[1] > 0 and out.stats.accepted_per_depth[1] > 0.05 * 12288
    check_first_three_tokens(model, prompt, out.new_tokens, "chain of D + 1")


def test_plain_steps_between_chains_keep_the_sampling_distribution():
    """A plain step inside a speculative call samples from p itself: the first three tokens' joint distribution
    stays the model's across plain steps and chains of each length."""
    model = draftable_model("cascaded")
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    out = decode_mixed_chains(model, prompt.expand(12288, -1), None, 3, temperature=1.0, top_k=8,
                              generator=torch.Generator().manual_seed(2))
    check_first_three_tokens(model, prompt, out.new_tokens, "plain steps between chains")


def reference_children(model, sequence: torch.Tensor, newest: int, depth: int, count: int) -> list[int]:
    """The ``count`` best draft tokens of ``depth`` after ``sequence`` (1-D: committed tokens up to position
    ``newest``, then the draft path of ``depth - 1`` tokens), computed uncached over the whole sequence: h_0 from the
    trunk, then module k (the last module re-applied beyond D) over positions 0..T-k-1 with Emb(t(i+k)); depth
    ``depth`` at position ``newest - 1`` predicts the token at ``newest + depth``."""
    modules = model.require_mtp_modules()
    cascaded = model.mtp_config.architecture == "cascaded"
    with torch.no_grad():
        seq = sequence.unsqueeze(0)  # (1, T)
        length = seq.shape[1]
        cos, sin = model.mtp_rope(length)
        h0 = model(seq)  # (1, T, H)
        hidden = h0
        for k in range(1, depth + 1):
            module = modules[min(k, len(modules)) - 1]
            if cascaded:
                emb = model.mtp_draft_embedding()(seq[:, k:])  # (1, T-k, H)
                hidden = module(hidden[:, : length - k], emb, cos[:, : length - k], sin[:, : length - k])
            else:
                hidden = module(h0, None, cos, sin)
        logits = model.mtp_depth_logits(min(depth, len(modules)), hidden[:, newest - 1])  # (1, V)
    return logits[0].topk(count).indices.tolist()


def check_drafts_against_reference(model, input_ids, mask, policy, max_new_tokens: int = 24) -> int:
    """Decode with ``policy``; at every drafting step, every drafted node's children must be the reference's best
    candidates of their depth (static trees: in rank order; dynamic trees: among the top_k). Returns nodes checked."""
    from lightning_mtp.decoding.tree_drafting import MTPTreeDrafter

    drafter = MTPTreeDrafter(model, max(o.depth for o in policy.options if o is not None))
    steps = []
    draft = drafter.draft

    def recording(state, tokens, newest, shape, params, generator=None):
        tree = draft(state, tokens, newest, shape, params, generator)
        steps.append((tokens.clone(), newest.clone(), shape, tree))
        return tree

    drafter.draft = recording
    decode_with(model, drafter, policy, input_ids, mask, max_new_tokens)
    checked = 0
    for tokens, newest, shape, tree in steps:
        for row in range(tokens.shape[0]):
            n = int(newest[row])
            committed = tokens[row, : n + 1]
            parents, node_tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()
            for node in range(len(parents)):
                children = [c for c in range(1, len(parents)) if parents[c] == node]
                if not children:
                    continue
                path, at = [], node
                while at:
                    path.append(node_tokens[at])
                    at = parents[at]
                depth = len(path) + 1
                sequence = torch.cat([committed, torch.tensor(path[::-1], dtype=torch.long)])
                drafted = [node_tokens[c] for c in children]
                if shape.dynamic:
                    assert set(drafted) <= set(reference_children(model, sequence, n, depth, shape.top_k))
                else:
                    assert drafted == reference_children(model, sequence, n, depth, len(children)), (shape, row, node)
                checked += 1
    return checked


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_every_draft_equals_uncached_drafting_across_mixed_steps(models, architecture):
    """The drafter's caches (linear windows, tree scratch slots, chains at their own positions, modules re-applied
    beyond D) give every node the children that running the MTP modules uncached over the whole sequence gives."""
    model = models[architecture]
    input_ids, mask, _ = ragged_prompts(seed=7)
    policy = MixedSteps(parallel=architecture == "parallel")
    assert check_drafts_against_reference(model, input_ids, mask, policy) > 20


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_prompts_shorter_than_the_draft_depth(models, architecture):
    """A 1- or 2-token prompt: depth k's tree entries at positions n - k + m fall before position 0 for the first
    steps. They exist in no sequence: nothing may read them (drafts equal uncached drafting over positions >= 0), no
    chain may write them into a real cache slot, and the output equals plain greedy decoding."""
    model = models[architecture]
    prompts = [torch.tensor([7]), torch.tensor([3, 12])]
    input_ids = torch.zeros(2, 2, dtype=torch.long)
    mask = torch.zeros(2, 2, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    policy = MixedSteps(parallel=architecture == "parallel")
    assert check_drafts_against_reference(model, input_ids, mask, policy, max_new_tokens=16) >= 8
    expected = [alone(model, p, 16) for p in prompts]
    for options in ({"draft_tokens": 5}, {"draft_tree": [2, 2, 2]}, {"draft_tree_nodes": 8}, {}):
        if architecture == "parallel" and options.get("draft_tokens", 0) > 3:
            continue
        for prompt, want in zip(prompts, expected):
            out = model.generate(prompt.unsqueeze(0), 16, speculative=True, **options)
            assert rows_of(out) == [want], options
            assert out.stats.tau > 1.3, (options, out.stats.tau)  # drafts are accepted: equality means something
        assert rows_of(model.generate(input_ids, 16, attention_mask=mask, speculative="auto")) == expected


@pytest.mark.parametrize("tree", [{"draft_tree": [3, 2, 1]}, {"draft_tree": [1, 1, 1, 1]},
                                  {"draft_tree_nodes": 6}, {"speculative": "auto"}],
                         ids=["static-sampled-without-replacement", "chain-beyond-depth",
                              "dynamic-deterministic", "auto"])
def test_tree_sampling_is_lossless(tree):
    """Exact marginals of tokens 1-3 (recursive rejection sampling over siblings, per-depth draft temperatures)."""
    model = draftable_model("cascaded")
    model.mtp_draft_temperatures = [1.0, 0.7, 1.5]
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    rows = 12288
    options = {"speculative": True, **tree}
    out = model.generate(prompt.expand(rows, -1), 3, temperature=1.0, top_k=8,
                         generator=torch.Generator().manual_seed(0), **options)
    if options["speculative"] is True:
        assert out.stats.accepted_per_depth[0] > 0.2 * rows
    check_first_three_tokens(model, prompt, out.new_tokens, "tree")


def test_tree_attention_mask_sees_prefix_and_ancestors():
    layout = static_layout(TreeShape(branching=(2, 1)))  # nodes: root, a, b, a1, b1
    anc = ancestors(layout.parents.unsqueeze(0), 2)
    mask = tree_attention_mask(torch.tensor([3]), torch.tensor([4]), anc, 10)[0, 0]  # prefix slots 0..3
    visible = [torch.nonzero(row).flatten().tolist() for row in mask]
    assert visible == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6], [0, 1, 2, 3, 4, 5, 7],
                       [0, 1, 2, 3, 4, 6, 8]]


@pytest.mark.parametrize("kwargs, match", [
    ({"draft_tree": [4, 0]}, "draft_tree"),
    ({"draft_tree": "4,2"}, "draft_tree"),
    ({"draft_tree": [2], "draft_tokens": 2}, "draft_tree"),
    ({"draft_tree": [2], "draft_tree_nodes": 4}, "draft_tree_nodes"),
    ({"draft_tree_nodes": 0}, "draft_tree_nodes"),
    ({"draft_tokens": 17}, "draft_tokens"),
    ({"speculative": "yes"}, "speculative"),
    ({"speculative": True, "draft_tree": [2], "compile": True}, "compile"),
    ({"draft_tree_nodes": 8, "adaptive_draft_tokens": True}, "adaptive_draft_tokens"),
    ({"speculative": True, "draft_tree": [2], "acceptance": "typical", "temperature": 1.0}, "acceptance"),
])
def test_bad_tree_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)
