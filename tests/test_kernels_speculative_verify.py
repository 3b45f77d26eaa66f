"""Speculative verification: Triton kernel vs torch twin (exact), edge cases and sampling statistics.

Interpreter handling as in ``test_kernels_linear_cross_entropy.py``: kernel tests are marked ``needs_interpreter`` and
run in a child pytest started with ``TRITON_INTERPRET=1`` by :func:`test_interpreted_suite_in_subprocess` (or
in-process when pytest itself was started with the variable set). Twin-only tests run everywhere.

Statistical checks (fixed seeds, so deterministic): for every bin ``|count - n p| <= 6 sigma + 5`` with
``sigma = sqrt(n p (1 - p))``, zero-probability tokens never drawn, and Pearson's chi-square over the support below
``df + 6 sqrt(2 df)`` (mean + 6 sd of a chi-square with ``df`` degrees of freedom).
"""

import math

import pytest
import torch
from kernel_harness import INTERPRETED, gpu, needs_cuda, needs_interpreter, run_interpreted_subprocess

import lightning_mtp.kernels as kernels
from lightning_mtp.kernels import sampling_randomness, verify_drafts, verify_drafts_torch
from lightning_mtp.kernels.speculative_verify import verify_drafts_triton

BACKENDS = {"torch": verify_drafts_torch, "triton": verify_drafts_triton}


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_interpreted_suite_in_subprocess():
    run_interpreted_subprocess(__file__)


