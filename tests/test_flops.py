"""The analytic FLOP model against torch's FlopCounterMode, and against CountedFlops (its formulas, taught CPU
attention and addmm_), on work where the counter sees every product."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_mtp import MTPConfig
from lightning_mtp.flops import (
    CPU_FLASH,
    EXPLICIT_MATMULS,
    AttentionCost,
    CountedFlops,
    training_step_flops,
)
from lightning_mtp.models import CausalLM, ModelConfig

BATCH, SEQ_LEN, VOCAB = 2, 40, 96


def model_config(n_kv_heads=None) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=64)


def build(config: ModelConfig, mtp: MTPConfig, active_depth: int) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(config, mtp)
    model.configure_model()
    model.mtp_active_depth = active_depth
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))


def explicit_attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """softmax(mask(Q·Kᵀ / √hd))·V as matmuls over the full T × T, so that FlopCounterMode sees every product."""
    if attn_mask is not None or not is_causal:
        raise NotImplementedError("training attention only")
    if enable_gqa:  # (B, nkv, T, hd) -> (B, nh, T, hd)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    T = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # (B, nh, T, hd)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_trunk_linear_layers_match_the_counter(n_kv_heads):
    """Out of the box the counter misses CPU attention: what it sees of the trunk is exactly its linear layers."""
    config = model_config(n_kv_heads)
    model = build(config, MTPConfig(depth=1), 0)
    with FlopCounterMode(display=False) as counter:
        model(tokens()).sum().backward()
    flops = training_step_flops(config, MTPConfig(depth=1), BATCH, SEQ_LEN, 0)
    assert counter.get_total_flops() == flops["trunk"] - flops["attention"]


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_trunk_with_explicit_attention_matches_the_counter(monkeypatch, n_kv_heads):
    """Attention written as matmuls: the counter sees all of the trunk, forward and backward."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_attention)
    config = model_config(n_kv_heads)
    model = build(config, MTPConfig(depth=1), 0)
    with FlopCounterMode(display=False) as counter:
        model(tokens()).sum().backward()
    flops = training_step_flops(config, MTPConfig(depth=1), BATCH, SEQ_LEN, 0, attention=EXPLICIT_MATMULS)
    assert counter.get_total_flops() == pytest.approx(flops["trunk"], rel=0.01)
    assert flops["attention"] > 0.05 * flops["trunk"]  # the attention term is large enough to be checked here


def test_counted_flops_equal_flop_counter_mode_where_it_sees_everything(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", explicit_attention)
    model = build(model_config(), MTPConfig(depth=1), 0)
    with FlopCounterMode(display=False) as counter:
        model(tokens()).sum().backward()
    with CountedFlops() as counted:
        model(tokens()).sum().backward()
    assert counted.total == counter.get_total_flops() > 0


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("active_depth", [0, 1, 3])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_step_without_recompute_matches_the_taught_counter(architecture, active_depth, n_kv_heads):
    """A whole step (trunk, main head, every depth's module and head) against the counter taught CPU attention and
    the cross-entropy's addmm_: nothing is repeated without recompute, so the two agree."""
    config, mtp = model_config(n_kv_heads), MTPConfig(depth=3, architecture=architecture)
    model = build(config, mtp, active_depth)
    with CountedFlops() as counted:
        model.compute_lm_loss(tokens()).loss.backward()
    flops = training_step_flops(config, mtp, BATCH, SEQ_LEN, active_depth)
    assert counted.total == pytest.approx(flops["total"], rel=0.01)
    assert len(flops["depth_block"]) == len(flops["depth_head"]) == len(flops["recompute"]) == active_depth
    assert flops["recompute"] == [0] * active_depth


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_recompute_is_one_forward_of_each_depth_module(architecture):
    """The recompute term of depth k is the counted forward of its module (eh_proj and block) on its T-k-1
    positions, once, and recompute adds nothing else."""
    config = model_config()
    mtp = MTPConfig(depth=3, architecture=architecture, recompute=True)
    model = build(config, mtp, 3)
    flops = training_step_flops(config, mtp, BATCH, SEQ_LEN, 3)
    for k, module in enumerate(model.mtp_modules, start=1):
        length = SEQ_LEN - k - 1
        hidden, embedding = torch.randn(BATCH, length, 32), torch.randn(BATCH, length, 32)
        cos, sin = model.mtp_rope(length)
        with torch.no_grad(), CountedFlops() as counted:
            module(hidden, embedding, cos, sin)
        assert flops["recompute"][k - 1] == counted.total > 0
    plain = training_step_flops(config, MTPConfig(depth=3, architecture=architecture), BATCH, SEQ_LEN, 3)
    assert flops["total"] - plain["total"] == sum(flops["recompute"])
    assert flops["depth_block"] == plain["depth_block"] and flops["depth_head"] == plain["depth_head"]


def test_depth_k_scores_and_runs_on_t_minus_k_minus_1_positions():
    config = model_config()
    flops = training_step_flops(config, MTPConfig(depth=3, architecture="parallel"), BATCH, SEQ_LEN, 3)
    rows = [BATCH * (SEQ_LEN - 1)] + [BATCH * (SEQ_LEN - k - 1) for k in (1, 2, 3)]
    assert [flops["main_head"]] + flops["depth_head"] == [6 * n * 32 * VOCAB for n in rows]
    assert flops["depth_block"][0] > flops["depth_block"][1] > flops["depth_block"][2]


def test_attention_pairs_follow_the_kernel_blocks():
    assert CPU_FLASH.pairs(512) == 512 * 512  # one 512-key block: the full T × T
    assert CPU_FLASH.pairs(1024) == 512 * 512 + 512 * 1024  # the first half never reaches the second key block
    assert AttentionCost(key_block=1, backward_products=5).pairs(10) == 55  # the causal triangle
    assert EXPLICIT_MATMULS.pairs(7) == 49


@pytest.mark.parametrize(("mtp", "active_depth", "match"), [
    (MTPConfig(depth=2), 3, "active_depth"),
    (MTPConfig(depth=2), -1, "active_depth"),
    (MTPConfig(depth=2, detach_trunk=True), 2, "detach_trunk"),
    (MTPConfig(depth=2, distill_weight=0.5), 2, "distill_weight"),
])
def test_bad_inputs(mtp, active_depth, match):
    with pytest.raises(ValueError, match=match):
        training_step_flops(model_config(), mtp, BATCH, SEQ_LEN, active_depth)


def test_too_short_a_sequence_is_refused():
    with pytest.raises(ValueError, match="seq_len"):
        training_step_flops(model_config(), MTPConfig(depth=3), BATCH, 4, 3)
