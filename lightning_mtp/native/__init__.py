"""Native MTP layers: the layout of checkpoints released with MTP (DeepSeek-V3, GLM-4.5), as ``transformers`` runs
them with ``generate(use_mtp=True)``.

* :mod:`~lightning_mtp.native.family`: which families have native MTP, and their block and norm classes;
* :mod:`~lightning_mtp.native.module`: :class:`NativeMTPModule`, one MTP layer (``MTPConfig.layout="native"``);
* :mod:`~lightning_mtp.native.cache`: the positional cache that drafting with native blocks writes into;
* :mod:`~lightning_mtp.native.checkpoint`: reading the MTP layers of a ``transformers`` folder (import);
* :mod:`~lightning_mtp.native.export`: writing a folder that ``transformers`` loads with its MTP layers.
"""

from lightning_mtp.native.build import build_native_modules, keep_fp32
from lightning_mtp.native.cache import PositionalLayerCache
from lightning_mtp.native.family import has_native_mtp, native_layer_count
from lightning_mtp.native.module import NativeMTPModule
from lightning_mtp.native.transformers_mtp import register_mtp_patterns

__all__ = ["NativeMTPModule", "PositionalLayerCache", "build_native_modules", "has_native_mtp", "keep_fp32",
           "native_layer_count", "register_mtp_patterns"]
