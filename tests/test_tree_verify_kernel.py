"""Draft-tree verification: the torch twin against a naive per-row reference, its exact marginals, and the Triton
kernel against the twin (bit for bit).

* Twin vs :func:`naive_verify` (plain Python loops over one row at a time, totals by ``math.fsum``): greedy and both
  sampling modes on static, chain, star and random ragged trees (interleaved siblings, absent ``-1`` candidates,
  padding nodes). Tokens must be equal: the two normalise with different (correctly rounded vs fixed-point) totals,
  ~1e-16 apart, which could only matter for a uniform within ~1e-16 of its threshold or a race key that rounds to
  float32 differently; none does on these seeds.
* Exact marginals of the twin (fixed seeds, so deterministic): the first emitted token follows the root's ``p``, and
  the second, given that the path went through a depth-1 node, follows that node's ``p``; for candidates drawn
  without replacement from ``q`` and for deterministic ones. Bound: every bin within ``6 sigma + 5`` of ``n p``,
  zero-probability tokens never drawn, Pearson's chi-square below ``df + 6 sqrt(2 df)`` (mean + 6 sd).
* Kernel vs twin: equal tokens, paths and counts (greedy fp32 and bf16 logits; sampling with ``q`` and with
  deterministic candidates, fixed uniforms and exponentials), under Triton's interpreter in a child pytest (as in
  ``test_kernels_speculative_verify.py``), and on a GPU at real sizes (``gpu`` marker).
"""

import math

import numpy as np
import pytest
import torch
from kernel_harness import INTERPRETED, gpu, needs_cuda, needs_interpreter, run_interpreted_subprocess

import lightning_mtp.kernels as kernels
from lightning_mtp.kernels import tree_sampling_randomness, verify_tree, verify_tree_torch
from lightning_mtp.kernels.tree_verify import verify_tree_triton
from lightning_mtp.kernels.tree_verify_torch import exact_total, fixed_point_scale, max_children_of


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_interpreted_suite_in_subprocess():
    run_interpreted_subprocess(__file__)


# ---- trees and inputs ----


def static_parents(branching):
    """Parents of a static tree in breadth-first order (every node at depth d - 1 gets branching[d - 1] children)."""
    parents, frontier = [0], [0]
    for width in branching:
        level = [node for node in frontier for _ in range(width)]
        frontier = list(range(len(parents), len(parents) + len(level)))
        parents += level
    return parents


def random_parents(depth, max_children, gen, max_nodes=24):
    """A random tree: each node has 0..max_children children (the root at least one), a level's nodes in random
    order (siblings interleaved), parents always before children."""
    parents, frontier = [0], [0]
    for _ in range(depth):
        level = []
        for node in frontier:
            low = 1 if node == 0 else 0
            level += [node] * int(torch.randint(low, max_children + 1, (1,), generator=gen))
        level = [level[i] for i in torch.randperm(len(level), generator=gen).tolist()][: max_nodes - len(parents)]
        frontier = list(range(len(parents), len(parents) + len(level)))
        parents += level
    return parents


def random_probs(shape, gen, zeros):
    """Normalised random distributions with a fraction ``zeros`` of exact zeros (never an all-zero row)."""
    probs = torch.softmax(torch.randn(shape, generator=gen) * 2, dim=-1)
    probs = probs * (torch.rand(shape, generator=gen) > zeros)
    probs[..., 0] += 1e-3
    return probs / probs.sum(-1, keepdim=True)


