"""``HFCausalLM`` and its ``transformers`` KV-cache decoding host, checked against ``transformers`` itself."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers", reason="HFCausalLM needs the optional transformers dependency")

from lightning_mtp import MTPConfig  # noqa: E402
from lightning_mtp.decoding import GenerationConfig, decoding_host  # noqa: E402
from lightning_mtp.decoding.drafting import Drafts  # noqa: E402
from lightning_mtp.decoding.speculative import decode, prepare_prompts  # noqa: E402
from lightning_mtp.kernels.linear_cross_entropy_torch import scale_and_cap  # noqa: E402
from lightning_mtp.models import HFCausalLM  # noqa: E402
from lightning_mtp.models.hf_host import HFCacheHost  # noqa: E402

VOCAB = 96
EOS = 3
CONFIGS = {
    "llama": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True),
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128),
}


def hf_model(model_type: str, depth: int = 3, **kwargs) -> HFCausalLM:
    torch.manual_seed(0)
    config = {**CONFIGS[model_type], "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": 0}
    model = HFCausalLM(model_type, config, mtp=MTPConfig(depth=depth), **kwargs)
    model.configure_model()
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {name: hf_model(name) for name in CONFIGS}


def hf_generate(model: HFCausalLM, ids, mask=None, new=24, eos=None):
    """``transformers``' own greedy ``generate``: the reference. Returns each row's new tokens (list of lists)."""
    out = model.trunk.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)[:, ids.shape[1]:]
    rows = []
    for row in out.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
    return rows


def our_tokens(out) -> list[list[int]]:
    return [row[:n] for row, n in zip(out.new_tokens.tolist(), out.num_new_tokens.tolist())]


def left_padded_prompts(lengths=(9, 5, 2, 7), width=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(lengths), width), generator=gen)
    mask = (torch.arange(width) >= width - torch.tensor(lengths).unsqueeze(1)).long()  # (B, W) left padding
    return ids.masked_fill(mask == 0, 0), mask


# ----------------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_shares_the_models_embedding_and_head(models, model_type):
    model = models[model_type]
    assert model.mtp_token_embedding() is model.trunk.get_input_embeddings()
    assert model.mtp_output_head() is model.trunk.get_output_embeddings()
    tied = model.trunk.config.get_text_config().tie_word_embeddings
    assert (model.mtp_output_head().weight is model.mtp_token_embedding().weight) == tied
    # The trunk state is the model's own final hidden state (after its final norm); the head on it is its logits.
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        hidden = model(ids)
        reference = model.trunk(ids, output_hidden_states=True)
    torch.testing.assert_close(hidden, reference.hidden_states[-1])
    torch.testing.assert_close(model.logits(model.mtp_final_norm()(hidden)), reference.logits)


def test_training_loss_backpropagates_into_trunk_and_heads():
    model = hf_model("llama", depth=2).train()
    out = model.compute_lm_loss(torch.randint(0, VOCAB, (2, 16)))
    out.loss.backward()
    assert out.depth_losses.shape == (2,) and torch.isfinite(out.loss)
    assert model.trunk.get_input_embeddings().weight.grad is not None
    assert all(p.grad is not None for p in model.mtp_modules.parameters())


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_cascaded_depths_read_the_transformers_trunks_embedding_lookup(model_type, monkeypatch):
    """The depths reuse the trunk's lookup of the ids on every host (GPT-2 looks up a reshaped view of them): one
    embedding call per training step, and the loss and every gradient equal those of a second lookup."""
    import contextlib

    from lightning_mtp.mixin import objective

    input_ids = torch.randint(4, VOCAB, (2, 16))
    runs = []
    for reuse in (True, False):
        model = hf_model(model_type, depth=2).train()
        calls = []
        model.trunk.get_input_embeddings().register_forward_hook(lambda module, args, out, calls=calls: calls.append(1))
        if not reuse:
            monkeypatch.setattr(objective.TrunkEmbeddings, "capture", lambda host, ids: contextlib.nullcontext())
        torch.manual_seed(1)
        out = model.compute_lm_loss(input_ids)
        params = [p for p in model.parameters() if p.requires_grad]
        runs.append((out.loss, torch.autograd.grad(out.loss, params), len(calls)))
        monkeypatch.undo()
    (loss, grads, calls), (ref_loss, ref_grads, ref_calls) = runs
    assert (calls, ref_calls) == (1, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_speculative_greedy_equals_transformers_generate_batch_1(models, model_type):
    model = models[model_type]
    ids = torch.randint(4, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=24, speculative=True)
    assert our_tokens(out) == hf_generate(model, ids)
    assert out.stats.max_drafts == 3
    assert our_tokens(model.generate(ids, max_new_tokens=24)) == hf_generate(model, ids)  # "auto"


def test_generate_in_training_mode_decodes_without_dropout_and_keeps_the_mode():
    """gpt2's dropout (0.1) made greedy decoding of a module left in training mode random and unequal to plain
    decoding, silently; generate decodes in eval mode and puts training mode back."""
    torch.manual_seed(0)
    model = HFCausalLM("gpt2", dict(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=128),
                       mtp=MTPConfig(depth=2))
    model.configure_model()
    ids = torch.tensor([[5, 9, 2, 7]])
    model.eval()
    reference = model.generate(ids, 16, speculative=False).sequences
    model.train()
    for speculative in (True, "auto", False, True):
        assert torch.equal(model.generate(ids, 16, speculative=speculative).sequences, reference)
        assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_speculative_greedy_equals_transformers_generate_left_padded(models, model_type):
    model = models[model_type]
    ids, mask = left_padded_prompts()
    out = model.generate(ids, max_new_tokens=20, attention_mask=mask, eos_token_id=EOS)
    assert our_tokens(out) == hf_generate(model, ids, mask, new=20, eos=EOS)
    plain = model.generate(ids, max_new_tokens=20, attention_mask=mask, eos_token_id=EOS, speculative=False)
    assert our_tokens(plain) == our_tokens(out)


class OracleDrafter:
    """Proposes the true continuation, corrupted at a random depth per row and step: ragged acceptance."""

    max_drafts = 3

    def __init__(self, reference, vocab: int, seed: int = 0):
        self.reference, self.vocab = reference, vocab  # (B, L) packed prompt + true continuation
        self.gen = torch.Generator().manual_seed(seed)

    def allocate(self, batch_size, max_len):
        return None

    def observe(self, state, hidden, positions):
        pass

    def commit(self, state, advanced):
        pass

    def draft(self, state, tokens, newest, num_drafts, params, generator=None, confidence_threshold=None):
        batch = tokens.shape[0]
        positions = (newest.unsqueeze(1) + 1 + torch.arange(num_drafts)).clamp(max=self.reference.shape[1] - 1)
        truth = self.reference.gather(1, positions)  # (B, k)
        correct = torch.randint(0, num_drafts + 1, (batch, 1), generator=self.gen)  # drafts right per row
        drafts = torch.where(torch.arange(num_drafts) < correct, truth, (truth + 1) % self.vocab)
        tokens.scatter_(1, positions, drafts)
        return Drafts(drafts, None)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_ragged_acceptance_rolls_back_the_transformers_cache(models, model_type):
    """Rows accept different numbers of drafts each step; the masked/cropped DynamicCache keeps every row exact."""
    model = models[model_type]
    ids, mask = left_padded_prompts()
    expected = hf_generate(model, ids, mask, new=24)
    host = decoding_host(model)
    assert isinstance(host, HFCacheHost)
    prompts, lengths = prepare_prompts(ids, mask, host.vocab_size, torch.device("cpu"))
    reference = torch.zeros(ids.shape[0], prompts.shape[1] + 24 + 8, dtype=torch.long)
    for row, (length, new) in enumerate(zip(lengths.tolist(), expected)):
        reference[row, : length + len(new)] = torch.tensor(prompts[row, :length].tolist() + new)
    out = decode(host, OracleDrafter(reference, VOCAB), prompts, lengths, GenerationConfig(max_new_tokens=24))
    assert our_tokens(out) == expected
    assert out.stats.tau > 1.5  # drafts were accepted, in different amounts per row
    assert len([n for n in out.stats.accepted_length_histogram if n]) > 2


def test_cache_is_cropped_to_the_accepted_tokens_at_batch_1(models):
    model = models["llama"]
    host = decoding_host(model)
    state = host.allocate(1, 32)
    host.forward(torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5).view(1, 5), state)
    host.rollback(state, torch.tensor([3]))
    assert state.cache.get_seq_length() == 3 and state.valid.shape == (1, 3)


# ----------------------------------------------------------------------------------------------- logit transforms
# Models whose forward scales or soft-caps lm_head's output. initializer_range=0.5 makes the logits large enough that
# the transform moves the loss by whole nats (a tiny model's logits are otherwise near 0, where it barely matters).
LOGIT_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.5,
                  bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
LOGIT_CONFIGS = {  # model type: (config, what its forward does: (scale, softcap) on lm_head's output)
    "cohere": (dict(logit_scale=0.25), (0.25, None)),  # logits * logit_scale
    "gemma2": (dict(final_logit_softcapping=3.0, layer_types=["full_attention"] * 2), (1.0, 3.0)),  # 3 tanh(z / 3)
    "granite": (dict(logits_scaling=4.0), (0.25, None)),  # logits / logits_scaling
    "hyperclovax": (dict(logits_scaling=0.5), (0.5, None)),  # logits * logits_scaling (same name, other way round)
}


def transformed_model(model_type: str, depth: int = 2) -> HFCausalLM:
    torch.manual_seed(0)
    model = HFCausalLM(model_type, {**LOGIT_BASE, **LOGIT_CONFIGS[model_type][0]}, mtp=MTPConfig(depth=depth))
    model.configure_model()
    return model.eval()


@pytest.fixture(scope="module")
def transformed_models():
    return {name: transformed_model(name) for name in LOGIT_CONFIGS}


def logit_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, LOGIT_BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", list(LOGIT_CONFIGS))
def test_main_loss_equals_the_models_own_loss_under_logit_transforms(transformed_models, model_type):
    model = transformed_models[model_type]
    ids = logit_ids()
    with torch.no_grad():
        ours = model.compute_lm_loss(ids).main_loss
        reference = model.trunk(input_ids=ids, labels=ids).loss
        raw = model.mtp_output_head()(model(ids)[:, :-1])  # (B, T-1, V) lm_head alone
        untransformed = F.cross_entropy(raw.flatten(0, 1), ids[:, 1:].flatten())
    assert abs(float(untransformed - reference)) > 0.2  # the transform matters on this model
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("model_type", list(LOGIT_CONFIGS))
def test_main_loss_gradient_equals_autograd_through_the_models_loss(model_type):
    model = transformed_model(model_type)
    model.mtp_loss_weight = 0.0  # the MTP rows weigh 0: out.loss is the main loss alone
    ids = logit_ids(1)
    params = list(model.trunk.parameters())
    ours = torch.autograd.grad(model.compute_lm_loss(ids).loss, params)
    reference = torch.autograd.grad(model.trunk(input_ids=ids, labels=ids).loss, params)
    head = next(i for i, p in enumerate(params) if p is model.mtp_output_head().weight)
    assert float(ours[head].abs().max()) > 1e-3
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", list(LOGIT_CONFIGS))
def test_decoding_and_draft_logits_are_transformed_like_the_models(transformed_models, model_type):
    model = transformed_models[model_type]
    scale, softcap = LOGIT_CONFIGS[model_type][1]
    ids = logit_ids(2)
    with torch.no_grad():
        hidden = model(ids)  # (B, T, H)
        reference = model.trunk(input_ids=ids).logits  # (B, T, V)
        torch.testing.assert_close(decoding_host(model).main_logits(hidden), reference)
        torch.testing.assert_close(model.logits(hidden), reference)
        # Drafts: depth k's logits get the same transform as the shared head's.
        state = torch.randn(2, 5, LOGIT_BASE["hidden_size"], generator=torch.Generator().manual_seed(3))
        raw = model.mtp_output_head()(model.mtp_modules[0].norm(state))  # (2, 5, V)
        torch.testing.assert_close(model.mtp_depth_logits(1, state), scale_and_cap(raw, scale, softcap))
        assert not torch.allclose(model.mtp_depth_logits(1, state), raw, atol=1e-3)


@pytest.mark.parametrize("model_type", ["cohere", "gemma2", "granite"])
def test_speculative_greedy_is_lossless_under_logit_transforms(transformed_models, model_type):
    model = transformed_models[model_type]
    ids = torch.randint(4, LOGIT_BASE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    speculative = model.generate(ids, max_new_tokens=16, temperature=0.0, speculative=True)
    plain = model.generate(ids, max_new_tokens=16, temperature=0.0, speculative=False)
    assert our_tokens(speculative) == our_tokens(plain)
    assert our_tokens(plain) == hf_generate(model, ids, new=16)


def test_logit_transforms_we_cannot_reproduce_are_refused_naming_the_model():
    # A class we hold no rule for, whose config sets a logit attribute: refused rather than trained on other logits.
    with pytest.raises(TypeError, match="LlamaForCausalLM \\(model_type 'llama'\\) sets \\{'logit_scale': 0.5\\}"):
        HFCausalLM("llama", dict(CONFIGS["llama"], logit_scale=0.5))
    # Dory's lm_head is an nn.Linear subclass with a learned per-token logit scale in its forward.
    with pytest.raises(TypeError, match="DoryForCausalLM's LM head is a DoryLMHead with its own forward"):
        HFCausalLM("dory", dict(LOGIT_BASE))
    with pytest.raises(TypeError, match="GraniteForCausalLM .*config.logits_scaling = 0"):
        HFCausalLM("granite", dict(LOGIT_BASE, logits_scaling=0))


# ----------------------------------------------------------------------------------------------- bad input
def test_model_without_the_accessors_names_its_class():
    class NotACausalLM(nn.Module):
        pass

    with pytest.raises(TypeError, match="NotACausalLM cannot host MTP heads"):
        HFCausalLM(trunk=NotACausalLM())


def test_cache_that_cannot_roll_back_names_the_model_class():
    torch.manual_seed(0)
    model = HFCausalLM("mistral", dict(CONFIGS["llama"], sliding_window=8), mtp=MTPConfig(depth=2))
    model.configure_model()
    with pytest.raises(TypeError, match="MistralForCausalLM uses a KV cache that lightning-mtp cannot roll back"):
        model.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4)


def test_a_sliding_window_longer_than_the_context_is_named_with_its_remedy_and_warned_at_fit(tmp_path):
    """transformers' default Mistral window (4096) over a 128-token context never drops a token, but the cache is a
    sliding one: decoding was refused without a remedy, after a fit that said nothing."""
    torch.manual_seed(0)
    model = HFCausalLM("mistral", dict(CONFIGS["llama"], sliding_window=4096), mtp=MTPConfig(depth=2))
    with pytest.warns(UserWarning, match="this model trains, but its decoding .* will be refused"):
        _fit(model, tmp_path)
    with pytest.raises(TypeError, match=r"sliding window \(4096 tokens\) is no shorter than its context \(128\).*"
                                        r"sliding_window: null"):
        model.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4)
    full = HFCausalLM("mistral", dict(CONFIGS["llama"], sliding_window=None), mtp=MTPConfig(depth=2))
    full.configure_model()
    assert full.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4, speculative=True).new_tokens.shape == (1, 4)


def test_compile_option_names_its_limit_on_a_transformers_host(models):
    with pytest.raises(ValueError, match="compile .*supports the bundled CausalLM"):
        models["llama"].generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4, compile=True)


def test_trunk_arguments_are_validated(tmp_path):
    with pytest.raises(ValueError, match="must be a local directory"):
        HFCausalLM(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs model_type"):
        HFCausalLM(config={"hidden_size": 32})


# ----------------------------------------------------------------------------------------------- retrofit
def _fit(model: HFCausalLM, tmp_path: Path, steps: int = 2) -> L.Trainer:
    data = torch.utils.data.DataLoader(torch.randint(4, VOCAB, (8, 16)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, data)
    return trainer


def test_retrofit_trains_only_the_heads_and_saves_a_heads_only_checkpoint(tmp_path):
    trained = hf_model("llama", depth=2).trunk
    trained.save_pretrained(tmp_path / "pretrained")
    torch.manual_seed(1)
    model = HFCausalLM(pretrained=str(tmp_path / "pretrained"), freeze_trunk=True, mtp=MTPConfig(depth=2),
                       learning_rate=1e-2, warmup_steps=0)
    assert model.mtp_config.detach_trunk
    model.configure_model()
    trunk_before = {k: v.clone() for k, v in model.trunk.state_dict().items()}
    heads_before = {k: v.clone() for k, v in model.mtp_state_dict().items()}
    trainer = _fit(model, tmp_path)
    assert not model.trunk.training  # frozen trunk stays in eval mode during fit
    assert all(torch.equal(v, model.trunk.state_dict()[k]) for k, v in trunk_before.items())
    assert any(not torch.equal(v, model.mtp_state_dict()[k]) for k, v in heads_before.items())

    # Lightning checkpoint: MTP weights and metadata only; loads back onto the from_pretrained trunk.
    ckpt = tmp_path / "heads.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["state_dict"] and not any(k.startswith("trunk.") for k in saved["state_dict"])
    assert saved["mtp"]["depth"] == 2 and saved["mtp_heads_only"]
    restored = HFCausalLM.load_from_checkpoint(ckpt, weights_only=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)

    # The explicit heads file, loaded through the mtp_heads argument.
    heads = tmp_path / "heads.pt"
    model.save_mtp_heads(str(heads))
    assert not any(k.startswith("trunk.") for k in torch.load(heads, weights_only=True)["state_dict"])
    again = HFCausalLM(pretrained=str(tmp_path / "pretrained"), mtp=MTPConfig(depth=2), mtp_heads=str(heads))
    again.configure_model()
    for key, value in model.mtp_state_dict().items():
        torch.testing.assert_close(again.mtp_state_dict()[key], value)
    ids = torch.tensor([[4, 5, 6, 7]])
    assert torch.equal(again.generate(ids, 10).new_tokens, model.generate(ids, 10).new_tokens)


def test_full_checkpoint_round_trip_rebuilds_the_trunk_from_its_config(tmp_path):
    model = hf_model("gpt2", depth=2)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu")
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    restored = HFCausalLM.load_from_checkpoint(tmp_path / "full.ckpt", weights_only=True)
    assert type(restored.trunk) is type(model.trunk)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)


def test_heads_for_another_trunk_are_refused(tmp_path):
    heads = tmp_path / "heads.pt"
    hf_model("llama", depth=2).save_mtp_heads(str(heads))
    other = hf_model("gpt2", depth=2)
    other.trunk.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(ValueError, match="holds MTP heads for a LlamaForCausalLM"):
        other.load_mtp_heads(str(heads))


def test_heads_trained_over_a_folder_are_refused_when_its_weights_changed(tmp_path):
    """A heads-only checkpoint gets its trunk from the ``pretrained`` folder: a folder replaced by another model of
    the same shapes (or trained further) would silently pair the heads with weights they never saw."""
    folder = tmp_path / "base"
    hf_model("llama", depth=2).trunk.save_pretrained(folder)
    model = HFCausalLM(pretrained=str(folder), freeze_trunk=True, mtp=MTPConfig(depth=2), warmup_steps=0)
    trainer = _fit(model, tmp_path)
    trainer.save_checkpoint(tmp_path / "heads.ckpt")
    model.save_mtp_heads(str(tmp_path / "heads.pt"))
    assert torch.load(tmp_path / "heads.ckpt", weights_only=True)["trunk"]["pretrained"] == str(folder)
    HFCausalLM.load_from_checkpoint(tmp_path / "heads.ckpt", weights_only=True)  # the same folder: taken

    torch.manual_seed(7)  # the same architecture, other weights, in the same folder
    HFCausalLM("llama", {**CONFIGS["llama"], "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": 0},
               mtp=MTPConfig(depth=2)).trunk.save_pretrained(folder)
    changed = r"trained over the weights loaded from .*base'.*has other weights \(another model, or it changed"
    with pytest.raises(ValueError, match=changed):
        HFCausalLM.load_from_checkpoint(tmp_path / "heads.ckpt", weights_only=True)
    with pytest.raises(ValueError, match=changed):
        HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=2),
                   mtp_heads=str(tmp_path / "heads.pt")).configure_model()


def test_a_frozen_fit_over_a_wrapped_trunk_keeps_its_trunk_and_heads_never_land_on_another(tmp_path):
    """``from_model(model, freeze_trunk=True)``: a heads-only checkpoint had no folder to take the trunk from again,
    and ``load_from_checkpoint`` filled it with a config-built trunk's random weights, silently. Now its checkpoint
    keeps the trunk; heads-only files (``save_trunk=False``, ``save_mtp_heads``) are refused on another trunk."""
    trained = hf_model("llama", depth=2).trunk
    model = HFCausalLM.from_model(trained, freeze_trunk=True, mtp=MTPConfig(depth=2), warmup_steps=0)
    trainer = _fit(model, tmp_path)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    restored = HFCausalLM.load_from_checkpoint(tmp_path / "full.ckpt", weights_only=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[key], value)

    heads_only = HFCausalLM.from_model(trained, freeze_trunk=True, save_trunk=False, mtp=MTPConfig(depth=2))
    _fit(heads_only, tmp_path).save_checkpoint(tmp_path / "heads.ckpt")
    wrapped = "trained over a trunk that was wrapped or built from its config.*fresh weights\\) has other weights"
    with pytest.raises(ValueError, match=wrapped):
        HFCausalLM.load_from_checkpoint(tmp_path / "heads.ckpt", weights_only=True)  # a random trunk
    again = HFCausalLM.from_model(trained, mtp=MTPConfig(depth=2), mtp_heads=str(tmp_path / "heads.ckpt"))
    again.configure_model()  # the trunk they were trained over: taken
    other = hf_model("llama", depth=2).trunk
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)  # the same architecture, other weights
    with pytest.raises(ValueError, match="has other weights"):
        HFCausalLM.from_model(other, mtp=MTPConfig(depth=2), mtp_heads=str(tmp_path / "heads.ckpt")).configure_model()


def test_heads_saved_after_the_trunk_trained_are_refused_on_the_folder_it_started_from(tmp_path):
    """``save_mtp_heads`` after a fit that trained the trunk described the folder's weights, which the heads were not
    trained over."""
    folder = tmp_path / "base"
    hf_model("llama", depth=2).trunk.save_pretrained(folder)
    model = HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=2), warmup_steps=0, learning_rate=1e-2)
    _fit(model, tmp_path)
    model.save_mtp_heads(str(tmp_path / "heads.pt"))
    with pytest.raises(ValueError, match="has other weights"):
        HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=2), mtp_heads=str(tmp_path / "heads.pt")
                   ).configure_model()


def test_heads_that_are_not_a_checkpoint_file_are_named(tmp_path):
    model = hf_model("llama", depth=2)
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"--model.init_args.mtp_heads '.*tmp.*' is a directory but not"):
        model.load_mtp_heads(str(tmp_path))
    with pytest.raises(ValueError, match=r"--model.init_args.mtp_heads '.*text.pt'.*not a PyTorch checkpoint"):
        model.load_mtp_heads(str(tmp_path / "text.pt"))


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_fits_with_the_hf_llama_config(tmp_path):
    from lightning_mtp.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 40)
    config = Path(__file__).resolve().parents[1] / "configs" / "hf_llama.yaml"
    tiny = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    overrides = [arg for key, value in tiny.items() for arg in (f"--model.init_args.config.{key}", str(value))]
    main(["fit", "--config", str(config), "--trainer.accelerator", "cpu", "--trainer.max_steps", "2",
          "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
          "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path), *overrides,
          "--data.init_args.tokenizer", "byte", "--data.init_args.corpus", str(corpus),
          "--data.init_args.seq_len", "16", "--data.init_args.batch_size", "4", "--data.init_args.val_fraction", "0.3",
          "--data.init_args.cache_dir", str(tmp_path / "cache")])


@pytest.mark.parametrize("model_type", ["cohere", "gemma2"])
def test_callbacks_read_logits_transformed_like_the_models(transformed_models, model_type):
    """The coupling monitor / draft calibration (teacher-forced logits), distillation and diversity form their
    probabilities as the host does: on a soft-capped or scaled model the main logits equal transformers' own."""
    from lightning_mtp.callbacks._teacher_forcing import sequence_logits, teacher_forced_forward
    from lightning_mtp.head_calls import depth_head, head_logits

    model = transformed_models[model_type]
    scale, softcap = LOGIT_CONFIGS[model_type][1]
    ids = logit_ids(2)
    with torch.no_grad():
        fwd = teacher_forced_forward(model, ids)
        _, main, depths = next(sequence_logits(model, fwd, chunk_size=10_000))
        torch.testing.assert_close(main, model.trunk(input_ids=ids).logits[:, :-1].float())
        raw = depth_head(model, 1)(fwd.depth_hidden[0]).float()
        torch.testing.assert_close(depths[0], scale_and_cap(raw, scale, softcap))
        torch.testing.assert_close(head_logits(model, depth_head(model, 1))(fwd.depth_hidden[0]), depths[0])


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("options", [{"speculative": True, "draft_tree": [12, 4, 1]},
                                     {"speculative": True, "draft_tree_nodes": 24, "draft_tree_top_k": 8},
                                     {"speculative": True, "draft_tokens": 5}, {"speculative": "auto"}],
                         ids=["static-tree", "dynamic-tree", "beyond-depth", "auto"])
