"""Shared fixtures: tiny models that run in milliseconds on CPU."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread: tiny models gain nothing from more, and under load two threads made them 10-40x slower.
torch.set_num_threads(1)


def tiny_model(depth: int = 3, architecture: str = "cascaded", vocab_size: int = 61, **mtp_kwargs):
    from lightning_mtp import MTPConfig
    from lightning_mtp.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    model_kwargs = {k: mtp_kwargs.pop(k) for k in ("tie_embeddings", "n_kv_heads") if k in mtp_kwargs}
    model = CausalLM(
        ModelConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=64, **model_kwargs),
        MTPConfig(depth=depth, architecture=architecture, **mtp_kwargs),
    )
    model.configure_model()
    return model


@pytest.fixture
def make_tiny_model():
    return tiny_model
