"""MTPDraftCalibration: the fitted temperature against a direct minimisation of the NLL, a known temperature
recovered, temperatures set on the module and saved in the checkpoint, logging, bad arguments and state."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mtp.callbacks import MTPDraftCalibration
from lightning_mtp.callbacks._teacher_forcing import teacher_forced_forward


def direct_fit(draft_logits, main_logits):
    """argmin_T mean CE(softmax(main), softmax(z / T)) on a fine log grid, and the KL there."""
    p = torch.softmax(main_logits.double(), -1)
    temperatures = torch.logspace(-1.5, 1.5, 6001, dtype=torch.float64)
    nll = torch.stack([-(p * torch.log_softmax(draft_logits.double() / t, -1)).sum(-1).mean() for t in temperatures])
    best = int(nll.argmin())
    entropy = -(p * p.log()).sum(-1).mean()
    return float(temperatures[best]), float(nll[best] - entropy)


def test_recovers_a_known_temperature():
    torch.manual_seed(0)
    calibration = MTPDraftCalibration()
    calibration.reset(depth=2)
    z = 2 * torch.randn(400, 50)
    calibration.add_logits(1, z, 2.5 * z)  # the main model is the draft at temperature 0.4
    calibration.add_logits(2, z, z / 3)  # ... at temperature 3
    fitted = calibration.solve()
    assert fitted[1][0] == pytest.approx(0.4, rel=2e-3) and fitted[2][0] == pytest.approx(3.0, rel=2e-3)
    assert fitted[1][1] == pytest.approx(0.0, abs=1e-4)  # the tempered draft is the main distribution: KL 0


def test_fit_on_a_model_matches_direct_minimisation(make_tiny_model):
    model = make_tiny_model(depth=2, vocab_size=13)
    torch.manual_seed(1)
    ids = torch.randint(0, 13, (3, 14))
    labels = ids.clone()
    labels[0, 10:] = -100
    calibration = MTPDraftCalibration(chunk_size=14, max_positions=None)  # one sequence per chunk, every position
    calibration.reset(depth=2)
    calibration.accumulate(model, teacher_forced_forward(model, ids, labels))
    fitted = calibration.solve()
    with torch.no_grad():
        hidden = model(ids)
        main = model.lm_head(model.norm(hidden[:, :-1]))  # (B, T-1, V)
        depth_hidden = model.mtp_forward(hidden, ids).depth_hidden
    for k in (1, 2):
        span = ids.shape[1] - k - 1
        valid = torch.ones(3, span, dtype=torch.bool)
        for j in range(k + 1):  # t(i+1)..t(i+k+1) scored
            valid &= labels[:, 1 + j : 1 + j + span] != -100
        draft = model.lm_head(depth_hidden[k - 1]).detach()[valid]
        temperature, kl = direct_fit(draft, main[:, k : k + span][valid])
        assert fitted[k][0] == pytest.approx(temperature, rel=2e-3)
        assert fitted[k][1] == pytest.approx(kl, rel=1e-2, abs=1e-5)


def test_validation_sets_saves_and_logs_the_temperatures(make_tiny_model, tmp_path):
    model = make_tiny_model(depth=2)
    model.mtp_active_depth = 1  # every depth is calibrated regardless
    calibration = MTPDraftCalibration(max_batches=1, max_positions=None)
    data = DataLoader(torch.randint(0, 61, (8, 16), generator=torch.Generator().manual_seed(0)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[calibration], default_root_dir=tmp_path)
    trainer.validate(model, data, verbose=False)
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    temperatures = model.mtp_draft_temperatures
    assert temperatures != [1.0, 1.0] and calibration.fits == 1
    assert [logged[f"val/mtp/temperature_depth{k}"] for k in (1, 2)] == pytest.approx(temperatures)
    assert {"val/mtp/draft_kl_depth1", "val/mtp/draft_kl_depth2"} <= set(logged)
    assert calibration._counts.tolist() == [4 * 14, 4 * 13]  # only the first batch (max_batches=1)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    saved = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert saved["mtp"]["draft_temperatures"] == pytest.approx(temperatures)
    assert saved["callbacks"][calibration.state_key] == {"fits": 1}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grid_size=2), "grid_size must be an integer >= 3, got 2"),
        (dict(min_temperature=0.0), "min_temperature must be a number > 0, got 0.0"),
        (dict(max_temperature=float("inf")), "max_temperature must be a number > 0, got inf"),
        (dict(min_temperature=2.0, max_temperature=1.0), "max_temperature must be > min_temperature = 2.0, got 1.0"),
        (dict(max_batches=0), "max_batches must be an integer >= 1, got 0"),
        (dict(chunk_size=-1), "chunk_size must be an integer >= 1, got -1"),
        (dict(max_positions=0), "max_positions must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_quote_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MTPDraftCalibration(**kwargs)


def test_setup_rejects_non_mtp_modules_and_state_defaults():
    with pytest.raises(TypeError, match="MTPDraftCalibration needs a LightningModule that uses MTPMixin"):
        MTPDraftCalibration().setup(L.Trainer(accelerator="cpu", logger=False), torch.nn.Linear(2, 2), "validate")
    calibration = MTPDraftCalibration()
    calibration.load_state_dict({})
    assert calibration.fits == 0
    assert calibration.state_key != MTPDraftCalibration(grid_size=9).state_key


def per_temperature_sums(betas, draft_logits, main_logits):
    """(3, G) Σ f, f', f'' by their definitions, one β at a time, in float64."""
    z = draft_logits.double()
    p = torch.softmax(main_logits.double(), -1)
    expected = (p * z).sum(-1)
    sums = torch.zeros(3, betas.shape[0], dtype=torch.float64)
    for g, beta in enumerate(betas.tolist()):
        q = torch.softmax(beta * z, -1)
        mean = (q * z).sum(-1)
        sums[0, g] = (torch.logsumexp(beta * z, -1) - beta * expected).sum()
        sums[1, g] = (mean - expected).sum()
        sums[2, g] = (q * (z - mean[:, None]) ** 2).sum(-1).sum()
    return sums


