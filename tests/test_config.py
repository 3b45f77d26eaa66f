"""Bad input fails before training with a message naming the field or CLI flag."""

from __future__ import annotations

import pytest

from lightning_mtp import MTPConfig
from lightning_mtp.models import ModelConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"depth": 0}, "depth"),
        ({"depth": -2}, "depth"),
        ({"loss_weight": -0.1}, "loss_weight"),
        ({"loss_weight": float("nan")}, "loss_weight"),
        ({"architecture": "medusa"}, "architecture"),
        ({"depth": 2, "depth_weights": [1.0]}, "depth_weights"),
        ({"depth": 2, "depth_weights": [1.0, -1.0]}, "depth_weights"),
        ({"loss_chunk_size": 0}, "loss_chunk_size"),
        ({"distill_weight": -1.0}, "distill_weight"),
    ],
)
def test_bad_mtp_config_names_field_and_flag(kwargs, field):
    with pytest.raises(ValueError, match=rf"MTPConfig\.{field} \(--model\.mtp\.{field}\)"):
        MTPConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"vocab_size": 0}, "--model.model.vocab_size"),
        ({"dim": 30, "n_heads": 4}, "--model.model.dim"),
        ({"n_heads": 4, "n_kv_heads": 3}, "--model.model.n_kv_heads"),
    ],
)
def test_bad_model_config_names_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        ModelConfig(**kwargs)


def test_defaults_follow_deepseek_v3():
    cfg = MTPConfig()
    assert cfg.architecture == "cascaded" and cfg.loss_weight == 0.3 and cfg.share_embedding and cfg.share_output_head


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_optimizer_args_name_the_flag(kwargs, flag):
    from lightning_mtp.models import CausalLM

    with pytest.raises(ValueError, match=rf"--model\.init_args\.{flag}"):
        CausalLM(**kwargs)


def test_warmup_cosine_schedule():
    from lightning_mtp.optim import warmup_cosine

    factor = warmup_cosine(warmup_steps=10, total_steps=110)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.55) and factor(110) == pytest.approx(0.1)
    assert warmup_cosine(0, None)(1000) == 1.0