def tree_case(batch, vocab, seed, trees="random", depth=3, max_children=3, kind="q", pad=1, absent=0.1):
    """(tokens, parents, depths, target, draft_probs) for ``batch`` rows of different trees.

    ``trees``: "random" (one random tree per row) or a branching tuple (the same static tree everywhere). ``pad``
    absent nodes (token -1, under the root) are appended to every row, so that rows of different sizes share T.
    Candidate tokens are distinct among siblings: drawn without replacement from the node's q (``kind="q"``), the
    q's top-k (``"topk"``: deterministic candidates), or random with the target argmax among them half of the time
    (``"greedy"``). A fraction ``absent`` of the draft nodes gets token -1.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = [random_parents(depth, max_children, gen) if trees == "random" else static_parents(trees)
            for _ in range(batch)]
    size = max(len(row) for row in rows) + pad
    target = random_probs((batch, size, vocab), gen, zeros=0.2)
    q = 0.5 * random_probs((batch, size, vocab), gen, zeros=0.3) + 0.5 * target
    q = q * (torch.rand(batch, size, vocab, generator=gen) > 0.2)
    q[..., 1] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    parents = torch.zeros(batch, size, dtype=torch.long)
    depths = torch.ones(batch, size, dtype=torch.long)  # padding nodes: depth 1, parent 0
    tokens = torch.full((batch, size), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        depths[b, 0] = 0
        tokens[b, 0] = int(torch.randint(vocab, (1,), generator=gen))
        for node in range(1, len(row)):
            parents[b, node] = row[node]
            depths[b, node] = depths[b, row[node]] + 1
        for node in range(len(row)):
            kids = [i for i in range(1, len(row)) if row[i] == node]
            if not kids:
                continue
            if kind == "q":
                draw = torch.multinomial(q[b, node], len(kids), replacement=False, generator=gen)
            elif kind == "topk":
                draw = q[b, node].topk(len(kids)).indices
            else:
                draw = torch.randperm(vocab, generator=gen)[: len(kids)]
                best = target[b, node].argmax()
                if bool(torch.rand(1, generator=gen) < 0.5) and not bool((draw == best).any()):
                    draw[int(torch.randint(len(kids), (1,), generator=gen))] = best
            tokens[b, kids] = draw
        holes = torch.rand(len(row), generator=gen) < absent
        holes[0] = False
        tokens[b, : len(row)][holes] = -1
    return tokens, parents, depths, target, q


def randomness(tokens, parents, depths, vocab, seed):
    depth = int(depths.max())
    return tree_sampling_randomness(tokens.shape[0], depth, max_children_of(parents), vocab, tokens.device,
                                    torch.Generator(tokens.device).manual_seed(seed))


def assert_same(a, b):
    assert torch.equal(a.num_accepted, b.num_accepted), (a.num_accepted, b.num_accepted)
    assert torch.equal(a.path, b.path), (a.path, b.path)
    assert torch.equal(a.output_tokens, b.output_tokens), (a.output_tokens, b.output_tokens)


def assert_valid(out, tokens, parents, depths, vocab):
    """Outputs are a real path of accepted drafts, then one token in the vocabulary, then -1."""
    batch, width = out.output_tokens.shape
    for b in range(batch):
        n = int(out.num_accepted[b])
        path = out.path[b].tolist()
        assert path[0] == 0 and all(parents[b, path[d]] == path[d - 1] for d in range(1, n + 1))
        assert all(node == path[n] for node in path[n:]) and int(depths[b, path[n]]) == n
        row = out.output_tokens[b].tolist()
        assert row[:n] == [int(tokens[b, node]) for node in path[1: n + 1]]
        assert 0 <= row[n] < vocab and all(t == -1 for t in row[n + 1:])


# ---- the naive reference: one row at a time, plain Python ----


def first_argmax(values):
    return max(range(len(values)), key=lambda v: (values[v], -v))


def normalised(values):
    total = math.fsum(values)
    return [v / total for v in values] if total > 0 else list(values)


def naive_verify(tokens, parents, depths, target, draft_probs, mode, uniforms=None, exponentials=None):
    """(num_accepted, path, output_tokens) as lists, following the rules of the twin's docstring literally."""
    batch, size, vocab = target.shape
    depth = int(depths.max())
    results = []
    for b in range(batch):
        toks, pars = tokens[b].tolist(), parents[b].tolist()
        children = {node: [i for i in range(1, size) if pars[i] == node] for node in range(size)}
        node, level = 0, 0
        while True:  # one level per iteration
            moved = None
            if mode == "greedy":
                best = first_argmax(target[b, node].tolist())
                if level < depth:
                    moved = next((c for c in children[node] if toks[c] == best), None)
            else:
                p = normalised(target[b, node].double().tolist())
                q = None if draft_probs is None else draft_probs[b, node].double().tolist()
                for rank, child in enumerate(children[node]):
                    x = toks[child]
                    if level >= depth or not 0 <= x < vocab:
                        continue
                    u = float(uniforms[b, level, rank])
                    if q is None:  # deterministic candidate: a point mass
                        if u < p[x]:
                            moved = child
                            break
                        p[x] = 0.0
                        p = normalised(p)
                    else:
                        q_i = normalised(q)
                        if q_i[x] > 0 and u * q_i[x] < p[x]:
                            moved = child
                            break
                        residual = [max(0.0, pv - qv) for pv, qv in zip(p, q_i)]
                        if max(residual) == 0:
                            residual = [0.0 if v == x else pv for v, pv in enumerate(p)]
                        p = normalised(residual)
                        q[x] = 0.0
            if moved is None:
                break
            node, level = moved, level + 1
        path = [node]
        while path[-1] != 0:
            path.append(pars[path[-1]])
        path = path[::-1]
        if mode == "greedy":
            next_token = first_argmax(target[b, node].tolist())
        else:  # exponential race, keys float32(p_v) / E_v
            e = exponentials[b].tolist()
            keys = [float(np.float32(pv) / np.float32(ev)) if pv > 0 else -1.0 for pv, ev in zip(p, e)]
            next_token = first_argmax(keys)
        n = len(path) - 1
        outputs = [toks[i] for i in path[1:]] + [next_token] + [-1] * (depth - n)
        results.append((n, path + [node] * (depth - n), outputs))
    return results


