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
from lightning_mtp.decoding.auto import AutoMemory, AutoPolicy, candidate_options
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


def measured_policy() -> AutoPolicy:
    """A policy whose step times are given: a step costs 1 + 0.25 per depth + 0.02 per node (plain: 1)."""
    options = candidate_options(3, 3, True, True)
    seconds = {"plain": 1.0}
    for option in options[1:]:
        seconds[option.describe()] = 1.0 + 0.25 * option.depth + 0.02 * option.num_nodes
    return AutoPolicy(AutoMemory(step_seconds=seconds), options)


def test_auto_policy_prefers_plain_when_drafts_are_never_accepted():
    policy = measured_policy()
    option = policy.next()
    assert option is not None  # the prior expects acceptance: it drafts
    for _ in range(40):  # every draft rejected
        ranks = [[1] + [0] * 8 for _ in range(option.depth)] if option is not None else None
        policy.update(option, policy.seconds(option), 1.0, ranks)
        option = policy.next()
    choices = [policy.next() for _ in range(48)]
    assert choices.count(None) >= 45  # plain, but for the periodic probe of the runner-up


def test_auto_policy_drafts_deep_when_drafts_are_accepted():
    policy = measured_policy()
    for _ in range(40):  # the best candidate always accepted: a deep draft pays
        option = policy.next()
        ranks = None if option is None else [[1, 1] + [0] * 7 for _ in range(option.depth)]
        policy.update(option, policy.seconds(option), 1.0 + (option.depth if option else 0), ranks)
    best = policy.next()
    assert best is not None and best.depth == 3 and best.is_chain  # a wider tree adds nodes nobody accepts


def test_auto_policy_learns_measured_step_times():
    policy = measured_policy()
    slow = TreeShape.chain(3).describe()
    for _ in range(30):
        policy.update(TreeShape.chain(3), 50.0, 4.0, [[1, 1] + [0] * 7] * 3)
    assert policy.memory.step_seconds[slow] > 40


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
