"""``lightning-mtp export``: a checkpoint of an ``HFCausalLM`` with native MTP layers -> a ``transformers`` folder.

Example::

    lightning-mtp export --ckpt_path outputs/glm/checkpoints/last.ckpt --out exported/
    # then, in Python: AutoModelForCausalLM.from_pretrained("exported").generate(ids, use_mtp=True)

The folder holds the trunk, its config with ``num_nextn_predict_layers`` and the MTP layers under
``model.layers.{N+k}.*`` (:mod:`lightning_mtp.native.export`, which also explains when ``transformers`` needs
``lightning_mtp.native.register_mtp_patterns`` on the loaded model), with each MTP layer's copies of the embedding and
head that vLLM loads (``--no_serving_copies`` leaves them out), and the tokenizer the checkpoint was trained with
(``tokenizer.json``, ``tokenizer_config.json``, its chat template), so the folder is complete.

``--out`` is written whole or not at all: the export goes to a temporary folder beside it (same parent, so the move
is a rename) that takes ``--out``'s place once complete; a failed export removes it and leaves ``--out`` as it was. A
folder that is not empty (an earlier export, say) is refused unless ``--overwrite`` is given, and then replaced
whole, never mixed with the new files (an old shard index next to a new single file would not load). ``--out`` is
checked before the checkpoint is read: a file, a path under a file or under a folder that cannot be written is
refused at once.

Only an ``HFCausalLM`` with native MTP layers (``--model.mtp.layout native``) of a family whose MTP layers
``transformers`` runs (glm4_moe, deepseek_v3, ...) exports. The model is found from the checkpoint's hyper-parameters
(``_class_path`` when ``lightning-mtp fit`` recorded it, else their keys, for checkpoints a plain ``Trainer`` wrote);
anything else (a ``CausalLM``, a module of your own, another layout or family) is refused with the alternative.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_mtp.checkpoint_files import read_checkpoint, refuse_deepspeed_folder
from lightning_mtp.cli_checkpoint import checkpoint_model_class, without_missing_folder
from lightning_mtp.data.tokenizer_choice import save_for_transformers
from lightning_mtp.finite import check_finite_state_dict
from lightning_mtp.native.export import write_folder

SUPPORTED = ("lightning-mtp export writes only an HFCausalLM with native MTP layers (--model.mtp.layout native) of a "
             "family that has them in transformers (e.g. glm4_moe, deepseek_v3)")
ALTERNATIVE = ("other models keep their MTP heads in the checkpoint itself (HFCausalLM.save_mtp_heads(path) saves an "
               "HFCausalLM's heads alone)")


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(  # no abbreviations: "--over" must not pass for --overwrite, which deletes
        prog="lightning-mtp export", allow_abbrev=False,
        description="Write an HFCausalLM checkpoint with native MTP layers (--model.mtp.layout native) as a "
                    "transformers folder that AutoModelForCausalLM.from_pretrained loads and generate(use_mtp=True) "
                    "decodes with.")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by lightning-mtp fit (or a Trainer)")
    parser.add_argument("--out", required=True,
                        help="the folder to write: new or empty (created with its parents), or, with --overwrite, "
                             "one to replace whole. Written beside it first and moved into place when complete, so a "
                             "failed export leaves it as it was")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out (an earlier export): every file in it is deleted once the new "
                             "export is complete")
    parser.add_argument("--no_serving_copies", action="store_true",
                        help="leave out each MTP layer's copies of the embedding and head (embed_tokens, "
                             "shared_head.head): smaller, but vLLM's MTP loader needs them")
    return parser


# ----------------------------------------------------------------------------------------------- --out
def check_out(out: str, overwrite: bool, ckpt_path: str) -> Path:
    """Refuse an ``--out`` the export could not write or must not replace; returns it resolved (symlinks followed,
    so the temporary folder lands beside the real one)."""
    target = Path(os.path.realpath(out))
    if target.exists() and not target.is_dir():
        raise ValueError(f"--out {out!r} is a file, not a folder: give the path of a folder to write (new, empty, or "
                         "with --overwrite an earlier export to replace)")
    if target.is_dir() and os.path.ismount(target):
        raise ValueError(f"--out {out!r} is a mount point, which the finished export cannot be moved onto: give a "
                         "folder inside it")
    if target.is_dir() and any(target.iterdir()):
        _check_replaceable(out, target, overwrite, ckpt_path)
    _check_parent_writable(out, target)
    return target


def _check_replaceable(out: str, target: Path, overwrite: bool, ckpt_path: str) -> None:
    if not overwrite:
        raise ValueError(f"--out {out!r} is not empty: give a new or empty folder, or add --overwrite to replace it "
                         "whole (every file in it is deleted)")
    checkpoint = Path(os.path.realpath(ckpt_path))
    if target == checkpoint or target in checkpoint.parents:
        raise ValueError(f"--out {out!r} holds --ckpt_path {ckpt_path!r}: --overwrite would delete it with the "
                         "folder; give another --out")


def _check_parent_writable(out: str, target: Path) -> None:
    """The nearest existing folder above ``target`` must take the temporary folder (and the missing parents)."""
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"--out {out!r} cannot be created: {str(ancestor)!r} is a file, not a folder; give a path "
                         "under a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} cannot be written: no write permission in {str(ancestor)!r} (the export is "
                         "written to a folder beside --out first); give a path under a folder you can write")


# ----------------------------------------------------------------------------------------------- --ckpt_path
def model_class(checkpoint: dict) -> type:
    """The checkpoint's module class (:func:`~lightning_mtp.cli_checkpoint.checkpoint_model_class`: recorded, or
    recognised from the hyper-parameters of a checkpoint a plain ``Trainer`` wrote); refused unless it is an
    ``HFCausalLM`` (only those have a ``transformers`` trunk to export)."""
    from lightning_mtp.models import HFCausalLM

    class_path = checkpoint_model_class(checkpoint)
    if class_path is None:
        hparams = checkpoint.get("hyper_parameters") or {}
        keys = f"hyper-parameters {', '.join(sorted(hparams))}" if hparams else "no hyper-parameters"
        raise ValueError(f"--ckpt_path holds a model lightning-mtp export does not recognise ({keys}): {SUPPORTED}; "
                         f"{ALTERNATIVE}")
    cls = _import_class(class_path)
    if not (isinstance(cls, type) and issubclass(cls, HFCausalLM)):
        name = getattr(cls, "__name__", class_path)
        raise ValueError(f"--ckpt_path holds a {name}, which has no transformers layout: {SUPPORTED}; {ALTERNATIVE}")
    return cls


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"--ckpt_path: its model class {class_path!r} cannot be imported ({error})") from error


# ----------------------------------------------------------------------------------------------- export
def export(ckpt_path: str, out: str, serving_copies: bool = True, overwrite: bool = False) -> str:
    """Load the checkpoint on the CPU and write the folder whole (``serving_copies``: see
    ``HFCausalLM.save_pretrained``; ``overwrite``: replace a non-empty ``out``); returns ``out``."""
    from lightning_mtp.native.export import check_exportable

    target = check_out(out, overwrite, ckpt_path)
    refuse_deepspeed_folder(ckpt_path, "--ckpt_path", "export")  # shards: converted to one file first
    checkpoint = read_checkpoint(ckpt_path, "--ckpt_path")
    check_finite_state_dict(checkpoint.get("state_dict") or {}, f"--ckpt_path {ckpt_path}")
    cls = model_class(checkpoint)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    rebuilt = {k: v for k, v in without_missing_folder(checkpoint, hparams).items() if hparams.get(k) != v}
    module = cls.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True, **rebuilt)
    check_exportable(module)  # before any folder is made
    as_saved(module, checkpoint.get("state_dict") or {})
    def write(folder: str) -> None:
        module.save_pretrained(folder, serving_copies=serving_copies, shown_as=out)
        if module.mtp_tokenizer and not save_for_transformers(module.mtp_tokenizer, folder):  # the folder complete
            print(f"lightning-mtp: export: no tokenizer written to {out}: the checkpoint's tokenizer "
                  f"({module.mtp_tokenizer.get('name', 'byte')}) has no transformers form; give the model UTF-8 bytes "
                  "(ids 0-255) as the fit did", file=sys.stderr)

    write_folder(str(target), write, keep_other_files=False)  # whole or not at all, as save_pretrained
    return out


def as_saved(module: Any, state: dict) -> None:
    """Each weight of ``module`` in the dtype ``state`` holds it in: ``load_state_dict`` copies into the module's own
    (float32 for a trunk built from its config), so a ``bf16-true`` fit would otherwise export at twice its size.
    The values are the checkpoint's exactly (widened, then narrowed back)."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            saved = state.get(name)
            if isinstance(saved, torch.Tensor) and saved.is_floating_point() and saved.dtype != tensor.dtype:
                tensor.data = tensor.data.to(saved.dtype)


def main(args: Optional[list[str]] = None) -> None:
    namespace = export_parser().parse_args(args)
    out = export(namespace.ckpt_path, namespace.out, serving_copies=not namespace.no_serving_copies,
                 overwrite=namespace.overwrite)
    print(f"lightning-mtp export: wrote {out}")