def assert_equals_naive(out, naive):
    for b, (n, path, outputs) in enumerate(naive):
        assert int(out.num_accepted[b]) == n, (b, out.num_accepted[b], n)
        assert out.path[b].tolist() == path, (b, out.path[b], path)
        assert out.output_tokens[b].tolist() == outputs, (b, out.output_tokens[b], outputs)


# ---- twin vs the naive reference ----

TREES = ["random", (3, 2, 1), (1, 1, 1, 1), (6,), (2, 2)]


@pytest.mark.parametrize("trees", TREES)
def test_twin_greedy_equals_naive(trees):
    tokens, parents, depths, target, _ = tree_case(24, 40, seed=1, trees=trees, kind="greedy")
    logits = torch.log(target + 1e-6)
    out = verify_tree_torch(tokens, parents, depths, logits, mode="greedy")
    assert_equals_naive(out, naive_verify(tokens, parents, depths, logits, None, "greedy"))
    assert_valid(out, tokens, parents, depths, 40)
    if trees == "random":
        assert 0 < int((out.num_accepted > 0).sum()) < 24 and int(out.num_accepted.max()) >= 2


@pytest.mark.parametrize("kind", ["q", "topk"])
@pytest.mark.parametrize("trees", TREES)
def test_twin_sampling_equals_naive(trees, kind):
    tokens, parents, depths, target, q = tree_case(32, 30, seed=2, trees=trees, kind=kind)
    draft_probs = q if kind == "q" else None
    uniforms, exponentials = randomness(tokens, parents, depths, 30, seed=3)
    out = verify_tree_torch(tokens, parents, depths, target, draft_probs, mode="sampling", uniforms=uniforms,
                            exponentials=exponentials)
    naive = naive_verify(tokens, parents, depths, target, draft_probs, "sampling", uniforms, exponentials)
    assert_equals_naive(out, naive)
    assert_valid(out, tokens, parents, depths, 30)
    assert int((out.num_accepted > 0).sum()) > 0


def test_twin_rejected_zero_mass_candidate_and_duplicates():
    """q == p at the root with candidates of zero mass (empty residual: p without x) and a repeated sibling."""
    vocab = 12
    target = random_probs((3, 4, vocab), torch.Generator().manual_seed(0), zeros=0.0)
    target[:, 0, 5] = 0.0
    target = target / target.sum(-1, keepdim=True)
    q = target.clone()
    tokens = torch.tensor([[0, 5, 5, 3], [0, 5, 2, 2], [0, 7, 7, 7]])
    parents = torch.zeros(3, 4, dtype=torch.long)
    depths = torch.tensor([[0, 1, 1, 1]] * 3)
    for seed in range(20):
        uniforms, exponentials = randomness(tokens, parents, depths, vocab, seed)
        for draft_probs in (q, None):
            out = verify_tree_torch(tokens, parents, depths, target, draft_probs, mode="sampling", uniforms=uniforms,
                                    exponentials=exponentials)
            assert_equals_naive(out, naive_verify(tokens, parents, depths, target, draft_probs, "sampling", uniforms,
                                                  exponentials))
            assert out.output_tokens[0, 0] != 5  # zero target mass: never emitted