def random_case(batch, k, vocab, seed, device="cpu", dtype=torch.float32):
    """Target probs p (B, k+1, V) and draft probs q (B, k, V) with zeros (top-k style), drafts sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, dim=-1)
    p = p * (torch.rand(batch, k + 1, vocab, generator=gen) > 0.2)  # some target zeros
    p[..., 0] += 1e-3  # never an all-zero row
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, dim=-1)
    q = 0.5 * q + 0.5 * p[:, :k]  # overlap, so that drafts are sometimes accepted
    q = q * (torch.rand(batch, k, vocab, generator=gen) > 0.3)
    q[..., min(1, vocab - 1)] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    return drafts.to(device), p.to(device, dtype), q.to(device, dtype)


def assert_valid(out, drafts, vocab):
    batch, k = drafts.shape
    n = out.num_accepted
    assert out.num_accepted.dtype == torch.long and out.output_tokens.dtype == torch.long
    assert out.output_tokens.shape == (batch, k + 1) and n.shape == (batch,)
    assert torch.all((n >= 0) & (n <= k))
    pos = torch.arange(k + 1, device=drafts.device)
    tokens = out.output_tokens
    valid = pos[None, :] <= n[:, None]
    assert torch.all(tokens[~valid] == -1)
    assert torch.all((tokens[valid] >= 0) & (tokens[valid] < vocab))
    accepted = pos[None, :k] < n[:, None]
    assert torch.equal(tokens[:, :k][accepted], drafts[accepted])


# ---- kernel vs twin, exact ----

SHAPES = [(5, 3, 257), (7, 1, 1000), (3, 4, 16), (4, 0, 33), (9, 2, 64), (1, 2, 1)]


@needs_interpreter
@pytest.mark.parametrize("batch,k,vocab", SHAPES)
def test_sampling_kernel_equals_twin(batch, k, vocab):
    drafts, p, q = random_case(batch, k, vocab, seed=batch * 100 + k)
    if k > 0:
        drafts[0, 0] = -1  # out-of-vocab drafts are rejected
    outs = [fn(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(7)) for fn in BACKENDS.values()]
    assert torch.equal(outs[0].num_accepted, outs[1].num_accepted)
    assert torch.equal(outs[0].output_tokens, outs[1].output_tokens)
    for out in outs:
        assert_valid(out, drafts, vocab)
    if k > 0:
        assert int(outs[0].num_accepted[0]) == 0


@needs_interpreter
def test_sampling_given_randomness_equals_generator_draws():
    batch, k, vocab = 6, 3, 100
    drafts, p, q = random_case(batch, k, vocab, seed=11)
    uniforms, exponentials = sampling_randomness(batch, k, vocab, p.device, generator=torch.Generator().manual_seed(3))
    for fn in BACKENDS.values():
        a = fn(drafts, p, q, mode="sampling", uniforms=uniforms, exponentials=exponentials)
        b = fn(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(3))
        assert torch.equal(a.output_tokens, b.output_tokens)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,k,vocab", SHAPES)
def test_greedy_kernel_equals_twin(batch, k, vocab, dtype):
    gen = torch.Generator().manual_seed(batch + k)
    logits = torch.randn(batch, k + 1, vocab, generator=gen).to(dtype)
    drafts = logits.argmax(-1)[:, :k].clone()
    # break the prefix at various places; plus an out-of-vocab draft
    for b in range(batch):
        if k and b % 2 == 0:
            j = b % k
            drafts[b, j] = (drafts[b, j] + 1) % max(vocab, 2)
    if batch > 2 and k:
        drafts[2, 0] = vocab
    a = verify_drafts_triton(drafts, logits, mode="greedy")
    b = verify_drafts_torch(drafts, logits, mode="greedy")
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.output_tokens, b.output_tokens)
    assert_valid(a, drafts, vocab)


@needs_interpreter
def test_greedy_ties_take_first_index():
    logits = torch.zeros(2, 3, 130)
    logits[:, :, [5, 70, 129]] = 1.0  # ties across vocab tiles
    drafts = torch.tensor([[5, 5], [70, 5]])
    for fn in BACKENDS.values():
        out = fn(drafts, logits, mode="greedy")
        assert out.output_tokens.tolist() == [[5, 5, 5], [5, -1, -1]]


@needs_interpreter
def test_kernel_stub_cases():
    batch, k, vocab = 64, 3, 40
    drafts, p, _ = random_case(batch, k, vocab, seed=5)
    for q, name in ((p[:, :k].clone(), "equal"), (disjoint_from(p[:, :k]), "disjoint")):
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=torch.Generator().manual_seed(1)).view(batch, k)
        outs = [
            fn(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(2)) for fn in BACKENDS.values()
        ]
        assert torch.equal(outs[0].output_tokens, outs[1].output_tokens), name
        expected = k if name == "equal" else 0
        assert torch.all(outs[1].num_accepted == expected), name


@needs_interpreter
def test_forced_triton_dispatch_under_interpreter(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)
    drafts, p, q = random_case(4, 2, 50, seed=1)
    a = verify_drafts(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(0), backend="triton")
    b = verify_drafts(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(0), backend="torch")
    assert torch.equal(a.output_tokens, b.output_tokens)


# ---- greedy edge cases (both backends where the kernel can run) ----


def available_backends():
    return list(BACKENDS) if INTERPRETED else ["torch"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_edge_cases(backend):
    if backend not in available_backends():
        pytest.skip("kernel needs the interpreter; covered by test_interpreted_suite_in_subprocess")
    fn = BACKENDS[backend]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 77, generator=gen)
    target = logits.argmax(-1)  # (3, 5), k = 4
    # all accepted: bonus token is the argmax at position k
    out = fn(target[:, :4], logits, mode="greedy")
    assert out.num_accepted.tolist() == [4, 4, 4] and torch.equal(out.output_tokens, target)
    # none accepted: the correction is the argmax at position 0
    wrong = (target[:, :4] + 1) % 77
    out = fn(wrong, logits, mode="greedy")
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(out.output_tokens[:, 0], target[:, 0]) and torch.all(out.output_tokens[:, 1:] == -1)
    # k = 1
    out = fn(target[:, :1], logits[:, :2], mode="greedy")
    assert out.num_accepted.tolist() == [1, 1, 1] and torch.equal(out.output_tokens, target[:, :2])
    # probabilities instead of logits give the same result
    out2 = fn(target[:, :1], torch.softmax(logits[:, :2], -1), mode="greedy")
    assert torch.equal(out.output_tokens, out2.output_tokens)


def test_twin_doc_example_and_validation():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 1.0
    assert verify_drafts_torch(torch.tensor([[2, 3]]), logits).output_tokens.tolist() == [[2, 4, -1]]
    with pytest.raises(ValueError, match="mode"):
        verify_drafts_torch(torch.tensor([[2, 3]]), logits, mode="beam")
    with pytest.raises(ValueError, match="draft_probs"):
        verify_drafts_torch(torch.tensor([[2, 3]]), logits, mode="sampling")
    with pytest.raises(ValueError, match="target"):
        verify_drafts_torch(torch.tensor([[2, 3, 4]]), logits)


def test_cpu_dispatch(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors with backend='auto'")

    monkeypatch.setattr(kernels, "verify_drafts_triton", boom)
    drafts, p, q = random_case(4, 2, 20, seed=0)
    a = verify_drafts(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(0))
    b = verify_drafts_torch(drafts, p, q, mode="sampling", generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.output_tokens, b.output_tokens)


def test_forced_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    drafts, p, q = random_case(2, 2, 20, seed=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        verify_drafts(drafts, p, q, mode="sampling", backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        verify_drafts_triton(drafts, p, mode="greedy")


# ---- statistics ----


def disjoint_from(p):
    """A normalised q whose support is exactly where p is zero (plus token 0 if p has no zero)."""
    q = (p == 0).float()
    q[..., 0] += (q.sum(-1) == 0).float()
    return q / q.sum(-1, keepdim=True)


def check_distribution(samples, probs, what):
    """Bins within 6 sigma + 5, zero-probability bins empty, chi-square below mean + 6 sd."""
    probs = probs.double()
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts.numel() == probs.numel(), f"{what}: id out of range"
    expected = n * probs
    sigma = torch.sqrt(n * probs * (1 - probs))
    excess = (counts - expected).abs() - (6 * sigma + 5)
    assert torch.all(excess <= 0), f"{what}: counts {counts.tolist()} vs expected {expected.tolist()}"
    assert counts[probs == 0].sum() == 0, f"{what}: zero-probability token drawn"
    support = probs > 0
    df = int(support.sum()) - 1
    if df > 0:
        chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
        bound = df + 6 * math.sqrt(2 * df)
        assert chi2 < bound, f"{what}: chi-square {chi2:.1f} >= {bound:.1f} (df={df})"


V_STAT, K_STAT = 16, 2
P_STAT = torch.tensor(
    [
        [0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.06, 0.05, 0.05, 0.04, 0.04, 0.03, 0.03, 0.0, 0.0, 0.0],
        [0.0, 0.05, 0.05, 0.30, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.0, 0.0],
        [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.0, 0.0, 0.0],
    ]
)
Q_PARTIAL = torch.tensor(  # overlaps p, with mass where p is zero and zeros where p is not
    [
        [0.05, 0.30, 0.0, 0.10, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.0, 0.0, 0.10, 0.05, 0.05],
        [0.10, 0.05, 0.05, 0.10, 0.20, 0.10, 0.05, 0.05, 0.05, 0.05, 0.0, 0.0, 0.0, 0.05, 0.10, 0.05],
    ]
)


def stat_inputs(q_kind, rows, seed):
    p = P_STAT / P_STAT.sum(-1, keepdim=True)
    if q_kind == "partial":
        q = Q_PARTIAL / Q_PARTIAL.sum(-1, keepdim=True)
    elif q_kind == "equal":
        q = p[:K_STAT].clone()
    else:
        q = disjoint_from(p[:K_STAT])
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=gen) for j in range(K_STAT)], 1)
    # stride-0 batch views: no (rows, k+1, V) copies
    return drafts, p.expand(rows, -1, -1), q.expand(rows, -1, -1), p, q


def check_sampling_statistics(fn, q_kind, rows, seed, device="cpu"):
    drafts, p_rows, q_rows, p, q = stat_inputs(q_kind, rows, seed)
    gen = torch.Generator(device).manual_seed(seed + 1)
    out = fn(drafts.to(device), p_rows.to(device), q_rows.to(device), mode="sampling", generator=gen)
    out = type(out)(*(t.cpu() for t in out))
    assert_valid(out, drafts, V_STAT)
    # the first emitted token follows the target distribution at position 0, whatever q is
    check_distribution(out.output_tokens[:, 0], p[0], f"{q_kind}: first token")
    a = torch.minimum(p[:K_STAT], q).sum(-1).double()  # acceptance probability per position
    lengths = torch.stack([1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]])
    check_distribution(out.num_accepted, lengths, f"{q_kind}: accepted lengths")
    if q_kind == "equal":
        assert torch.all(out.num_accepted == K_STAT)
        check_distribution(out.output_tokens[:, K_STAT], p[K_STAT], "equal: bonus token")
    if q_kind == "disjoint":
        assert torch.all(out.num_accepted == 0)
    if q_kind == "partial":
        # after one accepted draft, the token at position 1 follows p_1 as well
        accepted = out.num_accepted >= 1
        check_distribution(out.output_tokens[accepted, 1], p[1], "partial: second token")


@pytest.mark.parametrize("q_kind", ["partial", "equal", "disjoint"])
def test_twin_sampling_statistics(q_kind):
    check_sampling_statistics(verify_drafts_torch, q_kind, rows=65536, seed=100)


@needs_interpreter
@pytest.mark.parametrize("q_kind", ["partial", "equal", "disjoint"])
def test_kernel_sampling_statistics(q_kind):
    check_sampling_statistics(verify_drafts_triton, q_kind, rows=50000, seed=200)


def test_twin_fallback_when_residual_is_zero():
    # p == q but the draft has q(x) = 0: rejected, the residual max(p - q, 0) is all zero -> sample from p
    rows = 30000
    p = P_STAT[:2] / P_STAT[:2].sum(-1, keepdim=True)
    p_rows, q_rows = p.unsqueeze(0).expand(rows, 2, V_STAT), p[:1].unsqueeze(0).expand(rows, 1, V_STAT)
    drafts = torch.full((rows, 1), 15)  # p(15) = q(15) = 0
    for fn in [BACKENDS[b] for b in available_backends()]:
        n = rows if fn is verify_drafts_torch else 5000
        out = fn(drafts[:n], p_rows[:n], q_rows[:n], mode="sampling", generator=torch.Generator().manual_seed(9))
        assert torch.all(out.num_accepted == 0)
        check_distribution(out.output_tokens[:, 0], p[0], "fallback")


# ---- GPU ----


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_gpu_kernel_equals_twin(mode):
    drafts, p, q = random_case(64, 4, 32003, seed=0, device="cuda")
    target = p if mode == "sampling" else torch.log(p + 1e-9).bfloat16()
    outs = [
        fn(drafts, target, q, mode=mode, generator=torch.Generator("cuda").manual_seed(1)) for fn in BACKENDS.values()
    ]
    assert torch.equal(outs[0].num_accepted, outs[1].num_accepted)
    assert torch.equal(outs[0].output_tokens, outs[1].output_tokens)


@gpu
@needs_cuda
def test_gpu_sampling_statistics():
    check_sampling_statistics(verify_drafts_triton, "partial", rows=65536, seed=300, device="cuda")
