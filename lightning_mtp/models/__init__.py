"""Host models that combine a trunk with :class:`~lightning_mtp.MTPMixin`."""

from lightning_mtp.models.causal_lm import CausalLM, ModelConfig, load_causal_lm

__all__ = ["CausalLM", "ModelConfig", "load_causal_lm"]
