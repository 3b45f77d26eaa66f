"""The ``transformers`` model under :class:`~lightning_mtp.models.HFCausalLM`: building it (from a config or a local
folder), checking it can host MTP heads, the logit transform its forward applies, and whether it keeps packed
documents apart.

Example::

    >>> model = build_trunk("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                     num_attention_heads=4), pretrained=None, attn_implementation=None)
    >>> check_trunk(model)  # an nn.Embedding, a bias-free nn.Linear head, decoder-only: nothing raised
    >>> logit_transform_of(model)  # LlamaForCausalLM applies nothing to its head's output
    LogitTransform(scale=1.0, softcap=None)
    >>> trunk_summary(model)
    {'class': 'LlamaForCausalLM', 'model_type': 'llama', 'hidden_size': 32, 'vocab_size': 64}
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from lightning_mtp.loss import LogitTransform

_GEMMA_SOFTCAP = ("final_logit_softcapping", "softcap")
LOGIT_TRANSFORMS: dict[str, tuple[str, str]] = {
    # class: (text-config attribute, how the class's forward applies it: multiply | divide | softcap | ignored),
    # read from the forward of each class in transformers' modeling_*.py (v5).
    "CohereForCausalLM": ("logit_scale", "multiply"),
    "Cohere2ForCausalLM": ("logit_scale", "multiply"),
    "Cohere2MoeForCausalLM": ("logit_scale", "multiply"),
    "GraniteForCausalLM": ("logits_scaling", "divide"),
    "GraniteSWAForCausalLM": ("logits_scaling", "divide"),
    "GraniteMoeForCausalLM": ("logits_scaling", "divide"),
    "GraniteMoeSWAForCausalLM": ("logits_scaling", "divide"),
    "GraniteMoeHybridForCausalLM": ("logits_scaling", "divide"),
    "GraniteMoeSharedForCausalLM": ("logits_scaling", "divide"),
    "MiniCPM3ForCausalLM": ("logits_scaling", "divide"),  # divides the hidden state before lm_head: the same map
    "HyperCLOVAXForCausalLM": ("logits_scaling", "multiply"),  # same attribute as Granite's, the other way round
    "FalconH1ForCausalLM": ("lm_head_multiplier", "multiply"),
    "Gemma2ForCausalLM": _GEMMA_SOFTCAP,
    "Gemma3ForCausalLM": _GEMMA_SOFTCAP,
    "Gemma3nForCausalLM": _GEMMA_SOFTCAP,
    "Gemma3nForConditionalGeneration": _GEMMA_SOFTCAP,
    "Gemma4ForCausalLM": _GEMMA_SOFTCAP,
    "Gemma4ForConditionalGeneration": _GEMMA_SOFTCAP,
    "Gemma4UnifiedForCausalLM": _GEMMA_SOFTCAP,
    "Gemma4UnifiedForConditionalGeneration": _GEMMA_SOFTCAP,
    "VaultGemmaForCausalLM": _GEMMA_SOFTCAP,
    "NanoChatForCausalLM": _GEMMA_SOFTCAP,
    "BeamForCausalLM": _GEMMA_SOFTCAP,
    "RecurrentGemmaForCausalLM": ("logits_soft_cap", "softcap"),
    "Gemma3ForConditionalGeneration": ("final_logit_softcapping", "ignored"),  # its forward does not soft-cap
}
"""How each ``transformers`` class turns its LM head's output into logits. Classes not listed apply nothing."""

LOGIT_ATTRIBUTES = ("logit_scale", "logits_scaling", "final_logit_softcapping", "logits_soft_cap",
                    "lm_head_multiplier", "output_multiplier", "logits_mup_width_multiplier", "logit_softcapping",
                    "unpadded_vocab_size")
"""Config attributes that transform (or cut) the logits in some ``transformers`` model. A class missing from
:data:`LOGIT_TRANSFORMS` whose config sets one of them is refused rather than trained on the wrong logits."""


