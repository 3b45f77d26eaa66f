"""``lightning-mtp export``: a checkpoint of an ``HFCausalLM`` with native MTP layers -> a ``transformers`` folder.

Example::

    lightning-mtp export --ckpt_path outputs/glm/checkpoints/last.ckpt --out exported/
    # then, in Python: AutoModelForCausalLM.from_pretrained("exported").generate(ids, use_mtp=True)

The folder holds the trunk, its config with ``num_nextn_predict_layers`` and the MTP layers under
``model.layers.{N+k}.*`` (:mod:`lightning_mtp.native.export`, which also explains when ``transformers`` needs
``lightning_mtp.native.register_mtp_patterns`` on the loaded model), with each MTP layer's copies of the embedding and
head that vLLM loads (``--no_serving_copies`` leaves them out). Checkpoints of other layouts or hosts are refused.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Optional

from lightning_mtp.checkpointing import read_checkpoint


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mtp export",
        description="Write an HFCausalLM checkpoint with native MTP layers (--model.mtp.layout native) as a "
                    "transformers folder that AutoModelForCausalLM.from_pretrained loads and generate(use_mtp=True) "
                    "decodes with.")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by lightning-mtp fit (or a Trainer)")
    parser.add_argument("--out", required=True, help="the folder to write (created; existing files are replaced)")
    parser.add_argument("--no_serving_copies", action="store_true",
                        help="leave out each MTP layer's copies of the embedding and head (embed_tokens, "
                             "shared_head.head): smaller, but vLLM's MTP loader needs them")
    return parser


def model_class(hparams: dict) -> type:
    """The checkpoint's module class: ``_class_path`` when the CLI recorded it, else ``HFCausalLM``; refused unless it
    is an ``HFCausalLM`` (only those have a ``transformers`` trunk to export)."""
    from lightning_mtp.models import HFCausalLM

    class_path = hparams.get("_class_path")
    if not class_path:
        return HFCausalLM
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"--ckpt_path: its model class {class_path!r} cannot be imported ({error})") from error
    if not (isinstance(cls, type) and issubclass(cls, HFCausalLM)):
        raise ValueError(f"--ckpt_path holds a {name}; only HFCausalLM checkpoints (a transformers trunk with native "
                         "MTP layers, --model.mtp.layout native) export to a transformers folder")
    return cls


def export(ckpt_path: str, out: str, serving_copies: bool = True) -> str:
    """Load the checkpoint on the CPU and write the folder (``serving_copies``: see ``HFCausalLM.save_pretrained``);
    returns ``out``."""
    checkpoint = read_checkpoint(ckpt_path, "--ckpt_path")
    cls = model_class(dict(checkpoint.get("hyper_parameters") or {}))
    module = cls.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    return module.save_pretrained(out, serving_copies=serving_copies)


def main(args: Optional[list[str]] = None) -> None:
    namespace = export_parser().parse_args(args)
    out = export(namespace.ckpt_path, namespace.out, serving_copies=not namespace.no_serving_copies)
    print(f"lightning-mtp export: wrote {out}")
