"""Native MTP layers (``MTPConfig.layout="native"``, issue #14), checked against ``transformers``' own ``MtpModel`` and
``generate(use_mtp=True)`` on tiny glm4_moe and deepseek_v3 models built from configs.

The reference folders are written from ``transformers``' ``MtpModel`` (its state renamed to the checkpoint layout and
reverted to disk names with ``revert_weight_conversion``), not by our exporter, so import and export are each
checked against ``transformers``.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import lightning as L
import pytest
import torch

pytest.importorskip("transformers", reason="native MTP layers need the optional transformers dependency")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402
from transformers.generation import candidate_generator  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.cli import main as cli_main  # noqa: E402
from lightning_mtp.decoding import generate  # noqa: E402
from lightning_mtp.decoding import step as step_module  # noqa: E402
from lightning_mtp.decoding.native_drafting import NativeMTPDrafter, chain_drafter  # noqa: E402
from lightning_mtp.heads import CascadedMTPModule  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402
from lightning_mtp.native import NativeMTPModule, PositionalLayerCache, register_mtp_patterns  # noqa: E402
from lightning_mtp.native import export as export_module  # noqa: E402

VOCAB = 128
FAMILIES = {
    "glm4_moe": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128),
    "deepseek_v3": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        max_position_embeddings=128, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1),
}
CASES = [(family, layers) for family in FAMILIES for layers in (1, 2)]
IDS = [f"{family}-{layers}" for family, layers in CASES]


def family_config(family: str, layers: int) -> dict:
    return dict(FAMILIES[family], num_nextn_predict_layers=layers, eos_token_id=None, pad_token_id=0)


def native_model(family: str, layers: int, depth=None, seed: int = 0, **kwargs) -> HFCausalLM:
    torch.manual_seed(seed)
    model = HFCausalLM(family, family_config(family, layers), mtp=MTPConfig(depth=depth or layers), **kwargs)
    model.configure_model()
    return model


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Move every parameter and the routers' score-correction biases off their initial values (norms start at 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and (not name.endswith("inv_freq")):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype))


def cyclic_batch(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Arithmetic progressions mod VOCAB: learnable by the main head and by every MTP depth in a few steps."""
    start = torch.randint(0, VOCAB, (rows, 1), generator=generator)
    return (start + torch.arange(length) * (start % 7 + 1)) % VOCAB  # (rows, length)


def train_briefly(model: HFCausalLM, steps: int = 60) -> HFCausalLM:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        loss = model.compute_lm_loss(cyclic_batch(8, 24, generator)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def transformers_mtp(model: HFCausalLM) -> MtpModel:
    """``transformers``' ``MtpModel`` over ``model``'s trunk, holding our native modules' weights."""
    reference = MtpModel(model.trunk, len(model.mtp_modules)).eval()
    state = {}
    for k, module in enumerate(model.mtp_modules):
        for key, tensor in module.state_dict().items():
            state[f"layers.{k}." + ("mtp_block." + key.removeprefix("block.") if key.startswith("block.") else key)] = \
                tensor
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "shared_head")) for k in missing)
    return reference


def reference_depth_logits(reference: MtpModel, hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Teacher-forced logits of every MTP layer as ``MtpModel.forward_layer`` computes them: layer k (0-based) at
    positions i reads token t(i+k+1) at RoPE position i+k+1 and layer k-1's output."""
    logits, previous, length = [], hidden, input_ids.shape[1]
    for k in range(len(reference.layers)):
        count = length - k - 2  # positions with a target, as MTPMixin scores them
        positions = torch.arange(k + 1, k + 1 + count).expand(input_ids.shape[0], count)
        previous = reference.forward_layer(k, previous[:, :count], positions, None,
                                           input_ids=input_ids[:, k + 1 : k + 1 + count])
        logits.append(reference._project_to_logits(previous))
    return logits


def write_transformers_folder(path, family: str, layers: int, seed: int = 0) -> tuple[torch.nn.Module, MtpModel]:
    """A folder with native MTP layers written from ``transformers``' ``MtpModel`` (not by our exporter)."""
    torch.manual_seed(seed)
    trunk = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **family_config(family, layers))).eval()
    reference = MtpModel(trunk, layers).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # MtpModel leaves some tensors (fused experts) uninitialised: give every one a value
        for tensor in [*reference.layers.parameters(), *reference.layers.buffers()]:
            values = 0.1 * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(values + 1 if tensor.dim() == 1 else values)
    trunk.save_pretrained(path)
    main_layers = trunk.config.num_hidden_layers
    state = {}
    for key, tensor in reference.state_dict().items():
        if not key.startswith("layers."):
            continue
        _, k, rest = key.split(".", 2)
        rest = "shared_head.norm.weight" if rest == "post_norm.weight" else rest.removeprefix("mtp_block.")
        state[f"model.layers.{main_layers + int(k)}.{rest}"] = tensor.detach().clone()
    disk = dict(revert_weight_conversion(trunk, state))
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    save_file({**tensors, **disk}, file, metadata={"format": "pt"})
    return trunk, reference