def logit_transform_of(model: nn.Module) -> LogitTransform:
    """The :class:`~lightning_mtp.loss.LogitTransform` that ``model``'s forward applies to its LM head's output.

    Raises:
        TypeError: naming the class, model type and attribute, when the model transforms its logits in a way that is
            not known here (a class missing from :data:`LOGIT_TRANSFORMS` whose config sets a logit attribute).
    """
    name, config = type(model).__name__, model.config.get_text_config()
    rule = LOGIT_TRANSFORMS.get(name)
    if rule is None:
        unknown = {a: getattr(config, a) for a in LOGIT_ATTRIBUTES if getattr(config, a, None) not in (None, 1, 1.0)}
        if unknown:
            raise TypeError(
                f"{name} (model_type {model.config.model_type!r}) sets {unknown} in its config, which its forward may "
                "apply to the logits in a way lightning-mtp does not reproduce (HFCausalLM knows the transforms in "
                "lightning_mtp.models.hf_trunk.LOGIT_TRANSFORMS); the MTP loss and drafts would not match the "
                "model's own logits, so this model is not supported"
            )
        return LogitTransform()
    attribute, kind = rule
    value = getattr(config, attribute, None)
    if value is None or kind == "ignored":
        return LogitTransform()
    number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    if number is None or not math.isfinite(number) or (kind == "softcap" and number <= 0) or (
        kind == "divide" and number == 0
    ):
        raise TypeError(f"{name} (model_type {model.config.model_type!r}): config.{attribute} = {value!r} is not a "
                        "usable logit " + ("cap (a number > 0)" if kind == "softcap" else "scale (a finite number)"))
    if kind == "softcap":
        return LogitTransform(softcap=number)
    return LogitTransform(scale=number if kind == "multiply" else 1.0 / number)


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length",
                  "n_ctx")
"""The names ``transformers`` configs give the model's context, the first found read."""


def context_length(config: Any) -> Optional[int]:
    """A ``transformers`` config's context (its text config's ``max_position_embeddings``, or a family's own name for
    it: GPT-2's ``n_positions``, MPT's ``max_seq_len``...); ``None`` for a model that has none (ALiBi: Bloom)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in CONTEXT_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def build_trunk(model_type: Optional[str], config: Optional[dict], pretrained: Optional[str],
                attn_implementation: Optional[str]) -> nn.Module:
    """A ``*ForCausalLM`` from a local directory or from ``AutoConfig.for_model(model_type, **config)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if pretrained is not None:
        if model_type is not None or config:
            raise ValueError("HFCausalLM: give either pretrained (--model.init_args.pretrained) or "
                             "model_type/config (--model.init_args.model_type / .config), not both")
        if not os.path.isdir(pretrained):
            raise ValueError(f"HFCausalLM.pretrained (--model.init_args.pretrained) must be a local directory saved "
                             f"with save_pretrained; got {pretrained!r} (nothing is downloaded from a hub)")
        try:
            # float32, whatever dtype the folder was saved in (transformers would keep a bfloat16 folder bfloat16):
            # the trainer's precision decides the dtype (32-true and the mixed modes keep float32 weights, whose small
            # updates would round away in bfloat16; bf16-true converts them)
            return AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True, dtype=torch.float32, **extra)
        except (OSError, ValueError, KeyError) as error:  # a folder without its config or weights, or not an LM
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"HFCausalLM.pretrained (--model.init_args.pretrained) {pretrained!r}: transformers "
                             f"cannot load a causal LM from it: {reason}") from error
    config = {key: scalar_from_cli(value) for key, value in (config or {}).items()}
    model_type = config.pop("model_type", None) if model_type is None else model_type
    config.pop("model_type", None)
    if model_type is None:
        raise ValueError("HFCausalLM needs model_type (--model.init_args.model_type, e.g. llama) with config, "
                         "or pretrained (--model.init_args.pretrained, a local directory)")
    built = AutoConfig.for_model(model_type, **config)
    refuse_unknown_config_keys(built, config)
    return AutoModelForCausalLM.from_config(built, **extra)