def test_twin_validation_and_root_only():
    tokens, parents, depths, target, q = tree_case(2, 20, seed=0, trees=(2,), pad=0, absent=0.0)
    with pytest.raises(ValueError, match="mode"):
        verify_tree_torch(tokens, parents, depths, target, mode="beam")
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree_torch(tokens, parents, depths, target, q, mode="sampling", uniforms=torch.rand(2, 2, 1),
                          exponentials=torch.ones(2, 20))
    with pytest.raises(ValueError, match="exponentials"):
        verify_tree_torch(tokens, parents, depths, target, q, mode="sampling", uniforms=torch.rand(2, 2, 2),
                          exponentials=torch.ones(2, 19))
    # a tree that is only its root: the next token alone
    out = verify_tree_torch(tokens[:, :1], parents[:, :1], depths[:, :1], target[:, :1], mode="greedy")
    assert out.num_accepted.tolist() == [0, 0] and out.output_tokens[:, 0].tolist() == target[:, 0].argmax(-1).tolist()


def test_exact_total_is_order_free_and_accurate():
    """The normalising totals: the same bits in any order of the vocabulary, within V · 2^-K of math.fsum."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 1000, 128256):
        x = random_probs((3, vocab), gen, zeros=0.3).double()
        x[1] *= 1e-200  # tiny rows are scaled by their max, not lost
        x[2] = 0.0
        total = exact_total(x)
        perm = torch.randperm(vocab, generator=gen)
        assert torch.equal(total, exact_total(x[:, perm])) and torch.equal(total, exact_total(x.flip(1)))
        bound = vocab * 2.0 ** -fixed_point_scale(vocab)
        for row in range(2):
            exact = math.fsum(x[row].tolist())
            assert -1e-15 <= (exact - float(total[row])) / exact <= bound + 1e-15, (vocab, row)  # truncation: below
        assert float(total[2]) == 0.0


# ---- exact marginals of the twin ----


def check_distribution(samples, probs, what):
    """Bins within 6 sigma + 5, zero-probability bins empty, chi-square below mean + 6 sd."""
    probs = probs.double() / probs.double().sum()
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts.numel() == probs.numel(), f"{what}: id out of range"
    expected = n * probs
    sigma = torch.sqrt(n * probs * (1 - probs))
    assert torch.all((counts - expected).abs() <= 6 * sigma + 5), f"{what}: {counts.tolist()} vs {expected.tolist()}"
    assert counts[probs == 0].sum() == 0, f"{what}: zero-probability token drawn"
    support = probs > 0
    df = int(support.sum()) - 1
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    bound = df + 6 * math.sqrt(2 * df)
    assert chi2 < bound, f"{what}: chi-square {chi2:.1f} >= {bound:.1f} (df={df})"
    return n


V_STAT = 10
P_STAT = torch.tensor([  # target after the root, after node 1, after node 2 (rows 0-2), then leaves
    [0.25, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.05, 0.0, 0.0],
    [0.05, 0.05, 0.40, 0.0, 0.10, 0.10, 0.10, 0.10, 0.05, 0.05],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10],
])
Q_STAT = torch.tensor([  # draft distributions: overlapping p, with mass where p has none
    [0.05, 0.30, 0.0, 0.10, 0.05, 0.05, 0.05, 0.20, 0.10, 0.10],
    [0.30, 0.05, 0.20, 0.20, 0.05, 0.0, 0.05, 0.05, 0.05, 0.05],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10],
])
STAT_PARENTS = [0, 0, 0, 0, 1, 1, 2]  # root: 3 candidates; node 1: 2; node 2: 1


def stat_case(rows, kind, seed, device="cpu"):
    """Every row the same tree and distributions (node i > 2 uses row 2's); candidates drawn without replacement
    from q per row (``kind="q"``) or q's top-k in every row (``"topk"``, deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    size = len(STAT_PARENTS)
    rows_of_node = [0, 1, 2] + [2] * (size - 3)
    p, q = P_STAT[rows_of_node], Q_STAT[rows_of_node]  # (T, V)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    parents = torch.tensor(STAT_PARENTS).expand(rows, -1)
    depths = torch.tensor([0, 1, 1, 1, 2, 2, 2]).expand(rows, -1)
    tokens = torch.zeros(rows, size, dtype=torch.long)
    for node, kids in ((0, [1, 2, 3]), (1, [4, 5]), (2, [6])):
        if kind == "q":
            tokens[:, kids] = torch.multinomial(q[node].expand(rows, -1), len(kids), replacement=False, generator=gen)
        else:
            tokens[:, kids] = q[node].topk(len(kids)).indices
    draft_probs = q.expand(rows, -1, -1) if kind == "q" else None
    target = p.expand(rows, -1, -1)
    move = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    inputs = [move(t) for t in (tokens, parents, depths, target)] + [None if draft_probs is None else move(draft_probs)]
    return inputs, p


def check_marginals(fn, rows, kind, seed, device="cpu"):
    (tokens, parents, depths, target, draft_probs), p = stat_case(rows, kind, seed, device)
    out = fn(tokens, parents, depths, target, draft_probs, mode="sampling", max_depth=2,
             generator=torch.Generator(device).manual_seed(seed + 1))
    out = type(out)(*(t.cpu() for t in out))
    check_distribution(out.output_tokens[:, 0], p[0], f"{kind}: first token")
    for node in (1, 2):  # the token after a depth-1 node follows that node's target, whatever its siblings did
        through = out.path[:, 1] == node
        n = check_distribution(out.output_tokens[through, 1], p[node], f"{kind}: second token after node {node}")
        assert n > rows // 50, f"{kind}: only {n} rows went through node {node}"
    return out


@pytest.mark.parametrize("kind", ["q", "topk"])
def test_twin_sampling_marginals(kind):
    out = check_marginals(verify_tree_torch, 40000, kind, seed=100)
    assert int((out.num_accepted == 2).sum()) > 100


# ---- kernel vs twin (interpreter) ----

KERNEL_CASES = [  # batch, vocab, trees, depth, max_children
    (6, 70, "random", 3, 3),
    (4, 33, (3, 2, 1), 3, 3),
    (3, 130, (1, 1, 1, 1), 4, 1),
    (5, 40, "random", 2, 5),
    (2, 17, (), 0, 1),
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,vocab,trees,depth,max_children", KERNEL_CASES)
def test_greedy_kernel_equals_twin(batch, vocab, trees, depth, max_children, dtype):
    shape = dict(trees=trees, depth=depth, max_children=max_children, pad=0 if trees == () else 1)
    tokens, parents, depths, target, _ = tree_case(batch, vocab, seed=batch + vocab, kind="greedy", **shape)
    logits = torch.log(target + 1e-6).to(dtype)
    a = verify_tree_triton(tokens, parents, depths, logits, mode="greedy")
    b = verify_tree_torch(tokens, parents, depths, logits, mode="greedy")
    assert_same(a, b)
    assert_valid(a, tokens, parents, depths, vocab)


@needs_interpreter
@pytest.mark.parametrize("kind", ["q", "topk"])
@pytest.mark.parametrize("batch,vocab,trees,depth,max_children", KERNEL_CASES)
def test_sampling_kernel_equals_twin(batch, vocab, trees, depth, max_children, kind):
    shape = dict(trees=trees, depth=depth, max_children=max_children, pad=0 if trees == () else 1)
    tokens, parents, depths, target, q = tree_case(batch, vocab, seed=batch * vocab, kind=kind, **shape)
    draft_probs = q if kind == "q" else None
    uniforms, exponentials = randomness(tokens, parents, depths, vocab, seed=5)
    outs = [fn(tokens, parents, depths, target, draft_probs, mode="sampling", uniforms=uniforms,
               exponentials=exponentials) for fn in (verify_tree_triton, verify_tree_torch)]
    assert_same(*outs)
    assert_valid(outs[0], tokens, parents, depths, vocab)


@needs_interpreter
def test_sampling_kernel_equals_twin_on_many_rows():
    """16 random ragged trees per mode (the interpreter runs a row program in ~0.3 s), drawn by the generator inside
    the call: every row equal. The GPU test does 4 x 32 rows per mode at V = 32003."""
    for kind in ("q", "topk"):
        tokens, parents, depths, target, q = tree_case(16, 24, seed=7, depth=3, max_children=4, kind=kind)
        draft_probs = q if kind == "q" else None
        outs = [fn(tokens, parents, depths, target, draft_probs, mode="sampling", max_depth=3,
                   generator=torch.Generator().manual_seed(8)) for fn in (verify_tree_triton, verify_tree_torch)]
        assert_same(*outs)
        assert int((outs[0].num_accepted > 0).sum()) > 4


@needs_interpreter
def test_kernel_ties_and_empty_residual():
    # greedy ties across vocab tiles: the first index wins
    logits = torch.zeros(2, 3, 130)
    logits[:, :, [5, 70, 129]] = 1.0
    tokens = torch.tensor([[9, 5, 5], [9, 70, 5]])
    parents, depths = torch.tensor([[0, 0, 1]] * 2), torch.tensor([[0, 1, 2]] * 2)
    for fn in (verify_tree_triton, verify_tree_torch):
        assert fn(tokens, parents, depths, logits, mode="greedy").output_tokens.tolist() == [[5, 5, 5], [5, -1, -1]]
    # race ties (uniform p, equal exponentials) and zero-mass candidates with q == p (empty residual)
    vocab = 40
    target = torch.zeros(2, 3, vocab)
    target[:, :, 3:7] = 0.25
    tokens = torch.tensor([[0, 1, 2], [0, 5, 1]])
    parents, depths = torch.zeros(2, 3, dtype=torch.long), torch.tensor([[0, 1, 1]] * 2)
    uniforms = torch.full((2, 2, 2), 0.9, dtype=torch.float64)
    exponentials = torch.ones(2, vocab)
    for draft_probs in (target.clone(), None):
        outs = [fn(tokens, parents, depths, target, draft_probs, mode="sampling", uniforms=uniforms,
                   exponentials=exponentials) for fn in (verify_tree_triton, verify_tree_torch)]
        assert_same(*outs)
        assert outs[0].output_tokens[0].tolist() == [3, -1]  # both rejected (no mass): first of the tied support


@needs_interpreter
def test_forced_triton_dispatch_under_interpreter(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)
    tokens, parents, depths, target, q = tree_case(3, 50, seed=4)
    outs = [verify_tree(tokens, parents, depths, target, q, mode="sampling", generator=torch.Generator().manual_seed(0),
                        backend=backend) for backend in ("triton", "torch")]
    assert_same(*outs)


# ---- dispatch without the interpreter ----


def test_cpu_dispatch_uses_the_twin(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors with backend='auto'")

    monkeypatch.setattr(kernels, "verify_tree_triton", boom)
    tokens, parents, depths, target, q = tree_case(3, 20, seed=0)
    outs = [fn(tokens, parents, depths, target, q, mode="sampling", generator=torch.Generator().manual_seed(0))
            for fn in (verify_tree, verify_tree_torch)]
    assert_same(*outs)


def test_forced_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tokens, parents, depths, target, _ = tree_case(2, 20, seed=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        verify_tree(tokens, parents, depths, target, mode="greedy", backend="triton")


# ---- GPU ----


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["greedy", "q", "topk"])
def test_gpu_kernel_equals_twin(mode):
    kind = "greedy" if mode == "greedy" else mode
    tokens, parents, depths, target, q = tree_case(32, 32003, seed=0, depth=4, max_children=4, kind=kind)
    tokens, parents, depths, target, q = (t.cuda() for t in (tokens, parents, depths, target, q))
    if mode == "greedy":
        for logits in (torch.log(target + 1e-9).bfloat16(), target):
            assert_same(verify_tree_triton(tokens, parents, depths, logits, mode="greedy"),
                        verify_tree_torch(tokens, parents, depths, logits, mode="greedy"))
        return
    draft_probs = q if mode == "q" else None
    for seed in range(4):
        outs = [fn(tokens, parents, depths, target, draft_probs, mode="sampling", max_depth=4,
                   generator=torch.Generator("cuda").manual_seed(seed))
                for fn in (verify_tree_triton, verify_tree_torch)]
        assert_same(*outs)


@gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["q", "topk"])
def test_gpu_kernel_sampling_marginals(kind):
    check_marginals(verify_tree_triton, 40000, kind, seed=300, device="cuda")
