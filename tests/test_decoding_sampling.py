"""Sampling: logits processing against a reference, and lossless speculative sampling tested statistically.

Statistical tests use models whose distributions can be enumerated (vocabulary 16): a stub host whose next-token
logits depend on the position and the previous token, stub drafters that are accepted never / always / sometimes,
and the tiny hand-set CausalLM of ``test_decoding``. Per emitted position the token counts must pass a chi-square
test and lie within 6σ + 5 of n·p per bin; zero-probability tokens must never appear.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mtp.decoding import Drafts, GenerationConfig, SamplingParams, accept_typical, decode, logits_to_probs
from lightning_mtp.decoding.sampling import sample
from lightning_mtp.decoding.speculative import prepare_prompts

VOCAB = 16
ROWS = 32768


# ----------------------------------------------------------------------------------------------- logits processing
def reference_probs(logits, temperature, top_k, top_p):
    """Straightforward per-row implementation (sorting in Python) of temperature → top-k → top-p."""
    out = torch.zeros_like(logits, dtype=torch.float64)
    for r, row in enumerate(logits.double().tolist()):
        scaled = [x / temperature for x in row]
        order = sorted(range(len(row)), key=lambda i: -scaled[i])
        keep = set(range(len(row)))
        if top_k is not None and top_k < len(row):
            kth = scaled[order[top_k - 1]]
            keep = {i for i in keep if scaled[i] >= kth}
        top = max(scaled[i] for i in keep)
        weights = {i: math.exp(scaled[i] - top) for i in keep}
        total = sum(weights.values())
        probs = {i: w / total for i, w in weights.items()}
        if top_p is not None and top_p < 1:
            mass, nucleus = 0.0, set()
            for i in sorted(probs, key=lambda i: -probs[i]):
                if mass >= top_p:
                    break
                nucleus.add(i)
                mass += probs[i]
            total = sum(probs[i] for i in nucleus)
            probs = {i: probs[i] / total for i in nucleus}
        for i, p in probs.items():
            out[r, i] = p
    return out


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k", [None, 1, 3, 16])
@pytest.mark.parametrize("top_p", [None, 0.3, 0.9, 1.0])
def test_logits_to_probs_matches_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    logits[0, :4] = 1.5  # ties at the top-k boundary are kept
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.double(), reference_probs(logits, temperature, top_k, top_p), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------- stubs
class TableHost:
    """Main model stub: logits of the token after position i are ``table[i, token at i]`` (a positional bigram)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # (positions, V, V) logits; -inf = probability 0
        self.vocab_size = table.shape[-1]
        self.max_context = table.shape[0]

    def allocate(self, batch_size, max_len):
        return None

    def forward(self, input_ids, positions, state):
        return torch.stack([positions, input_ids], dim=-1)  # (B, T, 2) "hidden state"

    def main_logits(self, hidden):
        return self.table[hidden[..., 0], hidden[..., 1]]  # (B, T, V)

    def rollback(self, state, lengths):
        pass


class TableDrafter:
    """Drafter stub with the same form: draft j after position n comes from ``table[n + j - 1, previous token]``."""

    def __init__(self, table: torch.Tensor, max_drafts: int = 3) -> None:
        self.table = table
        self.max_drafts = max_drafts

    def allocate(self, batch_size, max_len):
        return None

    def observe(self, state, hidden, positions):
        pass

    def draft(self, state, tokens, newest, num_drafts, params, generator=None, confidence_threshold=None):
        rows = torch.arange(tokens.shape[0])
        previous = tokens[rows, newest]
        drafts, probs = [], []
        for j in range(1, num_drafts + 1):
            q = logits_to_probs(self.table[newest + j - 1, previous], params.temperature, params.top_k, params.top_p)
            previous = sample(q, generator)
            tokens[rows, newest + j] = previous
            drafts.append(previous)
            probs.append(q)
        return Drafts(torch.stack(drafts, 1), torch.stack(probs, 1))

    def commit(self, state, advanced):
        pass


