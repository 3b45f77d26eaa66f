"""MTPDiversityRegularizer: the collision term against a full-softmax reference (value, gradients, masks, chunking),
deliberately coupled heads decoupled by training with it, logging, bad arguments and state."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mtp.callbacks import MTPDiversityRegularizer, collision_sum, teacher_forced_acceptance


def reference_collision(model, fwd, depth, only_differing):
    """Σ_i Σ_v p_k p_k+1 over the masked positions, with every logit materialised."""
    near = torch.softmax(model.lm_head(fwd.depth_hidden[depth - 1]), -1)  # (B, T-k-1, V)
    far = torch.softmax(model.lm_head(fwd.depth_hidden[depth]), -1)  # (B, T-k-2, V)
    total, count = 0.0, 0
    for b in range(far.shape[0]):
        for i in range(far.shape[1]):
            a, c = fwd.labels[b, i + depth + 1], fwd.labels[b, i + depth + 2]
            if a == -100 or c == -100 or (only_differing and a == c):
                continue
            total = total + (near[b, i] * far[b, i]).sum()
            count += 1
    return total, count


@pytest.mark.parametrize("only_differing", [True, False])
def test_collision_matches_the_full_softmax_reference(make_tiny_model, only_differing):
    model = make_tiny_model(depth=3, vocab_size=8)  # a small vocabulary makes equal neighbouring targets common
    torch.manual_seed(1)
    ids = torch.randint(0, 8, (2, 12))
    labels = ids.clone()
    labels[1, 8:] = -100
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, inputs, out: rows.append(inputs[0].shape[0]))
    fwd = model.mtp_forward(model(ids), ids, labels)
    total, count = collision_sum(model, fwd, 2, only_differing, chunk_size=3)
    handle.remove()
    expected, expected_count = reference_collision(model, fwd, 2, only_differing)
    assert int(count) == expected_count and max(rows) <= 3  # never more than one chunk of probabilities
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(total, params, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def coupled_model(make_tiny_model):
    """Parallel depths 1 and 2 as one sharp head (depth 2 a copy of depth 1, plus noise of 1e-2 that breaks the tie).
    λ = 0: the MTP loss does not train them, so only the regulariser can pull them apart; the main loss still trains
    the shared trunk and head."""
    model = make_tiny_model(depth=2, architecture="parallel", vocab_size=16, loss_weight=0.0)
    with torch.no_grad():
        model.mtp_modules[0].norm.weight.mul_(5.0)
        model.mtp_modules[1].load_state_dict(model.mtp_modules[0].state_dict())
        generator = torch.Generator().manual_seed(1)
        for param in model.mtp_modules[1].parameters():
            param.add_(1e-2 * torch.randn(param.shape, generator=generator))
    model.learning_rate, model.warmup_steps, model.weight_decay = 1e-2, 0, 0.0
    return model


def coupling(model, ids):
    """(argmax agreement, collision probability where targets differ, JS divergence) of depths 1 and 2."""
    with torch.no_grad():
        stats = teacher_forced_acceptance(model, ids)
        total, count = collision_sum(model, model.mtp_forward(model(ids), ids), 1)
    return float(stats.coupling[0].float().mean()), float(total / count), float(stats.js[0].mean())


def train(model, weight, ids):
    trainer = L.Trainer(max_steps=30, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MTPDiversityRegularizer(weight=weight)])
    trainer.fit(model, DataLoader(ids, batch_size=8))
    return trainer


def test_regularizer_decouples_deliberately_coupled_heads(make_tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (8, 24))
    agree, collision, _ = coupling(coupled_model(make_tiny_model), ids)
    assert agree == 1.0 and collision > 0.25  # one head twice (uniform heads would collide with 1/V = 0.06)
    control = coupled_model(make_tiny_model)
    train(control, 0.0, ids)
    regularized = coupled_model(make_tiny_model)
    trainer = train(regularized, 1.0, ids)
    agree_control, collision_control, js_control = coupling(control, ids)
    agree_reg, collision_reg, js_reg = coupling(regularized, ids)
    assert agree_control > 0.95 and collision_control > 0.25  # without it they stay coupled
    assert agree_reg < 0.2 and collision_reg < 0.1 * collision_control and js_reg > js_control + 0.3
    logged = trainer.logged_metrics
    assert {"train/mtp/diversity", "train/mtp/diversity_weight", "train/mtp/diversity_collision_depth1"} <= set(logged)
    assert float(logged["train/mtp/diversity"]) == pytest.approx(float(logged["train/mtp/diversity_collision_depth1"]))
    assert "diversity" not in regularized._mtp_loss_terms  # unregistered at teardown


def test_weight_schedule_and_inactive_pairs(make_tiny_model):
    model = make_tiny_model(depth=3)
    regularizer = MTPDiversityRegularizer(weight={0: 0.0, 10: 0.5})
    ids = torch.randint(0, 61, (2, 12))
    fwd = model.mtp_forward(model(ids), ids)
    assert float(regularizer.loss_term(model, fwd)) == 0.0  # weight 0 before step 10
    regularizer.current_weight = regularizer.weight(10)
    full = regularizer.loss_term(model, fwd)
    pairs = [collision_sum(model, fwd, k) for k in (1, 2)]
    torch.testing.assert_close(full, 0.5 * sum(t / c for t, c in pairs) / 2)
    model.mtp_active_depth = 1  # one active depth: no adjacent pair
    assert float(regularizer.loss_term(model, model.mtp_forward(model(ids), ids))) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight=-0.1), r"value must be a number >= 0, got -0.1"),
        (dict(weight={0: 0.1, 50: 0.2, 20: 0.3}), r"strictly increasing from 0, got \[0, 50, 20\]"),
        (dict(weight={0: -1.0}), r"weight.milestones\[0\] must be a number >= 0, got -1.0"),
        (dict(weight="big"), "must be a number, a {step: value} mapping or a ScalarSchedule, got 'big'"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
        (dict(name="my term"), "name must be an identifier .* got 'my term'"),
    ],
)
def test_bad_arguments_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MTPDiversityRegularizer(**kwargs)


def test_setup_needs_two_depths_and_an_mtp_module(make_tiny_model):
    trainer = L.Trainer(accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match="needs MTPConfig.depth >= 2 .*got 1"):
        MTPDiversityRegularizer().setup(trainer, make_tiny_model(depth=1), "fit")
    with pytest.raises(TypeError, match="uses MTPMixin"):
        MTPDiversityRegularizer().setup(trainer, torch.nn.Linear(2, 2), "fit")


def test_state_round_trip_and_defaults():
    regularizer = MTPDiversityRegularizer(weight={0: 0.0, 5: 0.1})
    regularizer.last_step, regularizer.current_weight = 7, 0.1
    again = MTPDiversityRegularizer(weight={0: 0.0, 5: 0.1})
    again.load_state_dict(regularizer.state_dict())
    assert (again.last_step, again.current_weight) == (7, 0.1)
    again.load_state_dict({})
    assert (again.last_step, again.current_weight) == (-1, 0.0)
    assert regularizer.state_key != MTPDiversityRegularizer(name="other").state_key