@pytest.mark.parametrize("scale, vocab", [(0.3, 50), (3.0, 300), (40.0, 7)])  # 40: β·s far below exp's -80 floor
def test_grid_sums_match_their_definitions(scale, vocab):
    torch.manual_seed(2)
    calibration = MTPDraftCalibration(grid_size=9)
    calibration.reset(depth=1)
    z = scale * torch.randn(70, vocab)
    main = z + scale * torch.randn(70, vocab)
    calibration.add_logits(1, z[:40], main[:40])
    calibration.add_logits(1, z[40:], main[40:])  # the sums add up over calls
    calibration.add_logits(1, z[:0], main[:0])  # no scored rows: nothing added
    reference = per_temperature_sums(calibration.betas, z, main)
    sums = calibration._sums[0]
    # f and f'' against their own magnitude, f' (a difference of means, near 0 at the optimum) against the logits'
    assert torch.allclose(sums[0], reference[0], rtol=1e-6, atol=1e-6 * 70)
    assert torch.allclose(sums[1], reference[1], rtol=0, atol=2e-6 * 70 * scale)
    assert torch.allclose(sums[2], reference[2], rtol=1e-5, atol=1e-9)
    assert calibration._counts.tolist() == [70]


def test_max_positions_fits_on_the_strided_subsample_of_each_batch(make_tiny_model):
    model = make_tiny_model(depth=2, vocab_size=13)
    ids = torch.randint(0, 13, (3, 14), generator=torch.Generator().manual_seed(2))
    fwd = teacher_forced_forward(model, ids, ids)
    subsampled = MTPDraftCalibration(max_positions=10)  # 3 × 12 positions: every 4th, from offset 0
    subsampled.reset(depth=2)
    subsampled.accumulate(model, fwd)
    reference = MTPDraftCalibration(max_positions=None)
    reference.reset(depth=2)
    with torch.no_grad():
        main = model.lm_head(fwd.main_hidden)  # (B, T-1, V)
        for k in (1, 2):
            span = ids.shape[1] - k - 1
            draft = model.lm_head(fwd.depth_hidden[k - 1])[:, ::4]  # (B, n, V)
            reference.add_logits(k, draft.reshape(-1, 13), main[:, k : k + span][:, ::4].reshape(-1, 13))
    assert torch.equal(subsampled._counts, torch.tensor([9.0, 9.0], dtype=torch.float64))
    torch.testing.assert_close(subsampled._sums, reference._sums)
    fitted, expected = subsampled.solve(), reference.solve()
    assert fitted.keys() == expected.keys() == {1, 2}
    for k in (1, 2):
        assert fitted[k] == pytest.approx(expected[k], rel=1e-6)
    every = MTPDraftCalibration(max_positions=36)  # not below the batch's positions: all of them
    every.reset(depth=2)
    every.accumulate(model, fwd)
    assert every._counts.tolist() == [36.0, 33.0]