def random_table(gen, positions=24, zero_share=0.4, scale=1.5):
    logits = torch.randn(positions, VOCAB, VOCAB, generator=gen) * scale
    zero = torch.rand(positions, VOCAB, VOCAB, generator=gen) < zero_share
    zero[..., 0] = False  # every row keeps some mass
    return logits.masked_fill(zero, float("-inf"))


def expected_marginals(table, prompt_last: int, start: int, steps: int, params: SamplingParams):
    """Exact distribution of each emitted token (positions start .. start+steps-1) by the forward recursion."""
    marginals = []
    current = torch.zeros(VOCAB, dtype=torch.float64)
    current[prompt_last] = 1.0
    for i in range(steps):
        transition = logits_to_probs(table[start - 1 + i], params.temperature, params.top_k, params.top_p).double()
        current = current @ transition  # (V,)
        marginals.append(current)
    return marginals


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X ≥ statistic) for X ~ χ²(dof), via the regularised upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def check_counts(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Chi-square test, per-bin |count - n·p| ≤ 6σ + 5, and zero-probability bins never drawn."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = n * probs
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts - expected).abs() <= 6 * sigma + 5).all(), f"{what}: {counts.tolist()} vs {expected.tolist()}"
    assert (counts[probs == 0] == 0).all(), f"{what}: drew a token of probability 0"
    support = probs > 0
    statistic = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    if dof > 0:
        assert chi_square_sf(statistic, dof) > 1e-5, f"{what}: chi2={statistic:.1f} with {dof} dof"


def decode_stub(host, drafter, config, prompt=(3, 7, 1), rows=ROWS, seed=0):
    input_ids = torch.tensor([list(prompt)] * rows)
    prompts, lengths = prepare_prompts(input_ids, None, VOCAB, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    return decode(host, drafter, prompts, lengths, config, generator)


def drafter_table(kind: str, target: torch.Tensor, gen) -> torch.Tensor:
    if kind == "never":  # support only where the target has probability 0: every draft is rejected
        ban = torch.isfinite(target).clone()
        ban[..., 0] = True  # token 0 always has target mass; never propose it
        logits = torch.randn(target.shape, generator=gen).masked_fill(ban, float("-inf"))
        assert torch.isfinite(logits).any(-1).all()  # every draft distribution has some support
        return logits
    if kind == "always":  # q == p exactly: every draft is accepted
        return target.clone()
    return random_table(gen, target.shape[0], zero_share=0.3)  # sometimes


# ----------------------------------------------------------------------------------------------- lossless sampling
@pytest.mark.parametrize(
    "kind, params",
    [
        ("never", SamplingParams(1.0)),
        ("always", SamplingParams(1.0)),
        ("sometimes", SamplingParams(1.0)),
        ("sometimes", SamplingParams(0.8, top_k=6, top_p=0.9)),
        (None, SamplingParams(1.0)),  # plain sampling: the reference itself
        (None, SamplingParams(0.8, top_k=6, top_p=0.9)),
    ],
)
def test_speculative_sampling_is_lossless(kind, params):
    gen = torch.Generator().manual_seed(1)
    target = random_table(gen)
    host = TableHost(target)
    drafter = TableDrafter(drafter_table(kind, target, gen)) if kind else None
    steps = 7
    config = GenerationConfig(max_new_tokens=steps, temperature=params.temperature, top_k=params.top_k,
                              top_p=params.top_p, speculative=drafter is not None)
    out = decode_stub(host, drafter, config)
    assert (out.num_new_tokens == steps).all()
    for i, probs in enumerate(expected_marginals(target, 1, 3, steps, params)):
        counts = torch.bincount(out.new_tokens[:, i], minlength=VOCAB)
        check_counts(counts, probs, f"{kind} position {i}")
    stats = out.stats
    if kind == "never":
        assert sum(stats.accepted_per_depth) == 0 and stats.tau == 1.0
    if kind == "always":
        assert stats.accepted_per_depth == stats.drafted_per_depth
        assert stats.tau == 7 / 3  # prefill, then 1 + 3 drafts, then the 2 the budget leaves
    if kind == "sometimes":
        assert 0 < sum(stats.accepted_per_depth) < sum(stats.drafted_per_depth)


def test_accepted_length_histogram_matches_theory():
    """Stationary p and q: every step accepts j drafts w.p. α^j (1 - α) (j < 3) and α³ (j = 3), α = Σ min(p, q)."""
    gen = torch.Generator().manual_seed(2)
    p_logits = torch.randn(VOCAB, generator=gen).masked_fill(torch.arange(VOCAB) % 5 == 4, float("-inf"))
    q_logits = torch.randn(VOCAB, generator=gen)
    target = p_logits.expand(40, VOCAB, VOCAB).clone()
    draft = q_logits.expand(40, VOCAB, VOCAB).clone()
    out = decode_stub(TableHost(target), TableDrafter(draft), GenerationConfig(max_new_tokens=20, temperature=1.0),
                      rows=8192)
    alpha = float(torch.minimum(torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)).sum())
    theory = torch.tensor([1 - alpha, alpha * (1 - alpha), alpha**2 * (1 - alpha), alpha**3])
    histogram = torch.tensor(out.stats.accepted_length_histogram)
    check_counts(histogram, theory, "accepted-length histogram")
    # and the emitted tokens are still distributed as p
    check_counts(torch.bincount(out.new_tokens[:, 5], minlength=VOCAB), torch.softmax(p_logits.double(), -1),
                 "stationary position 5")


