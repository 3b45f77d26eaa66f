"""The MTP loss against a naive reference: full logits, rolled targets, explicit per-depth means."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mtp.kernels import linear_cross_entropy_torch
from lightning_mtp.loss import LogitTransform
from lightning_mtp.zero import head_cross_entropy

IGNORE = -100


def naive_depth_logits(model, input_ids, transform=None):
    """Per depth k (0..D) the (B, T, V) logits at every position, computed over the full sequence.

    Unlike the library (which slices each depth to the positions that have a target), this runs every module on
    all T positions, feeding wrapped ("rolled", Megatron-style) embeddings past the end. ``transform`` (scale, cap)
    is applied by hand to every depth's head output.
    """
    def head(hidden):
        logits = model.lm_head(hidden)
        if transform is not None:
            scale, cap = transform
            logits = cap * torch.tanh(scale * logits / cap)
        return logits

    cfg = model.mtp_config
    T = input_ids.shape[1]
    h0 = model(input_ids)
    logits = [head(model.norm(h0))]
    cos, sin = model.mtp_rope(T)
    previous = h0
    for k in range(1, cfg.depth + 1):
        module = model.mtp_modules[k - 1]
        emb = model.embed(torch.roll(input_ids, shifts=-k, dims=1))  # Emb(t(i+k)), wrapped past the end
        h_in = previous if cfg.architecture == "cascaded" else h0
        out = module(h_in, emb, cos, sin)
        logits.append(head(module.norm(out)))
        previous = out
    return logits


def naive_loss(model, input_ids, labels, transform=None):
    cfg = model.mtp_config
    T = input_ids.shape[1]
    per_depth = []
    for k, logits in enumerate(naive_depth_logits(model, input_ids, transform)):
        targets = torch.full_like(labels, IGNORE)
        targets[:, : T - k - 1] = labels[:, k + 1 :]
        rows = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none",
                               ignore_index=IGNORE)
        valid = (targets != IGNORE).sum()
        per_depth.append(rows.sum() / valid.clamp(min=1))
    depth_weights = torch.tensor(model.mtp_depth_weights)
    mtp = model.mtp_loss_weight * (depth_weights * torch.stack(per_depth[1:])).sum() / cfg.depth
    return per_depth[0] + mtp, per_depth


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("recompute", [False, True])
def test_loss_and_gradients_match_naive_reference(make_tiny_model, architecture, recompute):
    model = make_tiny_model(depth=3, architecture=architecture, recompute=recompute, loss_weight=0.7)
    model.mtp_depth_weights = [1.0, 0.8, 0.64]
    torch.manual_seed(1)
    input_ids = torch.randint(0, 61, (3, 12))
    labels = input_ids.clone()
    labels[0, 5:] = IGNORE  # padding at the end of row 0
    labels[1, 2] = IGNORE  # a hole in row 1

    out = model.compute_lm_loss(input_ids, labels)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    ref_total, ref_depths = naive_loss(model, input_ids, labels)
    ref_grads = torch.autograd.grad(ref_total, list(model.parameters()))

    torch.testing.assert_close(out.loss, ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.main_loss, ref_depths[0].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.depth_losses, torch.stack(ref_depths[1:]).detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("recompute", [False, True])
def test_every_depth_is_scored_on_the_hosts_transformed_logits(make_tiny_model, recompute):
    """A host that scales and soft-caps its logits (Gemma-2 / Cohere style): the main head and every MTP depth (which
    share the head) are scored on cap · tanh(scale · z / cap), with gradients through the transform."""
    model = make_tiny_model(depth=2, recompute=recompute)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of several units, so that a cap of 2 bends them
    model.mtp_logit_transform = lambda: LogitTransform(scale=1.5, softcap=2.0)
    torch.manual_seed(2)
    input_ids = torch.randint(0, 61, (2, 10))
    labels = input_ids.clone()
    labels[1, 6:] = IGNORE

    out = model.compute_lm_loss(input_ids, labels)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    ref_total, ref_depths = naive_loss(model, input_ids, labels, transform=(1.5, 2.0))
    ref_grads = torch.autograd.grad(ref_total, list(model.parameters()))
    untransformed = naive_loss(model, input_ids, labels)[0]
    assert abs(float(untransformed.detach() - ref_total.detach())) > 0.5  # the transform matters here

    torch.testing.assert_close(out.loss, ref_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.main_loss, ref_depths[0].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.depth_losses, torch.stack(ref_depths[1:]).detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_zero3_head_path_applies_the_same_transform():
    """``head_cross_entropy`` (DeepSpeed ZeRO-3: through the head module) scores the same transformed logits."""
    torch.manual_seed(0)
    head = nn.Linear(24, 257, bias=False)
    hidden = torch.randn(37, 24, requires_grad=True)
    targets = torch.randint(0, 257, (37,))
    targets[[1, 2]] = IGNORE
    row_weights = torch.rand(37)
    out = head_cross_entropy(hidden, head, targets, row_weights, IGNORE, 8, logit_scale=2.0, softcap=1.5)
    grads = torch.autograd.grad(out.loss, [hidden, head.weight])
    fused = linear_cross_entropy_torch(hidden, head.weight, targets, row_weights, IGNORE, 8, logit_scale=2.0,
                                       softcap=1.5)
    fused_grads = torch.autograd.grad(fused.loss, [hidden, head.weight])
    torch.testing.assert_close(out.loss, fused.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.row_loss, fused.row_loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.row_argmax, fused.row_argmax)
    for got, want in zip(grads, fused_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_logit_transform_is_validated_and_identity_by_default():
    assert LogitTransform().is_identity
    logits = torch.tensor([-100.0, 0.5, 100.0])
    torch.testing.assert_close(LogitTransform(scale=2.0, softcap=3.0)(logits), 3.0 * torch.tanh(2.0 * logits / 3.0))
    with pytest.raises(ValueError, match="LogitTransform.softcap must be None or a finite number > 0, got -1.0"):
        LogitTransform(softcap=-1.0)
    with pytest.raises(ValueError, match="LogitTransform.scale must be a finite number, got nan"):
        LogitTransform(scale=float("nan"))


def test_depth_without_valid_target_gives_zero_not_nan(make_tiny_model):
    model = make_tiny_model(depth=2)
    input_ids = torch.randint(0, 61, (2, 6))
    labels = input_ids.clone()
    labels[:, 3:] = IGNORE  # depth 2 (targets t(i+3)) has no valid target left
    out = model.compute_lm_loss(input_ids, labels)
    assert out.depth_losses[1] == 0
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_attention_mask_masks_padding():
    input_ids = torch.randint(0, 61, (2, 10))
    mask = torch.ones_like(input_ids)
    mask[1, 7:] = 0
    from lightning_mtp.mixin import unpack_batch

    ids, labels = unpack_batch({"input_ids": input_ids, "attention_mask": mask})
    assert (labels[1, 7:] == IGNORE).all() and (labels[0] == input_ids[0]).all()


def test_sequence_shorter_than_depth_plus_two_fails(make_tiny_model):
    model = make_tiny_model(depth=3)
    with pytest.raises(ValueError, match="depth \\+ 2"):
        model.compute_lm_loss(torch.randint(0, 61, (1, 4)))


@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_cross_entropy_matches_torch(weighted):
    torch.manual_seed(0)
    hidden = torch.randn(37, 24, requires_grad=True)
    weight = torch.randn(257, 24, requires_grad=True)
    targets = torch.randint(0, 257, (37,))
    targets[[0, 5, 6, 7, 8]] = IGNORE
    row_weights = torch.rand(37) if weighted else None
    out = linear_cross_entropy_torch(hidden, weight, targets, row_weights, chunk_size=8)
    rows = F.cross_entropy(hidden @ weight.T, targets, reduction="none", ignore_index=IGNORE)
    valid = targets != IGNORE
    ref = (rows * row_weights * valid).sum() if weighted else rows.sum() / valid.sum()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.row_argmax[valid], (hidden @ weight.T).argmax(-1)[valid])
    g = torch.autograd.grad(3.0 * out.loss, [hidden, weight])
    g_ref = torch.autograd.grad(3.0 * ref, [hidden, weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_all_ignored_rows_give_zero_loss_and_gradient():
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    out = linear_cross_entropy_torch(hidden, weight, torch.full((9,), IGNORE), chunk_size=4)
    assert out.loss.item() == 0
    out.loss.backward()
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def loss_and_gradients(model, input_ids, labels):
    """compute_lm_loss and the gradient of its loss w.r.t. every named parameter (``None`` where it has none)."""
    out = model.compute_lm_loss(input_ids, labels)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return out, dict(zip(names, torch.autograd.grad(out.loss, params, allow_unused=True)))


def assert_same_loss_and_gradients(got, want):
    (out, grads), (ref, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.depth_losses, ref.depth_losses, atol=1e-6, rtol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        assert (grads[name] is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(grads[name], expected, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("share_output_head", [True, False])
@pytest.mark.parametrize("detach_trunk", [False, True])
@pytest.mark.parametrize(("depth", "n_kv_heads"), [(1, None), (2, 2), (3, None), (3, 1)])
def test_recompute_gives_the_loss_and_every_gradient_of_the_plain_backward(
    make_tiny_model, architecture, share_output_head, detach_trunk, depth, n_kv_heads
):
    """``MTPConfig.recompute`` changes no number: the loss, the per-depth losses and the gradient of every parameter
    (trunk, MTP modules, the shared embedding and head or the depths' own heads) equal the plain backward's, with
    multi-head and grouped-query MTP blocks and padded targets."""
    torch.manual_seed(4)
    input_ids = torch.randint(0, 61, (3, 13))
    labels = input_ids.clone()
    labels[0, 6:] = IGNORE
    config = dict(depth=depth, architecture=architecture, share_output_head=share_output_head,
                  detach_trunk=detach_trunk, n_kv_heads=n_kv_heads)
    assert_same_loss_and_gradients(
        loss_and_gradients(make_tiny_model(recompute=True, **config), input_ids, labels),
        loss_and_gradients(make_tiny_model(recompute=False, **config), input_ids, labels),
    )


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_recompute_with_frozen_parameters_returns_only_the_needed_gradients(make_tiny_model, architecture):
    """A frozen trunk and partly frozen MTP modules (one depth's attention, another's MLP, a cascaded module's mix):
    recompute differentiates only what requires grad and still matches the plain backward."""
    runs = []
    for recompute in (True, False):
        model = make_tiny_model(depth=3, architecture=architecture, recompute=recompute)
        frozen = [model.embed, model.layers, model.norm, model.mtp_modules[0].block.attn,
                  model.mtp_modules[0].block.attn_norm, model.mtp_modules[1].block.mlp, model.mtp_modules[2].norm]
        if architecture == "cascaded":
            frozen += [model.mtp_modules[1].eh_proj, model.mtp_modules[2].hnorm]
        for module in frozen:
            module.requires_grad_(False)
        torch.manual_seed(5)
        runs.append(loss_and_gradients(model, torch.randint(0, 61, (2, 11)), None))
    assert_same_loss_and_gradients(*runs)


def test_recompute_under_bf16_autocast_matches_the_plain_backward(make_tiny_model):
    """Backward reruns the depths under the forward's autocast: bf16 results agree to bf16 precision."""
    runs = []
    for recompute in (True, False):
        model = make_tiny_model(depth=2, recompute=recompute)
        torch.manual_seed(6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(loss_and_gradients(model, torch.randint(0, 61, (2, 12)), None))
    (out, grads), (ref, ref_grads) = runs
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-2, rtol=1e-2)
    for name, expected in ref_grads.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(grads[name], expected, atol=3e-2 * scale, rtol=0, msg=name)


def test_recompute_writes_the_embedding_gradient_into_the_consumed_normed_gradient(make_tiny_model, monkeypatch):
    """A recomputed cascaded depth puts d/dEmb into the storage of d/dnorm(h_k) (consumed by then) in a real step, and
    only a gradient lying in the depth's own normed storage qualifies: a copy, another shape or a strided view does
    not (autograd promises nothing about who else holds those)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from lightning_mtp import heads

    normed, embedding = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    own = StorageWeakRef(normed.untyped_storage())
    assert heads._spent_buffer(normed.view(10, 8).view(2, 5, 8), own, embedding) is not None
    for grad, emb in [(normed.clone(), embedding), (normed, torch.randn(2, 4, 8)), (normed, None),
                      (normed.transpose(0, 1), torch.randn(5, 2, 8))]:
        assert heads._spent_buffer(grad, own, emb) is None
    used, original = [], heads._spent_buffer
    monkeypatch.setattr(heads, "_spent_buffer", lambda *args: used.append(original(*args)) or used[-1])
    model = make_tiny_model(depth=3, recompute=True)
    model.compute_lm_loss(torch.randint(0, 61, (2, 12))).loss.backward()
    assert len(used) == 3 and all(buffer is not None for buffer in used)


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
@pytest.mark.parametrize("share_embedding", [True, False])
def test_cascaded_depths_read_the_trunks_own_embedding_lookup(make_tiny_model, monkeypatch, architecture,
                                                                share_embedding):
    """compute_lm_loss looks the tokens up once when the depths share the trunk's embedding (they read the trunk's
    lookup), and the loss and every gradient equal those of a separate lookup."""
    from lightning_mtp.mixin import objective

    def run(reuse):
        model = make_tiny_model(depth=2, architecture=architecture, share_embedding=share_embedding, recompute=True)
        calls = []
        model.embed.register_forward_hook(lambda module, args, out: calls.append(1))
        if not reuse:
            monkeypatch.setattr(objective.TrunkEmbeddings, "capture", lambda host, ids: contextlib.nullcontext())
        torch.manual_seed(2)
        result = loss_and_gradients(model, torch.randint(0, 61, (3, 11)), None)
        monkeypatch.undo()
        return result, len(calls)

    (reused, calls), (separate, separate_calls) = run(True), run(False)
    assert calls == 1
    assert separate_calls == (2 if architecture == "cascaded" and share_embedding else 1)
    assert_same_loss_and_gradients(reused, separate)


def test_a_trunk_that_changes_its_embedding_output_in_place_gets_a_fresh_lookup_for_the_depths(make_tiny_model):
    """A host that scales the lookup in place after the embedding returns it: the depths must still read Emb(t), so
    the caught tensor is refused (its version moved) and looked up again, as without the reuse."""
    from lightning_mtp.mixin import objective

    model = make_tiny_model(depth=2)

    def trunk(input_ids):
        x = model.embed(input_ids)
        x.mul_(3.0)  # in place: the lookup the hook caught is no longer Emb(t)
        cos, sin = model.rope(input_ids.shape[1])
        for layer in model.layers:
            x = layer(x, cos, sin)
        return x

    model.mtp_trunk_hidden_states = trunk
    input_ids = torch.randint(0, 61, (2, 10))
    got = model.compute_lm_loss(input_ids).depth_losses
    with torch.no_grad():
        fwd = model.mtp_forward(trunk(input_ids), input_ids)  # a separate lookup of the raw embedding
        want = torch.stack([F.cross_entropy(model.lm_head(h[:, : 10 - k - 2]).flatten(0, 1),
                                            input_ids[:, k + 2 :].flatten())
                            for k, h in enumerate(fwd.depth_hidden)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    caught = objective.TrunkEmbeddings(input_ids)
    caught._hook(model.embed, (input_ids,), model.embed(input_ids))
    assert caught.get(torch.Size((2, 10, 32))) is not None
    caught.output.mul_(2.0)
    assert caught.get(torch.Size((2, 10, 32))) is None


@pytest.mark.parametrize("architecture", ["cascaded", "parallel"])
def test_recompute_runs_under_torch_flop_counter(make_tiny_model, architecture):
    """``FlopCounterMode`` (what ``benchmarks/train_overhead.py`` counts with) hooks every module's inputs and
    outputs; a recomputed step, whose backward reruns modules, runs under it and counts more than a plain step."""
    from torch.utils.flop_counter import FlopCounterMode

    flops = []
    for recompute in (False, True):
        model = make_tiny_model(depth=2, architecture=architecture, recompute=recompute)
        with FlopCounterMode(display=False) as counter:
            model.compute_lm_loss(torch.randint(0, 61, (2, 40))).loss.backward()
        flops.append(counter.get_total_flops())
    assert flops[1] > flops[0]


@pytest.mark.parametrize("views", [False, True])
def test_private_states_receive_their_gradients_in_place_and_change_no_number(views):
    """``score_jointly(private=True)`` writes each depth's gradient into its own normed states (no gradient buffer,
    no concatenated copy), with the loss, the predictions and every gradient of ``private=False``. A view (an identity
    final norm hands back a slice of the trunk's state) or a tensor its producer saved for backward is never
    overwritten."""
    from lightning_mtp.loss import DepthLossSpec, score_jointly

    torch.manual_seed(0)
    weight = torch.randn(31, 8, requires_grad=True)
    trunk = torch.randn(2, 9, 8, requires_grad=True)
    labels = torch.randint(0, 31, (2, 9))
    results = {}
    for private in (False, True):
        states = [trunk[:, :-1] * 1.0, trunk[:, :-2] * 2.0, trunk[:, :-3].tanh()]  # (B, T-k-1, H)
        if views:
            states[0] = trunk[:, :-1]  # the main head's states are the trunk's own
        kept = [s.detach().clone() for s in states]
        specs = [DepthLossSpec(weight, labels[:, k + 1 : k + 1 + s.shape[1]], 1.0 / (k + 1), chunk_size=5)
                 for k, s in enumerate(states)]
        parts = score_jointly(specs, list(states), private=private)
        loss = sum(p.loss for p in parts)
        grads = torch.autograd.grad(loss, [trunk, weight])
        overwritten = [not torch.equal(s, k) for s, k in zip(states, kept)]
        results[private] = loss.detach(), [p.row_argmax for p in parts], grads, overwritten
    loss, argmax, grads, overwritten = results[True]
    ref_loss, ref_argmax, ref_grads, ref_overwritten = results[False]
    assert not any(ref_overwritten)
    assert overwritten == [not views, True, False]  # tanh saves its output for backward: never overwritten
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(argmax, ref_argmax))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