def refuse_unknown_config_keys(built: Any, config: dict) -> None:
    """Raise naming a key of ``config`` that is a misspelling of a field of the ``transformers`` config ``built`` from
    it: ``transformers`` keeps an unknown key aside as an attribute and builds the default, so ``num_hiden_layers: 1``
    trained 6 layers, silently. An unknown key that resembles no field is taken: model code reads some by name
    (``head_dim`` on GLM-4.5, ``num_nextn_predict_layers``), and keys that ``transformers`` converts
    (``attn_implementation``, ``rope_scaling``) leave no attribute."""
    import dataclasses

    declared = ({f.name for f in dataclasses.fields(built)} if dataclasses.is_dataclass(built)
                else set(type(built)().to_dict()))
    declared |= set(getattr(built, "attribute_map", {}) or {})
    for key in sorted(key for key in config if key in vars(built) and key not in declared):
        close = [name for name in sorted(declared) if _one_edit_apart(key, name)]
        if close:
            raise ValueError(f"HFCausalLM.config (--model.init_args.config): {type(built).__name__} has no {key!r} "
                             f"(did you mean {close[0]!r}?); transformers would keep it aside and build the default "
                             f"{close[0]} = {getattr(built, close[0], None)!r}")


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with one character inserted, deleted, replaced, or two neighbours swapped.

    Example::

        >>> _one_edit_apart("num_hiden_layers", "num_hidden_layers"), _one_edit_apart("head_dim", "v_head_dim")
        (True, False)
    """
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if len(a) == len(b):
        swapped = a[start + 1:start + 2] + a[start:start + 1] + a[start + 2:] == b[start:]
        return a[start + 1:] == b[start + 1:] or swapped
    return a[start + 1:] == b[start:] if len(a) > len(b) else a[start:] == b[start + 1:]


def check_trunk(model: nn.Module) -> None:
    """Raise a ``TypeError`` naming the model class when it lacks what MTP training and decoding need."""
    name = type(model).__name__
    getters = ("get_input_embeddings", "get_output_embeddings", "base_model", "config")
    missing = [g for g in getters if not hasattr(model, g)]
    if missing:
        raise TypeError(f"{name} cannot host MTP heads: it has no {', '.join(missing)} "
                        "(use a transformers *ForCausalLM model)")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embed, nn.Embedding):
        raise TypeError(f"{name}.get_input_embeddings() must return an nn.Embedding, got {type(embed).__name__}")
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{name}.get_output_embeddings() must return an nn.Linear LM head, got {type(head).__name__}")
    if head.bias is not None:
        raise TypeError(f"{name}'s LM head has a bias; MTP depths share the head's weight only, so heads with a "
                        "bias are not supported")
    if type(head).forward is not nn.Linear.forward:
        raise TypeError(f"{name}'s LM head is a {type(head).__name__} with its own forward (e.g. a learned per-token "
                        "logit scale); the fused MTP loss uses the head's weight as a plain nn.Linear, so it is not "
                        "supported")
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model; HFCausalLM needs a decoder-only causal LM")


_MASK_FUNCTION = r"\bcreate_(?:causal|sliding_window_causal|chunked_causal)_mask\b"


def packing_support_problem(model: nn.Module) -> Optional[str]:
    """Why ``model`` (a ``*ForCausalLM``) cannot keep packed documents apart from ``position_ids`` alone (``None``:
    it can).

    ``transformers`` builds block-diagonal masks from packed position ids in ``masking_utils``
    (``find_packed_sequence_indices``, used when no attention mask and no cache are given), but only for a model
    whose base model's forward passes ``position_ids`` to ``create_causal_mask`` (or its sliding-window / chunked
    variants), and only with an attention kernel that ``masking_utils`` knows; any other model would let documents
    attend to each other silently.
    """
    base = model.base_model
    config = model.config.get_text_config()
    try:
        source = inspect.getsource(type(base).forward)
        takes = "position_ids" in inspect.signature(base.forward).parameters
    except (OSError, TypeError, ValueError):
        return "its modeling code could not be read"
    if not takes:
        return "its forward takes no position_ids"
    if not _mask_reads_position_ids(source):
        return "its modeling code does not build its attention mask from position_ids (transformers' masking_utils)"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"its attention implementation {kernel!r} has no packed-sequence mask in transformers' masking_utils"
    return None


def _mask_reads_position_ids(source: str) -> bool:
    """Whether a forward's source calls ``create_*causal_mask`` (directly or through a name bound to it, as
    ``mask_function = create_causal_mask if ... else ...``) with ``position_ids``: as a keyword, or through a
    ``**kwargs`` dict that holds them (``mask_kwargs = {..., "position_ids": position_ids}``)."""
    names = [_MASK_FUNCTION] + [rf"\b{re.escape(m.group(1))}\b"
                                for m in re.finditer(rf"(\w+)\s*=[^\n]*{_MASK_FUNCTION}", source)]
    for name in names:
        for match in re.finditer(name + r"\(", source):
            depth, end = 1, match.end()
            while depth and end < len(source):
                depth += {"(": 1, ")": -1}.get(source[end], 0)
                end += 1
            arguments = source[match.end():end]
            if "position_ids" in arguments or ("**" in arguments and '"position_ids": position_ids' in source):
                return True
    return False


def scalar_from_cli(value: Any) -> Any:
    """``"258"`` -> 258: dotted CLI overrides of a ``dict`` argument (``--model.init_args.config.hidden_size 64``)
    arrive as strings; YAML scalars are read as YAML would (other strings, e.g. ``silu``, stay strings)."""
    if not isinstance(value, str):
        return value
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, (int, float, bool, type(None))) else value


def plain_config(config: Any) -> dict:
    """The config's non-default values as plain types (for hyperparameters)."""
    plain = config.to_diff_dict()
    plain.pop("transformers_version", None)
    plain.pop("architectures", None)
    return {k: v for k, v in plain.items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}


