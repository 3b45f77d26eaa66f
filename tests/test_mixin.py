"""MTPMixin: causality, gradient flow into shared weights, detached trunk, custom hosts, idempotent construction."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mtp import MTPConfig, MTPMixin
from lightning_mtp.decoding import GenerationConfig


def depth_logits(model, input_ids):
    """[(B, T-k-1, V) for k = 0..D]: the prediction of every (depth, position) that has a target."""
    hidden = model(input_ids)
    fwd = model.mtp_forward(hidden, input_ids)
    main = model.lm_head(model.norm(hidden[:, :-1]))
    return [main] + [model.lm_head(h) for h in fwd.depth_hidden]


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_changing_a_token_changes_no_prediction_of_it_or_earlier(make_tiny_model, architecture):
    model = make_tiny_model(depth=3, architecture=architecture)
    torch.manual_seed(0)
    T = 14
    input_ids = torch.randint(0, 61, (1, T))
    before = depth_logits(model, input_ids)
    for j in range(T):
        changed = input_ids.clone()
        changed[0, j] = (changed[0, j] + 1) % 61
        after = depth_logits(model, changed)
        for k, (a, b) in enumerate(zip(before, after)):
            for i in range(a.shape[1]):
                target = i + k + 1
                same = torch.allclose(a[0, i], b[0, i], atol=1e-6)
                if target <= j:
                    assert same, f"depth {k} position {i} (target t({target})) saw t({j})"
                elif i >= j:
                    # the token is in this prediction's context, so it should matter (sanity of the test itself)
                    assert not same, f"depth {k} position {i} ignored t({j})"


def test_mtp_loss_alone_reaches_shared_embedding_and_head(make_tiny_model):
    model = make_tiny_model(depth=2, architecture="cascaded", tie_embeddings=False)
    input_ids = torch.randint(0, 61, (2, 10))
    out = model.compute_mtp_loss(model(input_ids), input_ids)
    out.loss.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad.abs().sum() > 0
    assert model.layers[0].attn.qkv.weight.grad.abs().sum() > 0
    # the shared modules are the trunk's own: no copies were made
    assert model.mtp_depth_head_weight(2) is model.lm_head.weight
    assert all(p is not model.embed.weight for n, p in model.mtp_modules.named_parameters())


def test_detach_trunk_keeps_mtp_gradient_out_of_trunk(make_tiny_model):
    model = make_tiny_model(depth=2, detach_trunk=True)
    input_ids = torch.randint(0, 61, (2, 10))
    out = model.compute_mtp_loss(model(input_ids), input_ids)
    out.loss.backward()
    assert model.layers[0].attn.qkv.weight.grad is None
    assert model.embed.weight.grad is None or model.embed.weight.grad.abs().sum() == 0
    assert model.mtp_modules[0].eh_proj.weight.grad.abs().sum() > 0


def test_unshared_heads_are_separate_and_trained(make_tiny_model):
    model = make_tiny_model(depth=2, share_output_head=False)
    assert len(model.mtp_output_heads) == 2
    out = model.compute_lm_loss(torch.randint(0, 61, (2, 10)))
    out.loss.backward()
    assert model.mtp_output_heads[1].weight.grad.abs().sum() > 0


def test_unshared_embedding_is_separate_starts_from_trunk_and_is_trained(make_tiny_model):
    model = make_tiny_model(depth=2, share_embedding=False)
    assert model.mtp_draft_embedding() is not model.embed
    assert torch.equal(model.mtp_draft_embedding().weight, model.embed.weight)
    input_ids = torch.randint(0, 61, (2, 10))
    model.compute_mtp_loss(model(input_ids), input_ids).loss.backward()
    assert model.mtp_embedding.weight.grad.abs().sum() > 0
    out = model.generate(input_ids[:1, :4], 6)  # drafting reads the same embedding as training
    plain = model.generate(input_ids[:1, :4], 6, speculative=False)
    assert torch.equal(out.sequences, plain.sequences)


def test_configure_model_is_idempotent(make_tiny_model):
    model = make_tiny_model(depth=2)
    modules = model.mtp_modules
    n_params = sum(p.numel() for p in model.parameters())
    model.configure_model()
    assert model.mtp_modules is modules
    assert sum(p.numel() for p in model.parameters()) == n_params


class GRUTrunkHost(MTPMixin, L.LightningModule):
    """A host that is not ours: a GRU trunk (the mixin docstring's example), using the default training_step."""

    def __init__(self, vocab: int = 50, dim: int = 32):
        super().__init__(mtp=MTPConfig(depth=2, num_heads=4))
        self.embed = nn.Embedding(vocab, dim)
        self.trunk = nn.GRU(dim, dim, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.calls = []

    def mtp_token_embedding(self):
        return self.embed

    def mtp_output_head(self):
        return self.head

    def mtp_final_norm(self):
        return self.norm

    def mtp_trunk_hidden_states(self, input_ids):
        return self.trunk(self.embed(input_ids))[0]

    def configure_model(self):
        self.calls.append("host")
        super().configure_model()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class GRUHost(GRUTrunkHost):
    """The same host with a training_step of its own that adds compute_mtp_loss to its loss."""

    def training_step(self, batch, batch_idx):
        hidden = self.mtp_trunk_hidden_states(batch)
        logits = self.head(self.norm(hidden[:, :-1]))
        main = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        mtp = self.compute_mtp_loss(hidden, batch)
        self.log("train/mtp/loss_depth1", mtp.depth_losses[0])
        return main + mtp.loss


def test_foreign_host_with_its_own_training_step_trains(tmp_path):
    host = GRUHost()
    data = torch.utils.data.DataLoader(torch.randint(0, 50, (16, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    before = host.head.weight.detach().clone()
    trainer.fit(host, data)
    assert host.calls == ["host"]
    assert host.mtp_modules is not None and len(host.mtp_modules) == 2
    assert not torch.equal(before, host.head.weight)
    assert "train/mtp/loss_depth1" in trainer.logged_metrics


def test_default_training_step_on_foreign_host(tmp_path):
    host = GRUTrunkHost()
    data = torch.utils.data.DataLoader(torch.randint(0, 50, (8, 12)), batch_size=4)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(host, data)
    assert {"train/mtp/loss_depth2", "train/main/loss", "train/mtp/acc_depth1"} <= set(trainer.logged_metrics)


def test_host_missing_accessors_gets_clear_error():
    class Bare(MTPMixin, L.LightningModule):
        pass

    with pytest.raises(NotImplementedError, match="mtp_token_embedding"):
        Bare().configure_model()


class MatmulFlops(TorchDispatchMode):
    """Counts the FLOPs of every matrix product, in place or not (``FlopCounterMode`` misses ``addmm_``)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_recompute_reruns_each_mtp_block_forward_once(make_tiny_model, monkeypatch, architecture):
    """Per training step, every MTP block's attention (each key/value head group) and MLP, and the cascaded mix, see
    each of their rows once in forward and, with ``recompute``, exactly once more in backward; the trunk's only
    once. And recompute's extra matrix products are exactly one forward of the depths, less the attention's output
    projection (its output is not needed again)."""
    from lightning_mtp.layers import Attention, Linear, SwiGLU

    rows = Counter()

    def counting(method, heads=lambda module, args: module.n_heads if isinstance(module, Attention) else 1):
        def wrapped(self, x, *args, **kwargs):
            rows[id(self)] += x.numel() // x.shape[-1] * heads(self, args)  # token rows (times heads for attention)
            return method(self, x, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(SwiGLU, "forward", counting(SwiGLU.forward))
    monkeypatch.setattr(Linear, "forward", counting(Linear.forward))
    monkeypatch.setattr(Attention, "forward", counting(Attention.forward))
    monkeypatch.setattr(Attention, "_group_qkv", counting(
        Attention._group_qkv, heads=lambda module, args: module.n_heads // module.n_kv_heads))  # one group's heads
    B, T, flops = 2, 12, {}
    input_ids = torch.randint(0, 61, (B, T))
    for recompute in (False, True):
        model = make_tiny_model(depth=3, architecture=architecture, recompute=recompute, n_kv_heads=2)
        model.compute_lm_loss(input_ids).loss.backward()  # warm-up: the first small products time both CPU kernels
        model.zero_grad(set_to_none=True)
        rows.clear()
        with MatmulFlops() as counter:
            loss = model.compute_lm_loss(input_ids).loss
            forward = dict(rows)
            loss.backward()
        flops[recompute] = counter.flops
        for k, module in enumerate(model.mtp_modules, start=1):
            length = T - k - 1
            mlp = module.block.mlp  # its backward reruns the two products by hand, not SwiGLU.forward
            pieces = [(module.block.attn, B * length * 4), (mlp.gate_up, B * length), (mlp.down, B * length)]
            if architecture == "cascaded":
                pieces.append((module.eh_proj, B * length))
            for piece, once in pieces:
                assert forward[id(piece)] == once, (k, piece)
                assert rows[id(piece)] == (2 if recompute else 1) * once, (k, piece)
        for layer in model.layers:
            assert rows[id(layer.mlp)] == forward[id(layer.mlp)] == B * T
    with torch.no_grad():
        hidden = model(input_ids)
        with MatmulFlops() as depths_forward:
            model.mtp_forward(hidden, input_ids)  # no grad: the plain forward of every depth and its output norm
    projections = sum(2 * B * (T - k - 1) * 32 * 32 for k in range(1, 4))  # attention output projections, H = 32
    assert flops[True] - flops[False] == depths_forward.flops - projections > 0


class ConfiguredGRUHost(MTPMixin, L.LightningModule):
    """README's advice: a module of one's own takes ``mtp`` / ``generation`` settings, passes them on and saves them
    with ``save_hyperparameters``."""

    def __init__(self, mtp: Optional[MTPConfig] = None, generation: Optional[GenerationConfig] = None):
        super().__init__(mtp=mtp or MTPConfig(depth=2), generation=generation)
        self.save_hyperparameters()
        self.embed, self.trunk = nn.Embedding(50, 32), nn.GRU(32, 32, batch_first=True)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 50, bias=False)

    mtp_token_embedding, mtp_output_head = GRUTrunkHost.mtp_token_embedding, GRUTrunkHost.mtp_output_head
    mtp_final_norm, mtp_trunk_hidden_states = GRUTrunkHost.mtp_final_norm, GRUTrunkHost.mtp_trunk_hidden_states
    configure_optimizers = GRUTrunkHost.configure_optimizers


def test_dataclass_settings_a_module_saves_as_hyperparameters_load_with_weights_only(tmp_path):
    """They were pickled as dataclasses: load_from_checkpoint(weights_only=True) raised UnpicklingError."""
    model = ConfiguredGRUHost(MTPConfig(depth=2, loss_weight=0.2), GenerationConfig(max_new_tokens=7))
    assert isinstance(model.hparams["mtp"], MTPConfig)  # what save_hyperparameters keeps
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, torch.utils.data.DataLoader(torch.randint(0, 50, (4, 12)), batch_size=2))
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    loaded = ConfiguredGRUHost.load_from_checkpoint(tmp_path / "model.ckpt", weights_only=True)
    assert loaded.mtp_config == model.mtp_config and loaded.generation_config.max_new_tokens == 7
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_the_loss_api_refuses_misshapen_arguments_in_words():
    """compute_lm_loss / compute_mtp_loss (a host's own training_step) raised torch's own errors: 'not enough values
    to unpack', an embedding dtype error, 'cannot reshape tensor of 0 elements'; an empty batch through training_step
    'min(): Expected reduction dim'."""
    model = GRUTrunkHost()
    model.configure_model()
    ids = torch.randint(0, 50, (2, 12))
    hidden = model.mtp_trunk_hidden_states(ids)
    cases = [
        (lambda: model.compute_lm_loss(ids[0]), r"input_ids must be a \(B, T\) tensor of integer token ids, got \(12"),
        (lambda: model.compute_lm_loss(ids.float()), r"integer token ids, got \(2, 12\) torch.float32"),
        (lambda: model.compute_lm_loss(ids[:0]), r"input_ids hold no token \(shape \(0, 12\)\)"),
        (lambda: model.compute_lm_loss(ids, ids[:, :-1]), r"labels must have input_ids' shape \(2, 12\), got \(2, 11"),
        (lambda: model.compute_lm_loss(ids, ids.float()), "labels must be integers, got torch.float32"),
        (lambda: model.compute_mtp_loss(hidden, ids[0]), r"got \(12,\)"),
        (lambda: model.compute_mtp_loss(ids, ids), "hidden must be the trunk's floating-point"),
        (lambda: model.training_step(ids[:0], 0), r"a batch's input_ids hold no token"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