def test_withdrawn_drafts_stay_lossless():
    """Drafts withdrawn (-1, q = 0) at random, independently of the drafted tokens, must not bias the output."""

    class Withdrawing(TableDrafter):
        def draft(self, state, tokens, newest, num_drafts, params, generator=None, confidence_threshold=None):
            drafts = super().draft(state, tokens, newest, num_drafts, params, generator)
            keep = torch.rand(drafts.tokens.shape, generator=torch.Generator().manual_seed(int(newest[0]))) < 0.6
            keep = keep.long().cumprod(1).bool()
            return Drafts(drafts.tokens.masked_fill(~keep, -1), drafts.probs * keep.unsqueeze(-1))

    gen = torch.Generator().manual_seed(3)
    target = random_table(gen)
    drafter = Withdrawing(drafter_table("sometimes", target, gen))
    out = decode_stub(TableHost(target), drafter, GenerationConfig(max_new_tokens=6, temperature=1.0))
    for i, probs in enumerate(expected_marginals(target, 1, 3, 6, SamplingParams(1.0))):
        check_counts(torch.bincount(out.new_tokens[:, i], minlength=VOCAB), probs, f"withdrawn position {i}")


def test_mtp_drafter_sampling_is_lossless():
    """The real MTP drafter (cascaded, per-depth draft temperatures) on the tiny CausalLM: tokens 2 and 3."""
    from test_decoding import draftable_model

    model = draftable_model("cascaded")
    model.mtp_draft_temperatures = [1.0, 0.7, 1.5]
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    rows = 12288
    out = model.generate(prompt.expand(rows, -1), 3, temperature=1.0, top_k=8, speculative=True,
                         generator=torch.Generator().manual_seed(0))
    assert out.stats.accepted_per_depth[0] > 0.2 * rows
    check_first_three_tokens(model, prompt, out.new_tokens, "MTP")


def check_first_three_tokens(model, prompt: torch.Tensor, new_tokens: torch.Tensor, what: str) -> None:
    """The emitted tokens 1-3 (rows of ``new_tokens``) against the exact marginals of sampling ``model`` at
    temperature 1 and top-k 8 after ``prompt`` (1, P), enumerated over the 16-token vocabulary."""
    with torch.no_grad():
        first = logits_to_probs(model.logits(model(prompt))[0, -1], 1.0, 8).double()  # (V,)
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V², 2)
        seqs = torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], dim=1)
        logits = model.logits(model(seqs))  # (V², P + 2, V)
        second = logits_to_probs(logits[:, -2], 1.0, 8).double().view(VOCAB, VOCAB, VOCAB)[:, 0]  # (x1, x2)
        third = logits_to_probs(logits[:, -1], 1.0, 8).double().view(VOCAB, VOCAB, VOCAB)  # (x1, x2, x3)
    marginal2 = first @ second
    marginal3 = torch.einsum("a,ab,abc->c", first, second, third)
    check_counts(torch.bincount(new_tokens[:, 0], minlength=VOCAB), first, f"{what} token 1")
    check_counts(torch.bincount(new_tokens[:, 1], minlength=VOCAB), marginal2, f"{what} token 2")
    check_counts(torch.bincount(new_tokens[:, 2], minlength=VOCAB), marginal3, f"{what} token 3")