def edit_folder(path, change) -> None:
    """Rewrite the folder's safetensors with ``change(tensors)`` applied."""
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


class TransformersSteps:
    """The drafts ``transformers`` proposed and how many it accepted at each step of ``generate(use_mtp=True)``."""

    def __init__(self, monkeypatch) -> None:
        self.drafts: list[list[int]] = []
        self.accepted: list[int] = []
        generator_class = candidate_generator.MTPCandidateGenerator
        get_candidates = generator_class.get_candidates

        def record_drafts(generator, input_ids, *args, **kwargs):
            candidates, logits = get_candidates(generator, input_ids, *args, **kwargs)
            if candidates.shape[1] > input_ids.shape[1]:  # the call after the prefill drafts nothing
                self.drafts.append(candidates[0, input_ids.shape[1]:].tolist())
            return candidates, logits

        def record_accepted(generator, input_ids, scores, num_matches):
            if len(self.accepted) < len(self.drafts):
                self.accepted.append(int(num_matches))

        monkeypatch.setattr(generator_class, "get_candidates", record_drafts)
        monkeypatch.setattr(generator_class, "update_candidate_strategy", record_accepted, raising=False)


class OurSteps:
    """The drafts our speculative loop verified and how many it accepted, step by step (batch 1)."""

    def __init__(self, monkeypatch) -> None:
        self.drafts: list[list[int]] = []
        self.accepted: list[int] = []
        record = step_module.record_acceptance

        def recording(state, drafts, num_accepted, active):
            self.drafts.append(drafts[0].tolist())
            self.accepted.append(int(num_accepted[0]))
            return record(state, drafts, num_accepted, active)

        monkeypatch.setattr(step_module, "record_acceptance", recording)


def loaded_with_mtp(folder) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    register_mtp_patterns(model)
    return model


@pytest.fixture(scope="module")
def trained():
    """Native models trained a few steps on progressions, so that drafts are accepted some of the time."""
    return {case: train_briefly(native_model(*case)) for case in CASES}


