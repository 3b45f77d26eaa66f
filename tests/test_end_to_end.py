"""The real path a user takes: ``lightning-mtp fit`` -> checkpoint -> ``lightning-mtp predict`` (speculative).

Real CLI, real standard-library corpus, real TensorBoard event files, real checkpoint on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_mtp.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_fit_checkpoint_speculative_predict_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = ["--data.init_args.tokenizer", "byte", "--data.init_args.max_bytes", "300000",
            "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "4",
            "--data.init_args.cache_dir", str(tmp_path / "cache")]
    main(["fit", "--config", "configs/quickstart.yaml", *data,
          "--trainer.max_steps", "12", "--trainer.val_check_interval", "6", "--trainer.limit_val_batches", "2",
          "--trainer.log_every_n_steps", "2", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.logger.init_args.save_dir", str(tmp_path / "tb"),
          "--trainer.callbacks.init_args.dirpath", str(tmp_path / "ckpt"),
          "--model.init_args.model.vocab_size", "258", "--model.init_args.model.dim", "64",
          "--model.init_args.model.n_layers", "2", "--model.init_args.model.max_seq_len", "96",
          "--model.init_args.mtp.depth", "2"])
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file()

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events
    tags = set()
    for event_file in events:
        accumulator = EventAccumulator(str(event_file))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    expected = {"train/main/loss", "train/mtp/loss", "val/main/loss", "val/main/acc"}
    for k in (1, 2):
        expected |= {f"train/mtp/loss_depth{k}", f"train/mtp/acc_depth{k}", f"val/mtp/loss_depth{k}",
                     f"val/mtp/acc_depth{k}"}
    assert expected <= tags, expected - tags

    outputs = {}
    for speculative in ("false", "true"):
        out = tmp_path / f"predict_{speculative}"
        # No tokenizer or data flags: the checkpoint carries its tokenizer and its training data settings.
        main(["predict", "--config", "configs/predict.yaml", "--ckpt_path", str(ckpt),
              "--data.init_args.cache_dir", str(tmp_path / "cache"),
              "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
              "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks.init_args.output_dir", str(out),
              "--data.init_args.num_predict_prompts", "3", "--data.init_args.prompt_tokens", "8",
              "--model.init_args.generation.max_new_tokens", "16",
              "--model.init_args.generation.speculative", speculative])
        outputs[speculative] = (
            [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()],
            json.loads((out / "stats.json").read_text()),
        )
    plain, speculative = outputs["false"], outputs["true"]
    assert len(plain[0]) == 3
    # lossless greedy, end to end from a trained checkpoint
    assert [r["tokens"] for r in plain[0]] == [r["tokens"] for r in speculative[0]]
    assert plain[1]["tau"] == 1.0 and speculative[1]["tau"] >= 1.0