def exact_first_two(model, prompt: torch.Tensor) -> torch.Tensor:
    """The exact joint distribution (x1, x2) (V, V) of the first two tokens of sampling ``model`` at temperature 1
    after ``prompt`` (1, P), enumerated over the 16-token vocabulary."""
    with torch.no_grad():
        first = torch.softmax(model.logits(model(prompt))[0, -1].double(), -1)  # (V,)
        seqs = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB).unsqueeze(1)], dim=1)  # (V, P + 1)
        second = torch.softmax(model.logits(model(seqs))[:, -1].double(), -1)  # (x1, x2)
    return first.unsqueeze(1) * second


def test_confidence_threshold_never_withdraws_a_draft_for_its_value(make_tiny_model):
    """p = (0.5, 0.5), q = (0.9, 0.1), threshold 0.5, through MTPDrafter and verification: the token after a draft is
    still (0.5, 0.5). Withdrawing a sampled draft x when q(x) < 0.5 would give (0.9·5/9 + 0.1·0.5, 0.45) = (0.55, 0.45).
    """
    model = make_tiny_model(depth=1, vocab_size=2, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # p = (0.5, 0.5) everywhere
    draft_logits = torch.tensor([0.9, 0.1]).log()
    model.mtp_depth_logits = lambda depth, hidden: draft_logits.expand(hidden.shape[0], -1)  # (B, 2): q = (0.9, 0.1)
    out = model.generate(torch.zeros(ROWS, 3, dtype=torch.long), 2, temperature=1.0, speculative=True,
                         draft_confidence_threshold=0.5, generator=torch.Generator().manual_seed(0))
    check_counts(torch.bincount(out.new_tokens[:, 1], minlength=2), torch.tensor([0.5, 0.5]), "token after a draft")
    assert out.stats.drafted_per_depth == [ROWS]  # max q = 0.9 ≥ 0.5: every row drafts, whatever it draws


def test_confidence_threshold_sampling_is_lossless():
    """``generate(temperature=1, draft_confidence_threshold=0.4)`` with the real MTP drafter on the tiny CausalLM: the
    joint distribution of the first two tokens (the second one drafted at depth 1, or withdrawn) is the model's."""
    from test_decoding import draftable_model

    model = draftable_model("cascaded")
    prompt = torch.tensor([[5, 2, 9, 11, 3]])
    rows = 16384
    out = model.generate(prompt.expand(rows, -1), 2, temperature=1.0, speculative=True,
                         draft_confidence_threshold=0.4, generator=torch.Generator().manual_seed(0))
    drafted = out.stats.drafted_per_depth[0]
    assert 0.2 * rows < drafted < 0.8 * rows  # the threshold withdrew some depth-1 drafts and kept others
    assert out.stats.accepted_per_depth[0] > 0.1 * rows
    pairs = out.new_tokens[:, 0] * VOCAB + out.new_tokens[:, 1]  # (rows,) index of (x1, x2)
    check_counts(torch.bincount(pairs, minlength=VOCAB * VOCAB), exact_first_two(model, prompt).flatten(),
                 "first two tokens")


# ----------------------------------------------------------------------------------------------- typical acceptance
def test_typical_acceptance_rule():
    """Accept while p(x) > min(ε, δ·exp(-H(p))), then sample the next token from p there."""
    p = torch.zeros(1, 4, VOCAB)
    p[0, 0, :2] = torch.tensor([0.95, 0.05])  # low entropy: threshold = δ·exp(-H) ≈ 0.25
    p[0, 1] = 1.0 / VOCAB  # uniform: threshold = min(0.09, 0.3/16) = 0.01875
    p[0, 2, :2] = 0.5
    p[0, 3, 7] = 1.0
    entropy0 = -(0.95 * math.log(0.95) + 0.05 * math.log(0.05))
    assert 0.05 < min(0.09, 0.3 * math.exp(-entropy0)) < 0.95
    out = accept_typical(torch.tensor([[0, 5, 1]]), p, 0.09, 0.3)
    assert out.num_accepted.tolist() == [3] and out.output_tokens.tolist() == [[0, 5, 1, 7]]
    out = accept_typical(torch.tensor([[1, 5, 1]]), p, 0.09, 0.3)  # 0.05 < threshold: rejected at once
    assert out.num_accepted.tolist() == [0] and out.output_tokens[0, 0].item() in (0, 1)
    out = accept_typical(torch.tensor([[0, -1, 1]]), p, 0.09, 0.3)  # withdrawn drafts are never accepted
    assert out.num_accepted.tolist() == [1]


def test_plain_and_speculative_share_the_sampling_path():
    """p in verification is logits_to_probs of the same logits plain decoding samples from."""
    from lightning_mtp.decoding import step

    logits = torch.randn(2, 4, VOCAB)
    config = GenerationConfig(temperature=0.7, top_k=5, top_p=0.8)
    seen = {}

    original = step.verify_drafts

    def spy(draft_tokens, target, draft_probs=None, **kwargs):
        seen["p"] = target
        return original(draft_tokens, target, draft_probs, **kwargs)

    try:
        step.verify_drafts = spy
        drafts = Drafts(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3, VOCAB), 1.0 / VOCAB))
        step.accept(drafts, logits, config, None)
    finally:
        step.verify_drafts = original
    assert torch.equal(seen["p"], logits_to_probs(logits, 0.7, 5, 0.8))


