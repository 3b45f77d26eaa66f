"""Fused linear + cross-entropy: Triton kernel vs its torch twin, and backend dispatch.

How the interpreter is handled: with triton 3.9, Triton's interpreter only works when ``TRITON_INTERPRET=1`` is in the
environment before ``triton.language`` is first imported, and other test files import torch/lightning_mtp (hence
triton) first. So the kernel tests are marked ``needs_interpreter`` and skipped in the normal pytest process, and
:func:`test_interpreted_suite_in_subprocess` re-runs this file in a child pytest with ``TRITON_INTERPRET=1`` set, where
they run (and that test skips itself). Running pytest with ``TRITON_INTERPRET=1`` already set runs them in-process.

Logit scaling and soft-capping (``logit_scale``, ``softcap``: Cohere, Granite, Gemma-2) are checked against a
naive reference that materialises the logits, transforms them and calls ``F.cross_entropy``: the twin in the normal
process, the kernel under the interpreter.

Tolerances (fp32): atol 1e-5 / rtol 5e-4. Logits come from the same matmul in both backends; the kernel differs from
``torch.logsumexp`` only in summation order (tiled online logsumexp), a few fp32 ulps on losses and gradients.
bf16 is checked on GPU only (``gpu`` marker): dlogits are stored in bf16 by the kernel (fp32 in the twin), so
gradients there agree to bf16 precision.
"""

import contextlib
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import INTERPRETED, gpu, needs_cuda, needs_interpreter, run_interpreted_subprocess

import lightning_mtp.kernels as kernels
from lightning_mtp.kernels import linear_cross_entropy, linear_cross_entropy_torch
from lightning_mtp.kernels.linear_cross_entropy import linear_cross_entropy_triton
from lightning_mtp.kernels.linear_cross_entropy_torch import scale_and_cap
from lightning_mtp.zero import head_cross_entropy

ATOL, RTOL = 1e-5, 5e-4

# benchmarks/memory.py: peak CPU tensor memory from the C allocator (benchmarks/ is not a package)
_spec = importlib.util.spec_from_file_location(
    "benchmarks_memory", Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py"
)
_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_memory)
PeakMemory = _memory.PeakMemory
# The submodules share their names with functions of the package (kernels/__init__.py): import them by full name.
twin_module = importlib.import_module("lightning_mtp.kernels.linear_cross_entropy_torch")
kernel_module = importlib.import_module("lightning_mtp.kernels.linear_cross_entropy")


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_interpreted_suite_in_subprocess():
    run_interpreted_subprocess(__file__)


