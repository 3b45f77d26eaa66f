"""Transformer parts: the thin-input Linear path, RMSNorm, cached decoding against the plain causal forward, and the
recompute path's pieces (attention by head group, the block's halves, hand-written linear backward)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_mtp.layers import (
    THIN_ROWS,
    Attention,
    Block,
    Linear,
    RMSNorm,
    RotaryTable,
    linear_backward,
    visible_slots,
)
from lightning_mtp.models import CausalLM, ModelConfig


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 32), (2, 32), (1, 1, 32), (3, 4, 32), (THIN_ROWS, 32), (THIN_ROWS + 1, 32)])
def test_linear_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = Linear(32, 48, bias=bias)
    x = torch.randn(*shape)
    expected = F.linear(x, layer.weight, layer.bias)
    out = layer(x)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_thin_path_when_forced_equals_f_linear(monkeypatch, mode):
    from lightning_mtp import small_matmul

    monkeypatch.setenv(small_matmul.ENV, mode)
    torch.manual_seed(0)
    layer = Linear(32, 48, bias=True)
    calls = []
    monkeypatch.setattr("lightning_mtp.layers.thin_linear", lambda *a: calls.append(1) or small_matmul.thin_linear(*a))
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == ([1] if mode == "on" else [])


def test_an_unknown_thin_path_setting_is_refused(monkeypatch):
    from lightning_mtp import small_matmul

    monkeypatch.setenv(small_matmul.ENV, "yes")
    with pytest.raises(ValueError, match="LIGHTNING_MTP_THIN_LINEAR must be one of"):
        Linear(8, 8)(torch.randn(2, 8))


def test_thin_path_is_measured_once_per_shape_bucket_and_threads(monkeypatch):
    """``auto``: the path is chosen from a measurement on this machine, once per (in, out, row bucket, threads); the
    thin path only where it measured at most THIN_MARGIN of F.linear's time."""
    from lightning_mtp import small_matmul

    monkeypatch.delenv(small_matmul.ENV, raising=False)
    small_matmul.clear()
    ratios = {1: 0.5, 2: 0.95, 4: 2.0}  # per row bucket: thin / F.linear time
    measured = []

    def fake_measure(in_features, out_features, rows):
        measured.append((in_features, out_features, rows))
        return ratios.get(rows, 1.0)

    monkeypatch.setattr(small_matmul, "measure", fake_measure)
    try:
        assert small_matmul.thin_path_pays(32, 48, 1) is True
        assert small_matmul.thin_path_pays(32, 48, 2) is False  # within THIN_MARGIN: noise is not a reason
        assert small_matmul.thin_path_pays(32, 48, 3) is False and small_matmul.thin_path_pays(32, 48, 4) is False
        assert small_matmul.thin_path_pays(32, 48, 1) is True
        assert measured == [(32, 48, 1), (32, 48, 2), (32, 48, 4)]  # 3 and 4 share the bucket; nothing twice
        small_matmul.thin_path_pays(48, 32, 1)
        assert measured[-1] == (48, 32, 1)
    finally:
        small_matmul.clear()