def test_generate_honours_its_seed(make_tiny_model):
    """``generate(seed=...)``: the same seed gives the same samples, plain and speculative; another seed others."""
    model = make_tiny_model(depth=2)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(3))

    calls = iter(range(1000, 2000))

    def run(seed, speculative=True):
        torch.manual_seed(next(calls))  # a different global RNG state each call: it must not matter
        out = model.generate(prompt, 24, temperature=1.0, speculative=speculative, seed=seed)
        return out.new_tokens.tolist()

    for speculative in (True, False):
        assert run(5, speculative) == run(5, speculative)
        assert run(5, speculative) != run(6, speculative)
    with pytest.raises(ValueError, match="either seed or generator"):
        model.generate(prompt, 4, temperature=1.0, seed=1, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="seed"):
        model.generate(prompt, 4, temperature=1.0, seed=-1)


def test_a_temperature_near_zero_samples_the_greedy_tokens(make_tiny_model):
    """Logits over a temperature of 1e-40 overflowed to inf, and every probability became NaN: plain sampling emitted
    the last id, speculative sampling garbage. The logits' maximum is subtracted first, so a temperature near 0 gives
    the argmax, as greedy decoding does."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    assert logits_to_probs(logits, 1e-40).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    model = make_tiny_model(depth=2)
    prompt = torch.tensor([[5, 9, 2, 7]])
    greedy = model.generate(prompt, 12, speculative=False).new_tokens
    for speculative in (False, True):
        out = model.generate(prompt, 12, temperature=1e-40, seed=0, speculative=speculative)
        assert torch.equal(out.new_tokens, greedy), speculative


def test_an_unknown_generate_option_is_refused_naming_the_options(make_tiny_model):
    with pytest.raises(ValueError, match=r"generate\(\): unknown option\(s\) \['repetition_penalty'\]; the options "
                                         r"are \[.*'temperature'.*'top_p'"):
        make_tiny_model(depth=2).generate(torch.tensor([[5, 9]]), 4, repetition_penalty=1.2)