def test_tree_verification_on_the_transformers_cache_is_lossless(models, model_type, options):
    """Trees through a 4-D mask on the DynamicCache, the accepted path compacted in place; ragged left padding."""
    model = models[model_type]
    ids, mask = left_padded_prompts()
    out = model.generate(ids, max_new_tokens=20, attention_mask=mask, eos_token_id=EOS, **options)
    assert our_tokens(out) == hf_generate(model, ids, mask, new=20, eos=EOS)
    if "draft_tree" in options:
        assert out.stats.tau > 1.05  # wide trees get drafts accepted even from untrained heads


def test_a_misspelt_config_key_is_refused_naming_the_key_it_resembles():
    """``AutoConfig.for_model`` keeps an unknown key aside and builds the default: ``num_hiden_layers: 1`` trained
    the default depth, silently. Keys transformers converts (``attn_implementation``, ``rope_scaling``) pass."""
    with pytest.raises(ValueError, match=r"^HFCausalLM.config \(--model.init_args.config\): LlamaConfig has no "
                                         r"'num_hiden_layers' \(did you mean 'num_hidden_layers'\?\)"):
        HFCausalLM("llama", {**CONFIGS["llama"], "num_hiden_layers": 1})
    model = HFCausalLM("llama", {**CONFIGS["llama"], "attn_implementation": "eager",
                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    model.configure_model()
    assert model.trunk.config.num_hidden_layers == CONFIGS["llama"]["num_hidden_layers"]


def test_the_context_refusal_of_a_model_folder_names_its_config_not_a_flag_that_is_refused(tmp_path):
    """``--model.init_args.config.*`` is refused beside ``pretrained``: the context a folder's model has is its
    config.json's, and the advice is to lower --data.seq_len."""
    from model_folders import model_folder

    folder = model_folder(tmp_path / "model")
    model = HFCausalLM(pretrained=str(folder), mtp=MTPConfig(depth=1))
    flag = model.mtp_context_flag()
    assert "config.json" in flag and "--model.init_args.config" not in flag
    built = HFCausalLM("llama", CONFIGS["llama"])
    assert "--model.init_args.config.max_position_embeddings" in built.mtp_context_flag()


def test_a_bfloat16_folder_trains_in_float32_weights_unless_the_precision_says_otherwise(tmp_path):
    """A folder saved in bfloat16 (``"dtype": "bfloat16"`` in config.json, as real checkpoints ship) was loaded in
    bfloat16 (transformers' default reads the folder's dtype): under ``precision="32-true"`` its weights, the fresh
    MTP heads and AdamW's states were bfloat16, and updates under half a bfloat16 step never landed (the norms'
    weights stayed exactly 1.0). Lightning's precision decides the dtype: 32-true keeps float32 weights."""
    hf_model("llama", depth=2).trunk.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert '"bfloat16"' in (tmp_path / "bf16" / "config.json").read_text()
    model = HFCausalLM(pretrained=str(tmp_path / "bf16"), freeze_trunk=True, mtp=MTPConfig(depth=2),
                       learning_rate=1e-4, warmup_steps=0)
    model.configure_model()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    norms = {k: v.clone() for k, v in model.mtp_state_dict().items() if "norm" in k}
    trainer = _fit(model, tmp_path)
    assert {state["exp_avg"].dtype for state in trainer.optimizers[0].state.values()} == {torch.float32}
    assert all(not torch.equal(model.mtp_state_dict()[k], v) for k, v in norms.items())  # 1e-4 steps land


def test_drafts_deeper_than_d_near_a_learned_position_limit_are_refused_not_a_crash():
    """GPT-2's positions end at n_positions: the budget left room for D verified drafts, and draft_tokens 4 (or a
    tree deeper than D + 1) verified past it (IndexError in its position embedding)."""
    torch.manual_seed(0)
    model = HFCausalLM("gpt2", dict(CONFIGS["gpt2"], n_positions=40, bos_token_id=1, eos_token_id=None),
                       mtp=MTPConfig(depth=2))
    model.configure_model()
    model.eval()
    prompt = torch.randint(4, VOCAB, (1, 20))
    out = model.generate(prompt, 18, speculative=True)  # 20 + 18 = max_context: D verified past it fit
    assert out.new_tokens.shape == (1, 18)
    for options in ({"draft_tokens": 4}, {"draft_tree": [2, 2, 2, 1]}):
        with pytest.raises(ValueError, match="exceeds the model's context of 36 tokens"):
            model.generate(prompt, 18, speculative=True, **options)
        assert model.generate(prompt, 16, speculative=True, **options).new_tokens.shape == (1, 16)


def test_trees_on_an_alibi_model_are_refused_naming_it_and_chains_decode():
    """Bloom builds its ALiBi biases from a 2-D attention mask: a tree's 4-D mask failed inside transformers
    ("too many values to unpack"), a traceback on the command line."""
    torch.manual_seed(0)
    model = HFCausalLM("bloom", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, bos_token_id=1,
                                     eos_token_id=None, pad_token_id=0), mtp=MTPConfig(depth=2))
    model.configure_model()
    model.eval()
    prompt = torch.randint(4, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="BloomForCausalLM builds its ALiBi biases from a 2-D attention mask"):
        model.generate(prompt, 8, speculative=True, draft_tree=[2, 1])
    reference = model.trunk.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                     max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(prompt, 8, speculative=True).sequences, reference)


def test_a_family_that_names_its_context_otherwise_is_held_to_it():
    """MPT's context is max_seq_len: it fell back to 4096, so a prompt past it was accepted and failed inside the
    model ("The size of tensor a (161) must match the size of tensor b (160)")."""
    torch.manual_seed(0)
    model = HFCausalLM("mpt", dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=40,
                                   bos_token_id=1, eos_token_id=None, pad_token_id=0), mtp=MTPConfig(depth=2))
    assert model.max_positions == 40
    model.configure_model()
    with pytest.raises(ValueError, match="exceeds the model's context of 38 tokens"):
        model.generate(torch.randint(4, VOCAB, (1, 30)), 10, speculative=False)