def test_a_traced_linear_has_no_graph_break(monkeypatch):
    """Under torch.compile the path decision must not trace the timing (time.perf_counter is a graph break: every
    Linear then became a frame of its own, recompiled per weight shape until dynamo's limit)."""
    from lightning_mtp import small_matmul

    monkeypatch.delenv(small_matmul.ENV, raising=False)
    small_matmul.clear()
    torch._dynamo.reset()
    layer = Linear(32, 48)
    explanation = torch._dynamo.explain(layer)(torch.randn(2, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_the_measurement_times_both_paths_on_real_products():
    from lightning_mtp.small_matmul import LARGEST_MEASURED, measure

    ratio = measure(64, 96, 4, passes=1)
    assert 0 < ratio < float("inf")
    assert measure(LARGEST_MEASURED // 4, 2, 1) == float("inf")  # too large to measure: F.linear


def test_linear_accepts_non_contiguous_input_and_keeps_gradients():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=False)
    x = torch.randn(16, 3).t().requires_grad_()  # (3, 16), transposed view
    layer(x).sum().backward()
    ref = x.detach().clone().requires_grad_()
    F.linear(ref, layer.weight).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
@pytest.mark.parametrize("cached", [False, True])
def test_decoding_sized_attention_takes_the_flash_kernel(monkeypatch, tokens, cached):
    """The thin Linear returns a transposed view; the queries (and, uncached, keys and values) must still reach
    scaled_dot_product_attention with a unit-stride head dimension, or ATen's CPU flash kernel is skipped for the
    slower math path (bmm, softmax and masking as separate ops): a verify forward of 4 tokens cost 18% more."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_mtp import small_matmul
    from lightning_mtp.layers import KVCache, attention_width

    monkeypatch.setenv(small_matmul.ENV, "on")  # the thin path, whatever this machine measures

    torch.manual_seed(0)
    block = Block(64, 4, None, 128).eval()
    x = torch.randn(1, tokens, 64)
    positions = torch.arange(8, 8 + tokens).unsqueeze(0)
    cache = KVCache(1, 64, 4, 16, device="cpu", dtype=torch.float32) if cached else None
    if cached:
        cos, sin = RotaryTable(64, 16)(tokens, positions)
    else:
        cos, sin = RotaryTable(64, 16)(tokens)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x, cos, sin, positions if cached else None, cache,
              visible_slots(positions, attention_width(positions, 64)) if cached else None)
    kernels = {event.key for event in prof.key_averages() if "attention" in event.key}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels, kernels
    assert "aten::_scaled_dot_product_attention_math" not in kernels


def test_rms_norm_matches_the_formula_in_fp32_and_bf16():
    torch.manual_seed(0)
    norm = RMSNorm(24)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 24)
    reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    torch.testing.assert_close(norm(x), reference, rtol=1e-6, atol=1e-6)
    half = norm.to(torch.bfloat16)(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), reference, rtol=2e-2, atol=2e-2)


def test_visible_slots_is_causal_per_row():
    positions = torch.tensor([[2, 3], [0, 1]])
    mask = visible_slots(positions, 5)  # (B, 1, T, S)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert mask[1, 0].tolist() == [[True, False, False, False, False], [True, True, False, False, False]]


def test_attention_width_covers_the_last_slot_in_use_rounded_up():
    from lightning_mtp.layers import ATTENTION_WIDTH_STEP, attention_width

    step = ATTENTION_WIDTH_STEP
    assert attention_width(torch.tensor([[3, step]]), 10 * step) == 2 * step  # slot `step` is the (step+1)-th
    assert attention_width(torch.tensor([step - 1]), 10 * step) == step
    assert attention_width(torch.tensor([[5 * step]]), 3 * step) == 3 * step  # never past the cache


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_cached_decoding_forward_equals_the_full_causal_forward(n_kv_heads):
    """Prefill, then ragged chunks of 1-4 tokens per row through the static cache, with stale entries of random
    tokens beyond each row's position (as rejected drafts leave them): every position's hidden state equals the
    plain causal forward's. The cache (40 slots) is longer than the attended width (32 up to position 31,
    :func:`attention_width`), so both the bounded and the whole-cache reads are exercised."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                                 max_seq_len=64)).eval()
    model.configure_model()
    tokens = torch.randint(0, 64, (2, 40))
    with torch.inference_mode():
        full = model(tokens)  # (B, T, H)
        caches = model.allocate_kv_caches(2, 40)
        prefill = torch.tensor([5, 8])
        width = int(prefill.max())
        positions = torch.arange(width).expand(2, width)
        model(tokens[:, :width], positions, caches)  # row 0 also writes slots 5..7, stale garbage for it
        start = prefill.clone()
        chunks = [1, 4, 2, 3, 1, 4]
        while int(start.max()) < 34:
            size = chunks[int(start.sum()) % len(chunks)]
            # rejected drafts of an earlier step: random tokens written at the next 6 slots, partly left stale
            stale = start.unsqueeze(1) + torch.arange(6)
            model(torch.randint(0, 64, (2, 6)), stale, caches)
            positions = start.unsqueeze(1) + torch.arange(size)  # (B, size)
            hidden = model(tokens.gather(1, positions), positions, caches)
            for row in range(2):
                torch.testing.assert_close(hidden[row], full[row, positions[row]], rtol=1e-4, atol=1e-4)
            # rows advance by different amounts: row 1 keeps only its first token (the rest acts as rejected)
            start = start + torch.tensor([size, 1])


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_attention_by_head_group_equals_the_whole_attention_forward_and_backward(n_kv_heads):
    """The recompute path's attention, one key/value head group at a time: its sum is ``Attention.forward``'s output,
    and its hand-written backward gives autograd's d/dx and weight gradients."""
    torch.manual_seed(0)
    attention = Attention(32, 4, n_kv_heads)
    x = torch.randn(2, 7, 32, requires_grad=True)
    cos, sin = RotaryTable(16, 8)(7)
    grad_out = torch.randn(2, 7, 32)
    reference = attention(x, cos, sin)
    want = torch.autograd.grad(reference, [x, attention.qkv.weight, attention.proj.weight], grad_out)
    with torch.no_grad():
        by_group = attention.add_by_group(torch.zeros(2, 7, 32), x, cos, sin)
    torch.testing.assert_close(by_group, reference.detach(), rtol=1e-5, atol=1e-6)
    for got, expected in zip(attention.backward_by_group(x, cos, sin, grad_out, weight_grads=True), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    rows = [r for group in range(attention.n_kv_heads) for r in attention.head_group(group)]
    assert sorted(i for r in rows for i in range(r.start, r.stop)) == list(range(attention.qkv.out_features))


def test_rms_norm_and_swiglu_backward_by_hand_match_autograd():
    """The recompute path's hand-written backwards: RMSNorm's (d/dx, d/dweight accumulated into a buffer, or the
    weight alone) and the SwiGLU gate's (written over its input) equal autograd's."""
    from lightning_mtp.heads import _swiglu_backward
    from lightning_mtp.layers import rms_norm_backward, rms_norm_backward_applies

    torch.manual_seed(0)
    norm = RMSNorm(16)
    norm.weight.data = torch.randn(16)
    x, grad = torch.randn(2, 7, 16, requires_grad=True) * 3, torch.randn(2, 7, 16)
    want_x, want_weight = torch.autograd.grad(norm(x), [x, norm.weight], grad)
    weight_grad = torch.ones(16)  # accumulates: starts from a previous chunk's sum
    torch.testing.assert_close(rms_norm_backward(norm, x, grad, True, weight_grad), want_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight_grad, want_weight + 1, rtol=1e-5, atol=1e-6)
    assert rms_norm_backward(norm, x, grad, False, weight_grad) is None
    torch.testing.assert_close(weight_grad, 2 * want_weight + 1, rtol=1e-5, atol=1e-6)
    assert rms_norm_backward_applies(norm, x) and not rms_norm_backward_applies(norm, x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not rms_norm_backward_applies(norm, x)

    gate_up = torch.randn(2, 5, 12, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    grad = torch.randn(2, 5, 6)
    want, = torch.autograd.grad(F.silu(gate) * up, gate_up, grad)
    got = _swiglu_backward(gate_up.detach().clone(), grad.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_block_halves_compose_to_the_block_and_linear_backward_matches_autograd():
    torch.manual_seed(0)
    block = Block(32, 4, 2, 64)
    x = torch.randn(2, 5, 32)
    cos, sin = RotaryTable(16, 8)(5)
    with torch.no_grad():
        torch.testing.assert_close(block.mlp_residual(block.attention_residual(x, cos, sin)), block(x, cos, sin),
                                   rtol=1e-5, atol=1e-6)
    weight = torch.randn(6, 32, requires_grad=True)
    x.requires_grad_()
    grad = torch.randn(2, 5, 6)
    want = torch.autograd.grad(F.linear(x, weight), [x, weight], grad)
    weight_grad = torch.ones(6, 32)
    torch.testing.assert_close(linear_backward(x, weight, grad, weight_grad), want[0])
    torch.testing.assert_close(weight_grad, want[1] + 1)  # accumulated into what was there