def make_inputs(n, h, v, *, seed=0, dtype=torch.float32, device="cpu", ignored=(), weighted=False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(device, dtype)
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[list(ignored)] = -100
    row_weights = torch.rand(n, generator=gen).to(device) if weighted else None
    return hidden, weight, targets.to(device), row_weights


def run(fn, hidden, weight, targets, row_weights, chunk_size, grad_scale=2.0, **kwargs):
    """Forward + backward of ``grad_scale * loss``; returns outputs and gradients."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    out = fn(hidden, weight, targets, row_weights, -100, chunk_size, **kwargs)
    (out.loss * grad_scale).backward()
    return out, hidden.grad, weight.grad


def assert_matches_twin(
    hidden, weight, targets, row_weights, chunk_size, atol=ATOL, rtol=RTOL, exact_argmax=True, **transform):
    kw = dict(transform)
    out_k, gh_k, gw_k = run(linear_cross_entropy_triton, hidden, weight, targets, row_weights, chunk_size, **kw)
    out_t, gh_t, gw_t = run(linear_cross_entropy_torch, hidden, weight, targets, row_weights, chunk_size, **kw)
    torch.testing.assert_close(out_k.loss, out_t.loss, atol=atol, rtol=rtol)
    torch.testing.assert_close(out_k.row_loss, out_t.row_loss, atol=atol, rtol=rtol)
    assert out_k.row_loss.dtype == torch.float32 and out_k.row_argmax.dtype == torch.long
    assert not out_k.row_loss.requires_grad and not out_k.row_argmax.requires_grad
    if exact_argmax:
        assert torch.equal(out_k.row_argmax, out_t.row_argmax)
    else:  # bf16 logits have ties; any maximal index is fine
        assert (out_k.row_argmax != out_t.row_argmax).float().mean() < 0.01
    assert int(out_k.row_argmax.max()) < weight.shape[0]
    torch.testing.assert_close(gh_k, gh_t, atol=atol, rtol=rtol)
    torch.testing.assert_close(gw_k, gw_t, atol=atol, rtol=rtol)
    assert gh_k.dtype == hidden.dtype and gw_k.dtype == weight.dtype
    return out_k


# N=37 rows, H=24: odd shapes; V=257 and 1000 are not multiples of the interpreter's 64-wide vocab tile.
CASES = {
    "v257-mean-chunk8": dict(n=37, h=24, v=257, chunk=8, ignored=(3, 10, 11), weighted=False),
    "v257-weighted-chunk8": dict(n=37, h=24, v=257, chunk=8, ignored=(0, 36), weighted=True),
    "v1000-weighted-ignored-chunk16": dict(n=37, h=24, v=1000, chunk=16, ignored=tuple(range(16, 32)), weighted=True),
    "v1000-mean-one-chunk": dict(n=37, h=24, v=1000, chunk=None, ignored=(5,), weighted=False),
    "v128-exact-tiles-chunk7": dict(n=20, h=16, v=128, chunk=7, ignored=(), weighted=False),
    "v1-single-token": dict(n=5, h=8, v=1, chunk=2, ignored=(1,), weighted=True),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_twin(case):
    cfg = CASES[case]
    hidden, weight, targets, row_weights = make_inputs(
        cfg["n"], cfg["h"], cfg["v"], ignored=cfg["ignored"], weighted=cfg["weighted"], seed=len(case)
    )
    out = assert_matches_twin(hidden, weight, targets, row_weights, cfg["chunk"])
    ignored = torch.tensor(cfg["ignored"], dtype=torch.long)
    if len(ignored):
        assert torch.all(out.row_loss[ignored] == 0)


@needs_interpreter
def test_bf16_matches_twin_interpreted():
    # bf16 loads are cast to fp32 in the kernel, which the interpreter handles; dlogits are stored in bf16 (the twin
    # keeps fp32 for the weight gradient), so gradients agree to bf16 precision.
    hidden, weight, targets, row_weights = make_inputs(37, 24, 300, dtype=torch.bfloat16, ignored=(3,), weighted=True)
    out_k, gh_k, gw_k = run(linear_cross_entropy_triton, hidden, weight, targets, row_weights, 8)
    out_t, gh_t, gw_t = run(linear_cross_entropy_torch, hidden, weight, targets, row_weights, 8)
    torch.testing.assert_close(out_k.row_loss, out_t.row_loss, atol=1e-4, rtol=1e-4)
    assert gh_k.dtype == gw_k.dtype == torch.bfloat16
    for got, want in ((gh_k, gh_t), (gw_k, gw_t)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(want.float().abs().max()), rtol=2e-2)


@needs_interpreter
def test_matches_plain_cross_entropy():
    hidden, weight, targets, _ = make_inputs(23, 16, 300, ignored=(2, 7), seed=3)
    out = linear_cross_entropy_triton(hidden, weight, targets, chunk_size=5)
    reference = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
    torch.testing.assert_close(out.loss, reference, atol=ATOL, rtol=RTOL)
    assert torch.equal(out.row_argmax, (hidden @ weight.T).argmax(-1))


@needs_interpreter
def test_all_rows_ignored():
    hidden, weight, targets, _ = make_inputs(9, 8, 70, ignored=range(9))
    for row_weights in (None, torch.ones(9)):
        out, grad_hidden, grad_weight = run(linear_cross_entropy_triton, hidden, weight, targets, row_weights, 4)
        assert float(out.loss.detach()) == 0.0 and torch.all(out.row_loss == 0)
        assert torch.all(grad_hidden == 0) and torch.all(grad_weight == 0)
        assert torch.equal(out.row_argmax, (hidden @ weight.T).argmax(-1))


@needs_interpreter
@pytest.mark.parametrize("grads", ["none", "hidden", "weight"])
def test_partial_requires_grad(grads):
    hidden, weight, targets, row_weights = make_inputs(13, 8, 100, ignored=(4,), weighted=True, seed=5)
    h_k, w_k = hidden.clone().requires_grad_(grads == "hidden"), weight.clone().requires_grad_(grads == "weight")
    h_t, w_t = hidden.clone().requires_grad_(grads == "hidden"), weight.clone().requires_grad_(grads == "weight")
    out_k = linear_cross_entropy_triton(h_k, w_k, targets, row_weights, chunk_size=4)
    out_t = linear_cross_entropy_torch(h_t, w_t, targets, row_weights, chunk_size=4)
    torch.testing.assert_close(out_k.row_loss, out_t.row_loss, atol=ATOL, rtol=RTOL)
    if grads == "none":
        assert not out_k.loss.requires_grad
        return
    out_k.loss.backward()
    out_t.loss.backward()
    leaf_k, leaf_t = (h_k, h_t) if grads == "hidden" else (w_k, w_t)
    torch.testing.assert_close(leaf_k.grad, leaf_t.grad, atol=ATOL, rtol=RTOL)


@needs_interpreter
def test_forced_triton_on_cpu_under_interpreter(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)
    hidden, weight, targets, row_weights = make_inputs(11, 8, 90, ignored=(1,), weighted=True)
    called, spy = [], linear_cross_entropy_triton
    monkeypatch.setattr(kernels, "linear_cross_entropy_triton", lambda *a, **kw: called.append(1) or spy(*a, **kw))
    out = linear_cross_entropy(hidden, weight, targets, row_weights, -100, 4, backend="triton")
    assert called == [1]
    reference = linear_cross_entropy_torch(hidden, weight, targets, row_weights, -100, 4)
    torch.testing.assert_close(out.loss, reference.loss, atol=ATOL, rtol=RTOL)
    monkeypatch.setenv("LIGHTNING_MTP_KERNELS", "triton")  # the environment forces it too
    linear_cross_entropy(hidden, weight, targets, row_weights, -100, 4)
    assert called == [1, 1]


# ---- no gradient work when autograd will not run (validation under no_grad / inference_mode) ----

# Shapes where the buffers tell themselves apart, and few rows and vocabulary tiles (the interpreter runs one program
# per row, 64 vocabulary entries at a time). WIDE: the (V, H) fp32 weight gradient is 8 MiB, a chunk of logits 4 KiB,
# so a forward's peak allocation is far below V × H × 4 bytes. TALL: the (N, H) hidden gradient is 4 MiB, the weight
# gradient 256 KiB.
WIDE = dict(n=8, h=8192, v=256, chunk=4)
TALL = dict(n=64, h=16384, v=4, chunk=32)
NO_GRAD_CONTEXTS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def peak_call(fn, hidden, weight, targets, chunk, context=contextlib.nullcontext, **kwargs):
    """``fn``'s output and the peak bytes it allocated (on CPU, from the C allocator)."""
    fn(hidden, weight, targets, None, -100, chunk, **kwargs)  # warm-up: lazy buffers (interpreter, BLAS) don't count
    with context(), PeakMemory() as peak:
        out = fn(hidden, weight, targets, None, -100, chunk, **kwargs)
    return out, peak.peak_bytes


def assert_forward_only_without_grad(fn, context, **transform):
    hidden, weight, targets, _ = make_inputs(WIDE["n"], WIDE["h"], WIDE["v"], ignored=(3,), seed=8)
    hidden, weight = hidden.requires_grad_(), torch.nn.Parameter(weight)  # a Parameter stays requires_grad=True
    weight_grad_bytes = weight.numel() * 4
    out, peak = peak_call(fn, hidden, weight, targets, WIDE["chunk"], NO_GRAD_CONTEXTS[context], **transform)
    assert peak < weight_grad_bytes / 4, f"peak {peak} B: a gradient buffer was allocated under {context}"
    assert not out.loss.requires_grad
    with_grad, grad_peak = peak_call(fn, hidden, weight, targets, WIDE["chunk"], **transform)
    assert grad_peak >= weight_grad_bytes  # the observable tells the two apart: the fp32 weight gradient
    assert torch.equal(out.loss, with_grad.loss.detach())
    assert torch.equal(out.row_loss, with_grad.row_loss) and torch.equal(out.row_argmax, with_grad.row_argmax)


def assert_only_wanted_gradient(fn, grads):
    """Only ``hidden`` requires grad: no (V, H) weight-gradient buffer; only ``weight``: no (N, H) hidden one."""
    shape = WIDE if grads == "hidden" else TALL
    hidden, weight, targets, row_weights = make_inputs(shape["n"], shape["h"], shape["v"], ignored=(1,), seed=9)
    h, w = hidden.clone().requires_grad_(grads == "hidden"), weight.clone().requires_grad_(grads == "weight")
    out, peak = peak_call(fn, h, w, targets, shape["chunk"])
    unwanted = (weight if grads == "hidden" else hidden).numel() * 4
    assert peak < unwanted / 4, f"peak {peak} B: the gradient of the input that does not require grad was computed"
    out.loss.backward()
    _, reference_hidden, reference_weight = run(fn, hidden, weight, targets, None, shape["chunk"], grad_scale=1.0)
    leaf, other, reference = (h, w, reference_hidden) if grads == "hidden" else (w, h, reference_weight)
    assert other.grad is None
    torch.testing.assert_close(leaf.grad, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("context", list(NO_GRAD_CONTEXTS))
def test_twin_without_grad_is_forward_only(context, monkeypatch):
    scored = []
    score_chunk = twin_module._score_chunk
    monkeypatch.setattr(twin_module, "_score_chunk", lambda *a: scored.append(a[-1]) or score_chunk(*a))
    with NO_GRAD_CONTEXTS[context]():
        linear_cross_entropy_torch(*make_inputs(9, 8, 50)[:3], chunk_size=4)
    assert scored == [False, False, False]  # no chunk computed d(logits)
    monkeypatch.undo()
    assert_forward_only_without_grad(linear_cross_entropy_torch, context)
    assert_forward_only_without_grad(linear_cross_entropy_torch, context, logit_scale=0.5, softcap=2.0)
    assert_forward_only_without_grad(linear_cross_entropy, context, backend="torch")  # the dispatcher


@pytest.mark.parametrize("grads", ["hidden", "weight"])
def test_twin_computes_only_the_wanted_gradient(grads):
    assert_only_wanted_gradient(linear_cross_entropy_torch, grads)


@needs_interpreter
@pytest.mark.parametrize("context", list(NO_GRAD_CONTEXTS))
def test_kernel_without_grad_is_forward_only(context, monkeypatch):
    launched = []
    monkeypatch.setattr(kernel_module, "fused_chunked_pass",
                        lambda *a, pass_=kernel_module.fused_chunked_pass: launched.append(a[6:8]) or pass_(*a))
    with NO_GRAD_CONTEXTS[context]():
        linear_cross_entropy_triton(*make_inputs(9, 8, 50)[:3], chunk_size=4)
    assert launched == [(False, False)]  # COMPUTE_GRAD=False: no d(logits), no gradient buffer
    monkeypatch.undo()
    assert_forward_only_without_grad(linear_cross_entropy_triton, context)
    assert_forward_only_without_grad(linear_cross_entropy_triton, context, logit_scale=0.5, softcap=2.0)


@needs_interpreter
@pytest.mark.parametrize("grads", ["hidden", "weight"])
def test_kernel_computes_only_the_wanted_gradient(grads):
    assert_only_wanted_gradient(linear_cross_entropy_triton, grads)


@pytest.mark.parametrize("context", list(NO_GRAD_CONTEXTS))
def test_zero3_head_path_without_grad_is_a_plain_forward(context, monkeypatch):
    # The ZeRO-3 path (head module calls) checkpoints each chunk only when backward will run.
    import lightning_mtp.zero as zero

    hidden, weight, targets, _ = make_inputs(WIDE["n"], WIDE["h"], WIDE["v"], ignored=(3,), seed=8)
    head = torch.nn.Linear(WIDE["h"], WIDE["v"], bias=False)
    head.weight.data.copy_(weight)
    hidden.requires_grad_()
    checkpointed = []
    checkpoint = zero.checkpoint
    monkeypatch.setattr(zero, "checkpoint", lambda *a, **kw: checkpointed.append(1) or checkpoint(*a, **kw))
    call = lambda: head_cross_entropy(hidden, head, targets, chunk_size=WIDE["chunk"])  # noqa: E731
    with NO_GRAD_CONTEXTS[context]():
        out = call()
        with PeakMemory() as peak:
            call()
    assert checkpointed == [] and not out.loss.requires_grad
    assert peak.peak_bytes < weight.numel()  # a quarter of the fp32 weight gradient
    with_grad = call()
    assert len(checkpointed) == 2  # one per chunk
    assert torch.equal(out.row_argmax, with_grad.row_argmax)
    torch.testing.assert_close(out.loss, with_grad.loss.detach(), atol=ATOL, rtol=RTOL)
    reference = linear_cross_entropy_torch(hidden.detach(), weight, targets, chunk_size=WIDE["chunk"])
    torch.testing.assert_close(out.row_loss, reference.row_loss, atol=ATOL, rtol=RTOL)


# ---- logit scaling and soft-capping against materialised logits ----

# (logit_scale, softcap). Logits here have a std of about 1.5, so a cap of 2 bends most of them and saturates some;
# a negative scale reverses the argmax.
TRANSFORMS = {
    "scale": (0.25, None),
    "softcap": (1.0, 2.0),
    "scale-and-softcap": (3.0, 2.0),
    "negative-scale-and-softcap": (-0.5, 1.5),
}


def naive_transformed_loss(hidden, weight, targets, row_weights, logit_scale, softcap):
    """Materialised logits (N, V), transformed, then ``F.cross_entropy``: loss, per-row CE and argmax."""
    logits = scale_and_cap(hidden.float() @ weight.float().T, logit_scale, softcap)  # (N, V)
    valid = targets != -100
    rows = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)  # (N,), 0 where ignored
    weights = row_weights if row_weights is not None else valid.float() / valid.sum().clamp(min=1)
    return (rows * weights * valid).sum(), rows.detach(), logits.argmax(-1)


def assert_matches_naive_reference(fn, transform, **kwargs):
    logit_scale, softcap = TRANSFORMS[transform]
    hidden, weight, targets, row_weights = make_inputs(37, 24, 257, ignored=(0, 9, 10), weighted=True, seed=4)
    out, grad_hidden, grad_weight = run(fn, hidden, weight, targets, row_weights, 8, logit_scale=logit_scale,
                                        softcap=softcap, **kwargs)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, rows, argmax = naive_transformed_loss(h, w, targets, row_weights, logit_scale, softcap)
    ref_hidden, ref_weight = torch.autograd.grad(2.0 * loss, [h, w])  # run() backpropagates 2 * loss
    untransformed = naive_transformed_loss(hidden, weight, targets, row_weights, 1.0, None)[0]
    assert abs(float(untransformed - loss.detach())) > 0.1  # the transform matters at these shapes
    torch.testing.assert_close(out.loss, loss.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.row_loss, rows, atol=ATOL, rtol=RTOL)
    assert torch.equal(out.row_argmax, argmax)
    torch.testing.assert_close(grad_hidden, ref_hidden, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(grad_weight, ref_weight, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_twin_scales_and_caps_logits_like_the_naive_reference(transform):
    assert_matches_naive_reference(linear_cross_entropy_torch, transform)
    assert_matches_naive_reference(linear_cross_entropy, transform, backend="torch")  # the dispatcher


@needs_interpreter
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_kernel_scales_and_caps_logits_like_the_naive_reference(transform):
    assert_matches_naive_reference(linear_cross_entropy_triton, transform)
    logit_scale, softcap = TRANSFORMS[transform]
    hidden, weight, targets, row_weights = make_inputs(29, 16, 300, ignored=(3,), weighted=True, seed=6)
    assert_matches_twin(hidden, weight, targets, row_weights, 6, logit_scale=logit_scale, softcap=softcap)


@needs_interpreter
def test_forced_triton_dispatch_passes_the_logit_transform():
    hidden, weight, targets, row_weights = make_inputs(11, 8, 90, ignored=(1,), weighted=True)
    out = linear_cross_entropy(hidden, weight, targets, row_weights, -100, 4, backend="triton", logit_scale=0.5,
                               softcap=1.0)
    reference = naive_transformed_loss(hidden, weight, targets, row_weights, 0.5, 1.0)[0]
    torch.testing.assert_close(out.loss, reference, atol=ATOL, rtol=RTOL)


def test_bad_logit_transform_names_the_argument():
    hidden, weight, targets, _ = make_inputs(4, 8, 16)
    for fn in (linear_cross_entropy_torch, linear_cross_entropy_triton):  # checked before any launch
        with pytest.raises(ValueError, match="softcap must be None or a finite number > 0, got 0.0"):
            fn(hidden, weight, targets, softcap=0.0)
        with pytest.raises(ValueError, match="logit_scale must be a finite number, got inf"):
            fn(hidden, weight, targets, logit_scale=float("inf"))


# ---- dispatch (no kernel launch: runs in the normal process) ----


def test_cpu_auto_uses_torch_twin(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run for CPU tensors with backend='auto'")

    monkeypatch.setattr(kernels, "linear_cross_entropy_triton", boom)
    hidden, weight, targets, row_weights = make_inputs(6, 8, 32, ignored=(2,), weighted=True)
    out = linear_cross_entropy(hidden, weight, targets, row_weights, -100, None)  # the loss code's call
    reference = linear_cross_entropy_torch(hidden, weight, targets, row_weights)
    assert torch.equal(out.loss, reference.loss)
    monkeypatch.setenv("LIGHTNING_MTP_KERNELS", "torch")
    linear_cross_entropy(hidden, weight, targets, backend="auto")
    linear_cross_entropy(hidden, weight, targets, backend="torch")


def test_forced_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets, _ = make_inputs(4, 8, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        linear_cross_entropy(hidden, weight, targets, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        linear_cross_entropy_triton(hidden, weight, targets)
    monkeypatch.setenv("LIGHTNING_MTP_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        linear_cross_entropy(hidden, weight, targets)


def test_invalid_backend(monkeypatch):
    hidden, weight, targets, _ = make_inputs(4, 8, 16)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(hidden, weight, targets, backend="cuda")
    monkeypatch.setenv("LIGHTNING_MTP_KERNELS", "fast")
    with pytest.raises(ValueError, match="LIGHTNING_MTP_KERNELS"):
        linear_cross_entropy(hidden, weight, targets)


def test_input_validation():
    hidden, weight, targets, _ = make_inputs(4, 8, 16)
    with pytest.raises(ValueError):
        linear_cross_entropy_triton(hidden, weight[:, :4], targets)
    with pytest.raises(ValueError):
        linear_cross_entropy_triton(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="dtype"):
        linear_cross_entropy_triton(hidden, weight.double(), targets)


# ---- GPU (compiled kernels, autotuning with restore_value, bf16) ----


@gpu
@needs_cuda
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_fp32_matches_twin(weighted):
    hidden, weight, targets, row_weights = make_inputs(
        1000, 256, 32003, device="cuda", ignored=range(100, 400), weighted=weighted
    )
    # cuBLAS may pick another algorithm for the kernel's scratch-buffer matmul: logits can differ by ulps, so an
    # argmax may flip on a near-tie
    out = assert_matches_twin(
        hidden, weight, targets, row_weights, 256, atol=2e-5, rtol=1e-3, exact_argmax=False
    )
    assert int(out.row_argmax.max()) < 32003


@gpu
@needs_cuda
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_bf16_matches_twin(weighted):
    hidden, weight, targets, row_weights = make_inputs(
        777, 512, 50257, dtype=torch.bfloat16, device="cuda", ignored=range(0, 300), weighted=weighted
    )
    out_k, gh_k, gw_k = run(linear_cross_entropy_triton, hidden, weight, targets, row_weights, 200)
    out_t, gh_t, gw_t = run(linear_cross_entropy_torch, hidden, weight, targets, row_weights, 200)
    # logits are the same bf16 matmul in both; losses differ only by fp32 summation order
    torch.testing.assert_close(out_k.loss, out_t.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_k.row_loss, out_t.row_loss, atol=1e-4, rtol=1e-4)
    assert (out_k.row_argmax != out_t.row_argmax).float().mean() < 0.01  # bf16 logits tie often
    assert gh_k.dtype == torch.bfloat16 and gw_k.dtype == torch.bfloat16
    for got, want in ((gh_k, gh_t), (gw_k, gw_t)):
        scale = want.float().abs().max()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * float(scale), rtol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_softcap_matches_twin(dtype):
    hidden, weight, targets, row_weights = make_inputs(
        777, 256, 32003, dtype=dtype, device="cuda", ignored=range(0, 100), weighted=True
    )
    kw = dict(logit_scale=1.5, softcap=2.0)
    out_k, gh_k, gw_k = run(linear_cross_entropy_triton, hidden, weight, targets, row_weights, 200, **kw)
    out_t, gh_t, gw_t = run(linear_cross_entropy_torch, hidden, weight, targets, row_weights, 200, **kw)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-4
    torch.testing.assert_close(out_k.row_loss, out_t.row_loss, atol=tolerance, rtol=tolerance)
    for got, want in ((gh_k, gh_t), (gw_k, gw_t)):
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2)


@gpu
@needs_cuda
def test_gpu_auto_dispatch_uses_kernel(monkeypatch):
    monkeypatch.delenv("LIGHTNING_MTP_KERNELS", raising=False)
    called, spy = [], linear_cross_entropy_triton
    monkeypatch.setattr(kernels, "linear_cross_entropy_triton", lambda *a, **kw: called.append(1) or spy(*a, **kw))
    hidden, weight, targets, _ = make_inputs(64, 32, 1000, device="cuda")
    linear_cross_entropy(hidden, weight, targets)
    assert called == [1]


# ---- a list of parts (one per depth): no concatenated copy, a gradient per part, one weight-gradient buffer ----

PART_ROWS = (13, 1, 20)  # odd sizes, one of a single row


def naive_parts_reference(parts, weight, targets, row_weights):
    """Materialised logits of the concatenated rows, ``F.cross_entropy``; loss, per-row CE, argmax, and the gradients
    of 2 * loss w.r.t. every part and the weight."""
    leaves = [p.clone().requires_grad_() for p in parts]
    w = weight.clone().requires_grad_()
    logits = torch.cat(leaves).float() @ w.float().T  # (N, V)
    rows = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    valid = targets != -100
    weights = row_weights if row_weights is not None else valid.float() / valid.sum().clamp(min=1)
    loss = (rows * weights * valid).sum()
    grads = torch.autograd.grad(2.0 * loss, [*leaves, w])
    return loss.detach(), rows.detach(), logits.argmax(-1), grads[:-1], grads[-1]


def assert_parts_match_naive_reference(fn, overwrite_hidden, chunk_size):
    hidden, weight, targets, row_weights = make_inputs(sum(PART_ROWS), 24, 257, ignored=(0, 14, 20), weighted=True,
                                                       seed=11)
    leaves = [p.clone().requires_grad_() for p in hidden.split(PART_ROWS)]
    w = weight.clone().requires_grad_()
    parts = [leaf * 1.0 for leaf in leaves]  # non-leaf parts, as a depth's normed states are
    out = fn(parts, w, targets, row_weights, -100, chunk_size, overwrite_hidden=overwrite_hidden)
    (2.0 * out.loss).backward()
    loss, rows, argmax, part_grads, weight_grad = naive_parts_reference(hidden.split(PART_ROWS), weight, targets,
                                                                         row_weights)
    torch.testing.assert_close(out.loss, loss, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.row_loss, rows, atol=ATOL, rtol=RTOL)
    assert torch.equal(out.row_argmax, argmax)
    for leaf, grad in zip(leaves, part_grads):
        torch.testing.assert_close(leaf.grad, grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w.grad, weight_grad, atol=ATOL, rtol=RTOL)
    # With overwrite_hidden each part received its own gradient in place (no (N, H) buffer); otherwise it is intact.
    for part, leaf, grad in zip(parts, leaves, part_grads):
        if overwrite_hidden:
            torch.testing.assert_close(part, grad, atol=ATOL, rtol=RTOL)
        else:
            assert torch.equal(part, leaf.detach())


@pytest.mark.parametrize("overwrite_hidden", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_twin_scores_parts_like_the_naive_reference(overwrite_hidden, chunk_size):
    assert_parts_match_naive_reference(linear_cross_entropy_torch, overwrite_hidden, chunk_size)


@needs_interpreter
@pytest.mark.parametrize("overwrite_hidden", [False, True])
def test_kernel_scores_parts_like_the_naive_reference(overwrite_hidden):
    assert_parts_match_naive_reference(linear_cross_entropy_triton, overwrite_hidden, 4)


def test_each_part_is_chunked_by_its_own_rows(monkeypatch):
    """The default chunk size comes from each part's row count, not from all rows together (which would make every
    depth's chunk of logits as large as the rows of all depths ask for)."""
    chunks = []
    chunked_pass = twin_module.chunked_pass
    monkeypatch.setattr(twin_module, "chunked_pass",
                        lambda *a: chunks.append((a[0].shape[0], a[5])) or chunked_pass(*a))
    hidden, weight, targets, _ = make_inputs(3 * 600, 64, 128, seed=2)
    linear_cross_entropy_torch(list(hidden.split(600)), weight, targets)
    part_chunk = twin_module.default_chunk_size(600, 64, 128)
    assert part_chunk < twin_module.default_chunk_size(1800, 64, 128)  # the shapes tell the two rules apart
    assert chunks == [(600, part_chunk)] * 3


def test_one_chunk_of_logits_is_alive_at_a_time():
    """A chunk's d(logits) is released before the next chunk's logits are computed: the peak holds one (c, V) fp32
    buffer and the weight gradient, not two chunks."""
    n, h, v, chunk = 64, 8, 8192, 16
    hidden, weight, targets, _ = make_inputs(n, h, v, seed=3)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    _, peak = peak_call(linear_cross_entropy_torch, hidden, weight, targets, chunk)
    chunk_bytes, weight_grad_bytes = chunk * v * 4, v * h * 4
    assert weight_grad_bytes + chunk_bytes <= peak < weight_grad_bytes + 1.5 * chunk_bytes


def test_parts_are_checked():
    hidden, weight, targets, _ = make_inputs(6, 8, 16)
    with pytest.raises(ValueError, match="non-empty list"):
        linear_cross_entropy_torch([], weight, targets)
    with pytest.raises(ValueError, match="non-empty list"):
        linear_cross_entropy_torch([hidden[:3], hidden[3:, :4]], weight, targets)
    with pytest.raises(ValueError, match="do not match hidden rows 5"):
        linear_cross_entropy_torch([hidden[:3], hidden[3:5]], weight, targets)
