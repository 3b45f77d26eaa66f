"""Host models that combine a trunk with :class:`~lightning_mtp.MTPMixin`."""

from lightning_mtp.models.causal_lm import CausalLM, ModelConfig, load_causal_lm
from lightning_mtp.models.hf_causal_lm import HFCausalLM

__all__ = ["CausalLM", "HFCausalLM", "ModelConfig", "load_causal_lm"]
