"""Self-speculative decoding with the MTP heads (draft, verify, accept, roll back) and plain decoding.

Example::

    >>> import torch
    >>> from lightning_mtp import MTPConfig
    >>> from lightning_mtp.models import CausalLM, ModelConfig
    >>> model = CausalLM(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4), MTPConfig(depth=2))
    >>> model.configure_model()
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8)
    >>> out.sequences.shape, out.stats.tau >= 1
    (torch.Size([1, 11]), True)
"""

from lightning_mtp.decoding.config import GenerationConfig
from lightning_mtp.decoding.drafting import Drafter, Drafts, MTPDrafter
from lightning_mtp.decoding.host import CausalLMHost, DecodingHost, decoding_host
from lightning_mtp.decoding.predict import predict_batch
from lightning_mtp.decoding.sampling import SamplingParams, choose_tokens, logits_to_probs
from lightning_mtp.decoding.speculative import decode, generate
from lightning_mtp.decoding.stats import DecodeStats, GenerateOutput
from lightning_mtp.decoding.step import accept_typical
from lightning_mtp.decoding.uncached_host import UncachedHost
from lightning_mtp.prediction_writer import PredictionWriter  # configs name it lightning_mtp.decoding.PredictionWriter

__all__ = [
    "CausalLMHost",
    "DecodeStats",
    "DecodingHost",
    "Drafter",
    "Drafts",
    "GenerateOutput",
    "GenerationConfig",
    "MTPDrafter",
    "PredictionWriter",
    "SamplingParams",
    "UncachedHost",
    "accept_typical",
    "choose_tokens",
    "decode",
    "decoding_host",
    "generate",
    "logits_to_probs",
    "predict_batch",
]
