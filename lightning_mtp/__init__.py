"""lightning-mtp: multi-token prediction heads, losses, callbacks and speculative decoding for PyTorch Lightning."""

from lightning_mtp.config import MTPConfig
from lightning_mtp.mixin import MTPForward, MTPLossOutput, MTPMixin

__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it (dynamic)

__all__ = ["MTPConfig", "MTPForward", "MTPLossOutput", "MTPMixin", "__version__"]