# ----------------------------------------------------------------------------------------------- 1. semantics
def test_layout_default_is_decided_by_the_host_family():
    glm = native_model("glm4_moe", 1)
    assert glm.mtp_config.layout == "native" and isinstance(glm.mtp_modules[0], NativeMTPModule)
    assert glm.hparams["mtp"]["layout"] == "native"  # resolved, so a checkpoint rebuilds the same modules
    explicit = HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(layout="lightning"))
    explicit.configure_model()
    assert isinstance(explicit.mtp_modules[0], CascadedMTPModule)
    # a setting the native layout cannot have is refused (it took fresh lightning heads, leaving a folder's trained
    # MTP layers unused without a word); asked for, the lightning layout takes it
    with pytest.raises(ValueError, match=r"--model.mtp.layout.*native MTP layers.*--model.mtp.layout lightning"):
        HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(architecture="parallel"))
    parallel = HFCausalLM("glm4_moe", family_config("glm4_moe", 1),
                          mtp=MTPConfig(architecture="parallel", layout="lightning"))
    assert parallel.mtp_config.layout == "lightning"
    llama = HFCausalLM("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4), mtp=MTPConfig())
    assert llama.mtp_config.layout == "lightning"
    assert MTPConfig().layout is None


def test_layout_is_validated_naming_the_flag():
    with pytest.raises(ValueError, match=r"MTPConfig.layout \(--model.mtp.layout\) must be one of"):
        MTPConfig(layout="deepseek")
    with pytest.raises(ValueError, match=r"--model.mtp.layout.*architecture='parallel'"):
        MTPConfig(layout="native", architecture="parallel")
    with pytest.raises(ValueError, match=r"--model.mtp.layout.*recompute=True"):
        MTPConfig(layout="native", recompute=True)
    with pytest.raises(ValueError, match=r"--model.mtp.layout.*LlamaForCausalLM"):
        HFCausalLM("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4), mtp=MTPConfig(layout="native"))


@pytest.mark.parametrize("family", FAMILIES)
def test_native_blocks_are_the_hosts_own_decoder_layers(family):
    model = native_model(family, 2)
    last = model.trunk.model.layers[-1]
    for module in model.mtp_modules:
        assert type(module.block) is type(last)
        assert type(module.block.mlp).__name__.endswith("MoE")  # the MTP block is an MoE layer (first_k_dense = 0)
        assert module.block.mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert type(module.enorm) is type(module.hnorm) is type(module.post_norm) is type(last.input_layernorm)
    assert [m.depth for m in model.mtp_modules] == [1, 2]


@pytest.mark.parametrize("family,layers,attention", [(*case, "sdpa") for case in CASES] +
                         [("deepseek_v3", 2, "eager"), ("glm4_moe", 2, "eager")],
                         ids=[f"{i}-sdpa" for i in IDS] + ["deepseek_v3-2-eager", "glm4_moe-2-eager"])
def test_depth_logits_equal_transformers_mtp_model(family, layers, attention):
    model = native_model(family, layers, attn_implementation=attention).eval()
    assert model.mtp_modules[0].block.self_attn.config._attn_implementation == attention
    perturb(model.mtp_modules, seed=3)
    reference = transformers_mtp(model)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(input_ids)  # (B, T, H) after the trunk's final norm
        forward = model.mtp_forward(hidden, input_ids)
        expected = reference_depth_logits(reference, hidden, input_ids)
        for k in range(1, layers + 1):
            ours = model.mtp_depth_logits(k, forward.depth_hidden[k - 1])
            torch.testing.assert_close(ours, expected[k - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_native_depths_are_causal(attention):
    model = native_model("deepseek_v3", 2, attn_implementation=attention).eval()
    input_ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = input_ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % VOCAB
    with torch.no_grad():
        before = model.mtp_forward(model(input_ids), input_ids).depth_hidden
        after = model.mtp_forward(model(changed), changed).depth_hidden
    for k, (a, b) in enumerate(zip(before, after), start=1):
        first = 8 - k  # depth k at position i reads t(i+k): position 8-k is the first to see token 8
        torch.testing.assert_close(a[:, :first], b[:, :first])
        assert not torch.allclose(a[:, first], b[:, first])


def test_training_reaches_every_native_parameter():
    model = native_model("glm4_moe", 2)
    model.compute_lm_loss(torch.randint(0, VOCAB, (2, 16))).loss.backward()
    for name, parameter in model.mtp_modules.named_parameters():
        assert parameter.grad is not None, name


# ----------------------------------------------------------------------------------------------- 2. import
@pytest.mark.parametrize("family", FAMILIES)
def test_import_loads_the_folders_layers_and_adds_fresh_depths(tmp_path, family):
    trunk, reference = write_transformers_folder(tmp_path, family, layers=2)
    copies = {"model.layers.2.shared_head.head.weight": torch.zeros(VOCAB, 32),
              "model.layers.2.embed_tokens.weight": torch.zeros(VOCAB, 32)}  # some releases carry them: unused
    edit_folder(tmp_path, lambda t: t.update(copies))
    model = HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=3))
    with pytest.warns(UserWarning, match=r"model\.layers\.2\.embed_tokens\.weight, model\.layers\.2\.shared_head"
                                         r"\.head\.weight differ from the trunk's embedding / head"):
        model.configure_model()
    report = model.mtp_native_report
    assert sorted(report.loaded) == [1, 2] and report.fresh == [3] and report.checkpoint_layers == 2
    assert "model.layers.2.enorm.weight" in report.loaded[1]
    assert "model.layers.3.shared_head.norm.weight" in report.loaded[2]
    assert any(".mlp.gate.e_score_correction_bias" in key for key in report.loaded[1])
    assert sorted(report.ignored) == sorted(copies)
    for ours, theirs in [(model.trunk.get_input_embeddings(), trunk.get_input_embeddings()),
                         (model.trunk.get_output_embeddings(), trunk.get_output_embeddings())]:
        torch.testing.assert_close(ours.weight, theirs.weight, atol=0, rtol=0)  # the zero copies reach no weight
    for k in range(2):
        ours = model.mtp_modules[k].state_dict()
        for key, tensor in reference.layers[k].state_dict().items():
            name = "block." + key.removeprefix("mtp_block.") if key.startswith("mtp_block.") else key
            torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        hidden = model(input_ids)
        forward = model.mtp_forward(hidden, input_ids)
        expected = reference_depth_logits(transformers_mtp(model), hidden, input_ids)
        for k in (1, 2):
            torch.testing.assert_close(model.mtp_depth_logits(k, forward.depth_hidden[k - 1]), expected[k - 1],
                                       atol=1e-5, rtol=1e-5)


def test_a_folder_declaring_no_mtp_layers_starts_every_depth_fresh(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4_moe", **family_config("glm4_moe", 0))).save_pretrained(
        tmp_path)
    model = HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2))
    model.configure_model()
    report = model.mtp_native_report
    assert report.loaded == {} and report.fresh == [1, 2] and report.checkpoint_layers == 0


