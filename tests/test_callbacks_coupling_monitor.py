"""MTPCouplingMonitor and teacher_forced_acceptance: every statistic against a brute-force reference, the epoch
metrics and their names, the warn-once threshold, ECE against torchmetrics' multiclass ECE, bad arguments, and the τ
estimate against the τ that speculative decoding measures."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassCalibrationError

from lightning_mtp import MTPConfig
from lightning_mtp.callbacks import AcceptanceStats, MTPCouplingMonitor, teacher_forced_acceptance
from lightning_mtp.models import CausalLM, ModelConfig

try:
    from lightning_mtp.decoding import generate
except ImportError:  # pragma: no cover - only while speculative decoding is being written
    generate = None


def all_logits(model, ids):
    """[main (B, T-1, V), depth k (B, T-k-1, V)...] with every logit materialised."""
    with torch.no_grad():
        hidden = model(ids)
        fwd = model.mtp_forward(hidden, ids)
        return [model.lm_head(model.norm(hidden[:, :-1]))] + [model.lm_head(h) for h in fwd.depth_hidden]


def test_statistics_match_a_brute_force_reference(make_tiny_model):
    model = make_tiny_model(depth=3, vocab_size=5)  # tiny vocabulary: agreements are frequent
    model.mtp_draft_temperatures = [1.0, 2.0, 0.5]
    model.mtp_active_depth = 1  # the monitor evaluates every depth regardless
    torch.manual_seed(3)
    ids = torch.randint(0, 5, (3, 11))
    labels = ids.clone()
    labels[2, 7] = -100
    stats = teacher_forced_acceptance(model, ids, labels, chunk_size=11)  # one sequence per chunk
    model.mtp_active_depth = 3
    logits = all_logits(model, ids)
    main = logits[0].argmax(-1)
    B, T = ids.shape
    for k in range(1, 4):
        draft = logits[k].argmax(-1)
        for b in range(B):
            for i in range(T - k - 1):
                accept = bool(draft[b, i] == main[b, i + k])
                chained = all(bool(logits[j].argmax(-1)[b, i] == main[b, i + j]) for j in range(1, k + 1))
                valid = all(labels[b, j] != -100 for j in range(i + 1, i + k + 2))
                assert (stats.accept[k - 1][b, i], stats.chained[k - 1][b, i]) == (accept, chained)
                assert bool(stats.valid[k - 1][b, i]) == valid
                assert bool(stats.correct[k - 1][b, i]) == bool(draft[b, i] == labels[b, i + k + 1])
                p = torch.softmax(logits[k][b, i] / model.mtp_draft_temperatures[k - 1], -1)
                assert float(stats.confidence[k - 1][b, i]) == pytest.approx(float(p.max()), abs=1e-6)
                if k < 3 and i < T - k - 2:
                    p, q = torch.softmax(logits[k][b, i], -1), torch.softmax(logits[k + 1][b, i], -1)
                    m = (p + q) / 2
                    js = 0.5 * float((p * (p / m).log()).sum() + (q * (q / m).log()).sum())
                    assert float(stats.js[k - 1][b, i]) == pytest.approx(js, abs=1e-6)
                    assert bool(stats.coupling[k - 1][b, i]) == bool(draft[b, i] == logits[k + 1].argmax(-1)[b, i])
    # τ for n drafts per position: 1 + the number of leading matched drafts (the bonus token counted)
    tau, valid = stats.tau(2)
    expected = 1 + stats.chained[0][:, : T - 3].float() + stats.chained[1].float()
    assert torch.equal(tau, expected) and torch.equal(valid, stats.valid[1])
    # the decoding walk from every scored position: a step at i emits tau[i] tokens and the next starts at i + tau[i]
    tokens = steps = 0
    for b in range(B):
        for start in range(tau.shape[1]):
            i = start
            while i < tau.shape[1] and valid[b, i]:
                tokens, steps, i = tokens + int(tau[b, i]), steps + 1, i + int(tau[b, i])
    assert tuple(int(x) for x in stats.tau_walk(2)) == (tokens, steps)


def test_ece_equals_torchmetrics_multiclass_top_label_ece(make_tiny_model):
    model = make_tiny_model(depth=2, vocab_size=7)
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (4, 16))
    stats = teacher_forced_acceptance(model, ids)
    monitor = MTPCouplingMonitor(n_bins=10)
    monitor.setup(L.Trainer(accelerator="cpu", logger=False), model, "validate")
    valid = stats.valid[0]
    ece = monitor.calibration["val/mtp/ece_depth1"]
    ece.update(stats.confidence[0][valid], stats.correct[0][valid].long())
    probs = torch.softmax(all_logits(model, ids)[1], -1)[valid]  # (N, V)
    reference = MulticlassCalibrationError(num_classes=7, n_bins=10, norm="l1")
    reference.update(probs, ids[:, 2:][valid])
    assert float(ece.compute()) == pytest.approx(float(reference.compute()), abs=1e-6)


def validate(model, monitor, batches=2):
    data = DataLoader(torch.randint(0, 61, (4 * batches, 16), generator=torch.Generator().manual_seed(0)),
                      batch_size=4)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor])
    trainer.validate(model, data, verbose=False)
    return trainer


def test_epoch_metrics_names_and_values(make_tiny_model):
    model = make_tiny_model(depth=3)
    trainer = validate(model, MTPCouplingMonitor())
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    names = [f"val/mtp/{q}_depth{k}" for q in ("accept", "accept_chained", "ece") for k in (1, 2, 3)]
    names += [f"val/mtp/{q}_depth{k}" for q in ("coupling", "js") for k in (1, 2)]
    names += [f"val/mtp/{q}_draft{n}" for q in ("tau", "tau_walk") for n in (1, 2, 3)]
    assert set(names) <= set(logged)
    ids = torch.randint(0, 61, (8, 16), generator=torch.Generator().manual_seed(0))
    stats = teacher_forced_acceptance(model, ids)  # both batches at once: the epoch mean over positions
    tau, valid = stats.tau(3)
    assert logged["val/mtp/tau_draft3"] == pytest.approx(float(tau[valid].mean()), abs=1e-6)
    assert logged["val/mtp/accept_depth2"] == pytest.approx(float(stats.accept[1].float().mean()), abs=1e-6)
    tokens, steps = stats.tau_walk(2)
    assert logged["val/mtp/tau_walk_draft2"] == pytest.approx(float(tokens / steps), abs=1e-6)
    assert 1.0 <= logged["val/mtp/tau_draft1"] <= logged["val/mtp/tau_draft2"] <= logged["val/mtp/tau_draft3"] <= 4
    assert logged["val/mtp/accept_chained_depth3"] <= logged["val/mtp/accept_chained_depth2"]


def test_warns_once_when_coupling_passes_the_threshold(make_tiny_model):
    model = make_tiny_model(depth=2, architecture="parallel")
    model.mtp_modules[1].load_state_dict(model.mtp_modules[0].state_dict())  # depth 2 = depth 1: coupling 1
    monitor = MTPCouplingMonitor(coupling_threshold=0.9)
    with pytest.warns(UserWarning, match=r"coupled: val/mtp/coupling_depth1 = 1.000 exceeds coupling_threshold = 0.9"):
        validate(model, monitor, batches=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        validate(model, monitor, batches=1)  # the same callback does not warn again
    assert monitor.state_dict() == {"warned": True}
    fresh = MTPCouplingMonitor(coupling_threshold=0.9)
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.warned
    fresh.load_state_dict({})
    assert not fresh.warned


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(coupling_threshold=1.5), r"coupling_threshold must be in \[0, 1\], got 1.5"),
        (dict(coupling_threshold=-0.1), r"got -0.1"),
        (dict(n_bins=0), "n_bins must be an integer >= 1, got 0"),
        (dict(chunk_size=0), "chunk_size must be an integer >= 1, got 0"),
        (dict(max_positions=0), "max_positions must be an integer >= 1, got 0"),
        (dict(max_positions=2.5), "max_positions must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_arguments_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MTPCouplingMonitor(**kwargs)


def test_setup_rejects_non_mtp_modules():
    with pytest.raises(TypeError, match="MTPCouplingMonitor needs a LightningModule that uses MTPMixin"):
        MTPCouplingMonitor().setup(L.Trainer(accelerator="cpu", logger=False), torch.nn.Linear(2, 2), "validate")


# ----------------------------------------------------------------------------------------------- τ vs decoding

VOCAB, PROMPT, NEW_TOKENS = 16, 6, 150


def noisy_cycle(rows, length, generator, permutation, noise=0.3):
    """t(i+1) = permutation[t(i)], or a uniform token with probability ``noise``."""
    ids = torch.empty(rows, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=generator)
    for t in range(1, length):
        uniform = torch.randint(0, VOCAB, (rows,), generator=generator)
        ids[:, t] = torch.where(torch.rand(rows, generator=generator) < noise, uniform, permutation[ids[:, t - 1]])
    return ids


def decoding_walk(stats, drafts):
    """τ of greedy decoding replayed on the teacher-forced outcomes: the prefill forward emits one token, a step at
    position i emits 1 + its leading matched drafts and the next starts after them, the budget caps the last step."""
    emitted = forwards = 0
    for row in range(stats.chained[0].shape[0]):
        position, left = PROMPT - 1, NEW_TOKENS - 1
        emitted, forwards = emitted + 1, forwards + 1
        while left > 0:
            accepted = 0  # drafts whose target lies past the sequence are past the budget too
            while (accepted < drafts and position < stats.chained[accepted].shape[1]
                   and bool(stats.chained[accepted][row, position])):
                accepted += 1
            step = min(1 + accepted, left)
            emitted, forwards, left, position = emitted + step, forwards + 1, left - step, position + 1 + accepted
    return emitted / forwards


@pytest.mark.skipif(
    generate is None,
    reason="lightning_mtp.decoding.generate does not exist yet (speculative decoding is being written); this test "
    "compares the monitor's teacher-forced τ with the τ that decoding measures",
)
def test_teacher_forced_tau_is_within_10_percent_of_decoding():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    permutation = torch.randperm(VOCAB, generator=generator)
    model = CausalLM(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=256), MTPConfig(depth=3))
    model.configure_model()
    data = noisy_cycle(256, 32, generator, permutation)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(15):  # partly trained: drafts are often, not always, accepted
        loss = model.compute_lm_loss(data[torch.randint(0, 256, (16,), generator=generator)]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    prompts = noisy_cycle(16, PROMPT, generator, permutation)
    for drafts in (1, 2, 3):
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=NEW_TOKENS, speculative=True, draft_tokens=drafts)
        histogram = out.stats.accepted_length_histogram
        assert histogram[0] > 0 and histogram[drafts] > 0  # some steps accept nothing, some everything
        # Greedy output is the main model's own argmax chain, so teacher forcing on it scores what decoding saw;
        # positions from the last prompt token on (where the first step starts) are scored.
        labels = out.sequences.clone()
        labels[:, :PROMPT] = -100
        stats = teacher_forced_acceptance(model, out.sequences, labels)
        tau, valid = stats.tau(drafts)
        assert float(tau[valid].mean()) == pytest.approx(out.stats.tau, rel=0.10)  # val/mtp/tau_draft{n}
        tokens, steps = stats.tau_walk(drafts)
        assert float(tokens / steps) == pytest.approx(out.stats.tau, rel=0.05)  # val/mtp/tau_walk_draft{n}
        # The per-position chained acceptance is exactly decoding's: replaying decoding on it gives its τ.
        assert math.isclose(decoding_walk(stats, drafts), out.stats.tau, rel_tol=1e-9)


def walk_step_by_step(stats, drafts):
    """(tokens, steps) of the decoding walks from every position, one step at a time."""
    emitted = (1 + stats.leading_matches(drafts)).tolist()
    valid = stats.valid[drafts - 1].tolist()
    tokens = steps = 0
    for row_emitted, row_valid in zip(emitted, valid):
        for start in range(len(row_emitted)):
            i = start
            while i < len(row_emitted) and row_valid[i]:
                tokens, steps, i = tokens + row_emitted[i], steps + 1, i + row_emitted[i]
    return tokens, steps


def test_tau_walk_equals_the_step_by_step_walk_on_random_outcomes():
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        depth, batch = 1 + trial % 4, 1 + trial % 3
        length = depth + 2 + int(torch.randint(0, 40, (1,), generator=generator))
        accept_rate, valid_rate = (trial % 5) / 4, 1 - (trial % 3) / 4  # never, sometimes, always accepted
        accept = [torch.rand(batch, length - k - 1, generator=generator) < accept_rate for k in range(1, depth + 1)]
        chained = [accept[0]]
        for k in range(1, depth):
            chained.append(chained[-1][:, : length - k - 2] & accept[k])
        valid = [torch.rand(batch, length - k - 1, generator=generator) < valid_rate for k in range(1, depth + 1)]
        stats = AcceptanceStats(accept, chained, valid, [], [], [], [])
        for drafts in range(1, depth + 1):
            assert tuple(int(x) for x in stats.tau_walk(drafts)) == walk_step_by_step(stats, drafts)


def test_max_positions_probes_js_and_confidence_on_a_strided_subsample(make_tiny_model):
    model = make_tiny_model(depth=3)
    ids = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(3))
    every = teacher_forced_acceptance(model, ids)
    probed = teacher_forced_acceptance(model, ids, max_positions=20, index=5)  # 4 × 14 positions: every 3rd, from 2
    for k in range(3):
        expected = torch.zeros_like(every.valid[k])
        expected[:, 2::3] = True
        assert torch.equal(probed.probed[k], expected)
        # the argmax-based outcomes read every position; the probed values equal the full computation's
        assert torch.equal(probed.accept[k], every.accept[k]) and torch.equal(probed.correct[k], every.correct[k])
        torch.testing.assert_close(probed.confidence[k][expected], every.confidence[k][expected])
    for k in range(2):
        mask = probed.probed[k + 1]
        assert torch.equal(probed.coupling[k], every.coupling[k])
        torch.testing.assert_close(probed.js[k][mask], every.js[k][mask], rtol=1e-5, atol=1e-6)
    monitor = MTPCouplingMonitor(max_positions=20)
    monitor.setup(L.Trainer(accelerator="cpu", logger=False), model, "validate")
    monitor.update(probed)
    full = MTPCouplingMonitor(max_positions=None)
    full.setup(L.Trainer(accelerator="cpu", logger=False), model, "validate")
    full.update(every)
    js_mask = every.valid[1] & probed.probed[1]
    assert float(monitor.means["val/mtp/js_depth1"].compute()) == pytest.approx(float(every.js[0][js_mask].mean()))
    name = "val/mtp/accept_depth2"
    assert float(monitor.means[name].compute()) == float(full.means[name].compute())


def test_argmaxes_are_the_validation_loss_ones_and_those_of_the_full_logits(make_tiny_model):
    """The acceptance statistics read the argmax the validation loss's cross-entropy computed for the main head and
    the active depths, complete it for the inactive depths, and agree with the argmax of every materialised logit;
    a forward computed outside the step (the re-run path) gives the same bits. Probed logits are the full logits at
    the probed positions."""
    from lightning_mtp.callbacks._teacher_forcing import probed_logits, teacher_forced_argmax, teacher_forced_forward

    model = make_tiny_model(depth=3)
    model.mtp_active_depth = 1
    ids = torch.randint(0, model.mtp_vocab_size(), (3, 12), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[1, 6] = -100  # an ignored target still gets its position's argmax
    with torch.no_grad():
        _, fwd = model._lm_loss_keeping_every_depth(ids, labels)
    assert sorted(fwd.argmax) == [0, 1]  # the loss scored the main head and depth 1
    argmax = teacher_forced_argmax(model, fwd)
    assert sorted(fwd.argmax) == [0, 1, 2, 3]  # completed and cached for the other readers
    model.mtp_active_depth = 3
    logits = all_logits(model, ids)
    for got, full in zip(argmax, logits):
        assert torch.equal(got, full.argmax(-1))
    fresh = teacher_forced_forward(model, ids, labels)
    assert all(torch.equal(a, b) for a, b in zip(teacher_forced_argmax(model, fresh), argmax))
    columns = slice(1, None, 3)
    for k, full in enumerate(logits):
        torch.testing.assert_close(probed_logits(model, fwd, k, slice(1, 3), columns), full[1:3, columns])
    shifted = probed_logits(model, fwd, 0, slice(0, 3), columns, offset=2)  # main head at i + 2
    torch.testing.assert_close(shifted, logits[0][:, 2:][:, columns])