def trunk_summary(model: nn.Module, weights: Optional[str] = None, pretrained: Optional[str] = None) -> dict:
    """What a heads-only checkpoint records of its trunk (class, model type, hidden and vocabulary sizes, and the
    :func:`weights_fingerprint` of the folder it was loaded from), to refuse heads trained on another trunk."""
    cfg = model.config.get_text_config()
    summary = {"class": type(model).__name__, "model_type": model.config.model_type,
               "hidden_size": int(cfg.hidden_size), "vocab_size": int(model.get_output_embeddings().out_features)}
    if weights is not None:
        summary.update(weights=weights, pretrained=pretrained)
    return summary


FINGERPRINT_SAMPLES = 64
"""Evenly spaced values of each weight that :func:`weights_fingerprint` hashes."""


def weights_fingerprint(model: nn.Module) -> str:
    """A hash of every weight's name, shape and :data:`FINGERPRINT_SAMPLES` evenly spaced values (as float32): cheap
    at any model size, and different for another model of the same shapes or a folder trained further (training
    moves every value). Not a hash of every byte: two weights that differ only between the samples hash alike.

    Example::

        >>> import torch
        >>> layer = nn.Linear(4, 4)
        >>> before = weights_fingerprint(layer)
        >>> with torch.no_grad():
        ...     _ = layer.weight.add_(1e-3)
        >>> before == weights_fingerprint(layer), len(before)
        (False, 16)
    """
    digest = hashlib.sha1()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(flat.numel() // FINGERPRINT_SAMPLES, 1)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(flat[::step][:FINGERPRINT_SAMPLES].to(device="cpu", dtype=torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]