@pytest.mark.parametrize("layers", [1, 2])
def test_a_config_declaring_layers_the_weights_hold_none_of_warns_and_starts_fresh(tmp_path, layers):
    """transformers' own save_pretrained writes no MTP layer, so every fine-tuned folder of these families declares
    layers it does not hold: taken, with a warning naming the folder and the declared count (never silently)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("glm4_moe", **family_config("glm4_moe", layers))
                                     ).save_pretrained(tmp_path)
    model = HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2))
    with pytest.warns(UserWarning, match=rf"{tmp_path}: config.json declares num_nextn_predict_layers={layers} but "
                                         r"the weights hold no MTP layer .*every MTP depth starts fresh"):
        model.configure_model()
    assert model.mtp_native_report.loaded == {} and model.mtp_native_report.fresh == [1, 2]


def test_native_modules_follow_the_trunks_dtype_but_keep_the_router_in_fp32():
    torch.manual_seed(0)
    model = HFCausalLM("deepseek_v3", family_config("deepseek_v3", 1))
    model.trunk.to(torch.bfloat16)
    model.configure_model()
    module = model.mtp_modules[0]
    assert module.eh_proj.weight.dtype == module.post_norm.weight.dtype == torch.bfloat16
    assert module.block.mlp.gate.weight.dtype == module.block.mlp.gate.e_score_correction_bias.dtype == torch.float32
    with torch.no_grad():
        out = generate(model.eval(), torch.tensor([[1, 2, 3, 4]]), 4, speculative=True)
    assert out.new_tokens.shape == (1, 4)


def test_import_refuses_missing_and_misshapen_tensors(tmp_path):
    write_transformers_folder(tmp_path, "glm4_moe", layers=1)
    edit_folder(tmp_path, lambda t: t.pop("model.layers.2.mlp.gate.e_score_correction_bias"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.gate\.e_score_correction_bias missing"):
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=1)).configure_model()
    write_transformers_folder(tmp_path, "glm4_moe", layers=1)
    edit_folder(tmp_path, lambda t: t.update({"model.layers.2.eh_proj.weight": torch.zeros(32, 32)}))
    with pytest.raises(ValueError, match=r"eh_proj\.weight has shape \[32, 32\], the module's is \[32, 64\]"):
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=1)).configure_model()
    write_transformers_folder(tmp_path, "glm4_moe", layers=1)
    edit_folder(tmp_path, lambda t: t.update({"model.layers.2.self_attn.q_norm.weight": torch.ones(8),
                                              "model.layers.2.shared_head.head.weight": torch.zeros(VOCAB, 32)}))
    with pytest.raises(ValueError, match=r"self_attn\.q_norm\.weight unexpected") as refused:
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=1)).configure_model()
    assert "shared_head.head" not in str(refused.value)  # the main model's head serves every depth: ignored


def test_import_refuses_a_config_declaring_more_layers_than_the_weights_hold(tmp_path):
    write_transformers_folder(tmp_path, "deepseek_v3", layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="declares num_nextn_predict_layers=2 but the weights hold MTP layers"):
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2)).configure_model()


@pytest.mark.parametrize("declared", [1, 0])
def test_import_refuses_layers_the_config_does_not_declare(tmp_path, declared):
    """Trained layers beyond ``num_nextn_predict_layers`` would be silently ignored: refused, naming them."""
    write_transformers_folder(tmp_path, "glm4_moe", layers=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = declared
    (tmp_path / "config.json").write_text(json.dumps(config))
    layers = r"model\.layers\.3\.\*" if declared else r"model\.layers\.2\.\*, model\.layers\.3\.\*"
    with pytest.raises(ValueError, match=rf"{tmp_path}: the weights hold MTP layers {layers} \(.*model\.layers\."
                                         rf"{2 + declared}\.eh_proj\.weight.*\) that config.json does not declare "
                                         rf"\(num_nextn_predict_layers={declared}\).*set num_nextn_predict_layers "
                                         "to 2"):
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2)).configure_model()


@pytest.mark.parametrize("key,value", [("model.layers.3.eh_proj.weight", float("nan")),
                                       ("model.layers.2.mlp.experts.1.up_proj.weight", float("inf"))])
def test_import_refuses_non_finite_mtp_tensors_naming_the_first(tmp_path, key, value):
    """A NaN or infinity in an imported layer (an expert's too, fused on load) is refused at import, naming the key
    on disk, not left for the fit to report as a divergence at step 0."""
    write_transformers_folder(tmp_path, "glm4_moe", layers=2)

    def spoil(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value

    edit_folder(tmp_path, spoil)
    layer = int(key.split(".")[2]) - 2
    with pytest.raises(ValueError, match=rf"{tmp_path}: MTP layer {layer}'s {re.escape(key)} holds NaN or infinite"):
        HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2)).configure_model()
    if layer == 1:  # only the layers imported are checked: depth 1 alone loads
        model = HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=1))
        model.configure_model()
        assert sorted(model.mtp_native_report.loaded) == [1]


# ----------------------------------------------------------------------------------------------- 3. export
@pytest.mark.parametrize("family,layers", CASES, ids=IDS)
def test_export_decodes_with_transformers_use_mtp_like_plain_greedy(tmp_path, trained, family, layers, monkeypatch):
    model = trained[(family, layers)]
    assert model.save_pretrained(str(tmp_path)) == str(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == layers
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert {f"model.layers.{2 + k}.{name}" for k in range(layers)
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                         "mlp.gate.e_score_correction_bias")} <= keys
    assert_serving_copies(tmp_path, model, layers)  # transformers decodes below with them in the folder
    loaded = loaded_with_mtp(tmp_path)
    prompt = (torch.tensor([[5]]) + torch.arange(6) * 6) % VOCAB
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=16)
    steps = TransformersSteps(monkeypatch)
    with_mtp = loaded.generate(prompt, do_sample=False, max_new_tokens=16, use_mtp=True)
    assert torch.equal(with_mtp, plain)
    assert sum(steps.accepted) > 0  # the exported layers draft tokens that are accepted


def serving_copy_keys(layers: int) -> set[str]:
    return {f"model.layers.{2 + k}.{name}" for k in range(layers)
            for name in ("embed_tokens.weight", "shared_head.head.weight")}


def assert_serving_copies(folder, model: HFCausalLM, layers: int) -> None:
    """Each MTP layer's ``embed_tokens`` / ``shared_head.head`` equal the trunk's embedding / head, dtype included."""
    embedding, head = model.trunk.get_input_embeddings().weight, model.trunk.get_output_embeddings().weight
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert serving_copy_keys(layers) <= set(handle.keys())
        for k in range(layers):
            for name, expected in (("embed_tokens.weight", embedding), ("shared_head.head.weight", head)):
                copy = handle.get_tensor(f"model.layers.{2 + k}.{name}")
                assert copy.dtype == expected.dtype and torch.equal(copy, expected.detach()), (k, name)


def test_serving_copies_are_ignored_on_import_and_left_out_on_request(tmp_path):
    """The copies vLLM loads per MTP layer: written by default (bf16 trunk: bf16 copies), reported as ignored by the
    import, left out by ``serving_copies=False`` and ``lightning-mtp export --no_serving_copies``."""
    torch.manual_seed(0)
    model = HFCausalLM("deepseek_v3", family_config("deepseek_v3", 2), mtp=MTPConfig(depth=2))
    model.trunk.to(torch.bfloat16)
    model.configure_model()
    model.save_pretrained(str(tmp_path / "copies"))
    assert_serving_copies(tmp_path / "copies", model, 2)
    again = HFCausalLM(pretrained=str(tmp_path / "copies"), mtp=MTPConfig(depth=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.configure_model()
    assert not [w for w in caught if "differ from the trunk" in str(w.message)]  # equal copies: no warning
    report = again.mtp_native_report
    assert sorted(report.loaded) == [1, 2] and sorted(report.ignored) == sorted(serving_copy_keys(2))
    assert "ignored 4 keys" in report.summary()
    model.save_pretrained(str(tmp_path / "plain"), serving_copies=False)
    trainer = L.Trainer(max_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "native.ckpt")
    cli_main(["export", "--ckpt_path", str(tmp_path / "native.ckpt"), "--out", str(tmp_path / "cli"),
              "--no_serving_copies"])
    keys = {}
    for name in ("copies", "plain", "cli"):
        with safe_open(str(tmp_path / name / "model.safetensors"), framework="pt") as handle:
            keys[name] = set(handle.keys())
    assert keys["plain"] == keys["cli"] == keys["copies"] - serving_copy_keys(2)
    plain = HFCausalLM(pretrained=str(tmp_path / "plain"), mtp=MTPConfig(depth=2))
    plain.configure_model()
    assert sorted(plain.mtp_native_report.loaded) == [1, 2] and plain.mtp_native_report.ignored == []


def test_transformers_needs_the_patterns_for_unreleased_layer_counts(tmp_path, trained):
    """The static-pattern caveat, as it is: with 2 main layers (not 46/92), from_pretrained reports the MTP tensors
    as unexpected and generate(use_mtp=True) finds none until register_mtp_patterns is called."""
    trained[("glm4_moe", 1)].save_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([[5, 11, 17]])
    with pytest.raises(RuntimeError, match="MtpModel weights are missing"):
        model.generate(prompt, do_sample=False, max_new_tokens=4, use_mtp=True)
    assert register_mtp_patterns(model) == [r"model\.layers\.2\..*"]
    assert type(model)._keys_to_ignore_on_load_unexpected == [r"model\.layers\.92.*", r"model\.layers\.46.*"]
    model.generate(prompt, do_sample=False, max_new_tokens=4, use_mtp=True)


def test_sharded_export_adds_an_indexed_shard_that_transformers_and_import_read(tmp_path, trained):
    model = trained[("deepseek_v3", 2)]
    model.save_pretrained(str(tmp_path), max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2 and index["model.layers.3.eh_proj.weight"] == "model-mtp.safetensors"
    loaded = loaded_with_mtp(tmp_path)
    prompt = (torch.tensor([[5]]) + torch.arange(6) * 6) % VOCAB
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=8)
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=8, use_mtp=True), plain)
    again = HFCausalLM(pretrained=str(tmp_path), mtp=MTPConfig(depth=2))
    again.configure_model()
    assert sorted(again.mtp_native_report.loaded) == [1, 2]
    for key, tensor in model.mtp_modules.state_dict().items():
        torch.testing.assert_close(again.mtp_modules.state_dict()[key], tensor, atol=0, rtol=0)


def test_released_layer_counts_need_no_patterns(tmp_path):
    """With glm4_moe's released count of 46 main layers the class's own pattern finds the MTP layer: nothing is
    reported as unexpected and use_mtp works on a plain from_pretrained."""
    config = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=46,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, n_routed_experts=2, num_experts_per_tok=1,
                  first_k_dense_replace=46, max_position_embeddings=64, num_nextn_predict_layers=1,
                  eos_token_id=None)
    model = HFCausalLM("glm4_moe", config, mtp=MTPConfig(depth=1))
    model.configure_model()
    model.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([[1, 2, 3]])
    plain = loaded.generate(prompt, do_sample=False, max_new_tokens=6)
    assert torch.equal(loaded.generate(prompt, do_sample=False, max_new_tokens=6, use_mtp=True), plain)


def test_export_refuses_what_transformers_cannot_load(tmp_path):
    lightning = HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(layout="lightning"))
    with pytest.raises(ValueError, match="layout='lightning'.*--model.mtp.layout native"):
        lightning.save_pretrained(str(tmp_path))
    parallel = HFCausalLM("glm4_moe", family_config("glm4_moe", 1),
                          mtp=MTPConfig(architecture="parallel", layout="lightning"))
    with pytest.raises(ValueError, match="layout='lightning'"):
        parallel.save_pretrained(str(tmp_path))
    llama = HFCausalLM("llama", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4))
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has no native MTP layers"):
        llama.save_pretrained(str(tmp_path))
    assert not os.listdir(tmp_path)


def folder_state(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


class Killed(BaseException):
    """What a kill, or Ctrl-C, does to a save: the rest of it never runs."""


def test_an_interrupted_save_pretrained_leaves_the_earlier_folder_as_it_was(tmp_path, trained, monkeypatch):
    """A save stopped after the trunk and before the MTP layers (where a kill left a config declaring MTP layers
    beside weights holding none) leaves the earlier save, and nothing beside it; a complete one keeps the user's
    files and drops the earlier weights."""
    model, out = trained[("glm4_moe", 2)], tmp_path / "out"
    model.save_pretrained(str(out), max_shard_size="40KB")
    (out / "notes.txt").write_text("mine")
    before = folder_state(out)

    def killed(folder, tensors):
        raise Killed

    monkeypatch.setattr(export_module, "_add_tensors", killed)
    with pytest.raises(Killed):
        model.save_pretrained(str(out))
    assert folder_state(out) == before
    assert os.listdir(tmp_path) == ["out"]
    monkeypatch.undo()
    model.save_pretrained(str(out))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"]
    assert os.listdir(tmp_path) == ["out"]
    again = HFCausalLM(pretrained=str(out), mtp=MTPConfig(depth=2))
    again.configure_model()
    assert sorted(again.mtp_native_report.loaded) == [1, 2]


def test_an_export_removes_the_partial_folders_killed_exports_left_but_not_running_ones(tmp_path, trained, caplog):
    """A killed export leaves its hidden ``.NAME.partial-XXXXXXXX``; the next export into NAME removes it. One whose
    writer still runs (it holds the folder's ``flock``) is kept, as is anything else beside NAME."""
    fcntl = pytest.importorskip("fcntl")
    stale, running, other = (tmp_path / ".out.partial-deadbeef", tmp_path / ".out.partial-0123abcd",
                             tmp_path / ".other.partial-deadbeef")
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    held = os.open(running, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with caplog.at_level("INFO"):
            trained[("glm4_moe", 1)].save_pretrained(str(tmp_path / "out"))
    finally:
        os.close(held)
    assert sorted(os.listdir(tmp_path)) == [".other.partial-deadbeef", ".out.partial-0123abcd", "out"]
    assert "removed .out.partial-deadbeef" in caplog.text and "kept .out.partial-0123abcd" in caplog.text


def test_a_partial_folder_is_written_in_place(tmp_path, trained, monkeypatch):
    """``lightning-mtp export`` saves into its own partial folder (then adds the tokenizer and renames it): that one
    is written in place, not through one more partial folder beside it that a kill would leave behind too."""
    staging = tmp_path / ".out.partial-0123abcd"
    staging.mkdir()
    written = []
    add_tensors = export_module._add_tensors
    monkeypatch.setattr(export_module, "_add_tensors", lambda folder, tensors: (written.append(folder),
                                                                               add_tensors(folder, tensors)))
    trained[("glm4_moe", 1)].save_pretrained(str(staging))
    assert written == [str(staging)] and os.listdir(tmp_path) == [staging.name]
    assert "model.safetensors" in os.listdir(staging)


# ----------------------------------------------------------------------------------------------- 4. our decoding
def test_native_layouts_get_the_native_chain_drafter():
    model = native_model("glm4_moe", 2)
    assert type(chain_drafter(model)) is NativeMTPDrafter
    lightning = HFCausalLM("glm4_moe", family_config("glm4_moe", 1), mtp=MTPConfig(layout="lightning"))
    assert type(chain_drafter(lightning)) is not NativeMTPDrafter


NATIVE_CHAINS_ONLY = r"native MTP layers \(MTPConfig.layout='native'\) draft chains of at most D=2 tokens"


@pytest.mark.parametrize("speculative,options", [
    (True, dict(draft_tokens=3)), (True, dict(draft_tree=[2, 1])), (True, dict(draft_tree_nodes=4)),
    ("auto", dict(draft_tokens=3)), ("auto", dict(draft_tree=[2, 1])),
], ids=["chain-beyond-D", "tree", "tree-nodes", "auto-beyond-D", "auto-tree"])
def test_native_layouts_refuse_trees_and_chains_beyond_d_naming_the_layout(speculative, options):
    """Native layers draft one chain of at most D tokens: asking for more names the layout, not the host, which
    verifies trees and longer chains for the lightning layout's modules."""
    model = native_model("glm4_moe", 2).eval()
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=NATIVE_CHAINS_ONLY):
        generate(model, prompt, 4, speculative=speculative, **options)
    lightning = HFCausalLM("glm4_moe", family_config("glm4_moe", 2), mtp=MTPConfig(depth=2, layout="lightning"))
    lightning.configure_model()
    plain = generate(lightning.eval(), prompt, 4, speculative=False)
    assert torch.equal(generate(lightning, prompt, 4, speculative=speculative, **options).sequences, plain.sequences)


def test_positional_cache_masks_slots_after_each_query():
    cache = PositionalLayerCache(batch_size=2, max_len=5)
    mask = cache.step(torch.tensor([[1, 2], [3, 4]]), torch.float32)  # (B, 1, 2, 5)
    assert (mask[0, 0, 0] == 0).tolist() == [True, True, False, False, False]
    assert (mask[1, 0, 1] == 0).tolist() == [True] * 5
    keys, values = cache.update(torch.ones(2, 1, 2, 4), torch.full((2, 1, 2, 3), 2.0), 0)
    assert keys.shape == (2, 1, 5, 4) and values.shape == (2, 1, 5, 3)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 1, 0, 0] and values[1, 0, :, 0].tolist() == [0, 0, 0, 2, 2]


@pytest.mark.parametrize("family,layers", CASES, ids=IDS)
def test_our_speculative_decoding_matches_greedy_and_transformers_acceptance(tmp_path, trained, family, layers,
                                                                             monkeypatch):
    model = trained[(family, layers)]
    prompt = (torch.tensor([[5]]) + torch.arange(6) * 6) % VOCAB
    plain = generate(model, prompt, 16, speculative=False)
    ours = OurSteps(monkeypatch)
    speculative = generate(model, prompt, 16, speculative=True)
    assert torch.equal(speculative.sequences, plain.sequences)
    model.save_pretrained(str(tmp_path))
    loaded = loaded_with_mtp(tmp_path)
    theirs = TransformersSteps(monkeypatch)
    reference = loaded.generate(prompt, do_sample=False, max_new_tokens=16, use_mtp=True)
    assert torch.equal(reference, plain.sequences)
    # The same drafts at every step, and the same number accepted; at the last step transformers counts only the
    # accepted drafts that fit max_new_tokens, we count every accepted draft.
    assert ours.drafts == theirs.drafts
    assert ours.accepted[:-1] == theirs.accepted[:-1] and ours.accepted[-1] >= theirs.accepted[-1]
    assert sum(ours.accepted) > 0


def test_speculative_auto_and_batches_decode_native_layouts_losslessly(trained):
    model = trained[("deepseek_v3", 2)]
    prompts = torch.stack([(torch.tensor(s) + torch.arange(6) * 3) % VOCAB for s in (5, 40)])  # (2, 6)
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0  # the second row left-padded: a ragged batch
    plain = generate(model, prompts, 12, speculative=False, attention_mask=mask)
    for speculative in (True, "auto"):
        out = generate(model, prompts, 12, speculative=speculative, attention_mask=mask)
        assert torch.equal(out.sequences, plain.sequences)
    sampled = generate(model, prompts, 12, speculative=True, temperature=1.0, seed=0, attention_mask=mask)
    assert sampled.new_tokens.shape == (2, 12) and sum(sampled.stats.drafted_per_depth) > 0
