"""``--model.help``: the fields a CLI user can set, nested config fields included, and no Python-only arguments.

``HFCausalLM``'s ``trunk`` (a ``transformers`` model object, typed ``nn.Module``) is left out of the CLI's parser
(:data:`lightning_mtp.cli_help.PYTHON_ONLY_ARGS`): its help used to list every ``nn.Module`` subclass jsonargparse
knows (~770 lines), and every saved config carried ``trunk: null``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import cli_refusal

from lightning_mtp.cli import main

REPO = Path(__file__).resolve().parents[1]


def _printed(args, capsys) -> str:
    """Run the CLI up to its help / ``--print_config`` exit (status 0), return what it printed."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), captured.err
    return captured.out


def _class_section(printed: str) -> str:
    """The class's own init arguments: up to the first nested dataclass help (the next ``usage:``)."""
    first, _, rest = printed.partition("usage:")
    return first + "usage:" + rest.split("usage:")[0]


@pytest.mark.parametrize("model", ["HFCausalLM", "CausalLM"])
def test_model_help_is_short_and_lists_what_the_cli_can_set(model, capsys):
    printed = _printed(["fit", "--model.help", model], capsys)
    flat = " ".join(printed.split())  # the help wraps long lines
    # before: HFCausalLM 772 lines (463 of them nn.Module subclasses); the nested MTPConfig / GenerationConfig
    # field help is ~240 of the ~310 lines both print now
    assert len(printed.splitlines()) < 400
    assert len(_class_section(printed).splitlines()) < 80
    assert "known subclasses" not in flat and "torch.nn" not in flat
    assert "--model.learning_rate" in flat and "AdamW peak learning rate" in flat
    assert "--model.mtp.depth" in flat and "how many extra future tokens are predicted" in flat
    assert "--model.generation.max_new_tokens" in flat and "Tokens to generate after each prompt" in flat


def test_hf_model_help_names_every_cli_field_and_trunk_in_one_line(capsys):
    printed = _printed(["fit", "--model.help", "HFCausalLM"], capsys)
    flat = " ".join(printed.split())
    for name in ("model_type", "config", "pretrained", "mtp", "freeze_trunk", "save_trunk", "mtp_heads",
                 "learning_rate", "weight_decay", "warmup_steps", "attn_implementation", "generation"):
        assert f"--model.{name} " in flat, name
    assert "a local directory written by ``save_pretrained``" in flat  # the init arguments' docstrings
    assert "--model.mtp.loss_weight" in flat and "--model.generation.temperature" in flat
    assert "--model.trunk" not in flat
    trunk_lines = [line for line in printed.splitlines() if "trunk:" in line]
    assert trunk_lines == ["  trunk: a transformers model object; Python only (HFCausalLM(trunk=model))"]


def test_hf_llama_config_parses_without_trunk(capsys):
    printed = _printed(["fit", "--config", str(REPO / "configs" / "hf_llama.yaml"), "--print_config"], capsys)
    assert "class_path: lightning_mtp.models.HFCausalLM" in printed and "model_type: llama" in printed
    assert not re.search(r"^\s*trunk:", printed, re.MULTILINE)
    assert "freeze_trunk: false" in printed


def test_trunk_is_refused_on_the_command_line_but_taken_from_python(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "hf_llama.yaml"), "--model.init_args.trunk", "null",
              "--print_config"])
    assert exit_info.value.code == 2
    assert "trunk" in capsys.readouterr().err

    # the CLI hides it from jsonargparse only: Python still passes a built model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mtp.models import HFCausalLM

    trunk = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=64))
    assert HFCausalLM(trunk=trunk).trunk is trunk


def test_printed_deepspeed_config_parses_back(tmp_path):
    """``fit --config deepspeed_zero3 --print_config > ds3.yaml`` writes a config that reads back: DeepSpeed's first
    import warned on stdout (no GPU here) and put ``[...] [WARNING] [real_accelerator.py...]`` at the file's top, so
    ``--config ds3.yaml`` failed with "Problems parsing config". A fresh process: the warning comes at the first
    import only."""
    import os
    import subprocess
    import sys

    import yaml

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DS_ACCELERATOR", None)
    command = [sys.executable, "-m", "lightning_mtp.cli", "fit", "--config", "deepspeed_zero3", "--print_config"]
    printed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout.startswith("# lightning.pytorch=="), printed.stdout[:300]
    (tmp_path / "ds3.yaml").write_text(printed.stdout)
    assert yaml.safe_load(printed.stdout)["trainer"]["strategy"]
    again = subprocess.run([*command[:4], "--config", "ds3.yaml", "--print_config"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_flag_is_taken_by_its_whole_name_only(capsys):
    """``--trainer.max_ste 5`` is refused in one line, not read as ``--trainer.max_steps`` (an abbreviation that a
    later flag could make mean something else, or that a typo could turn into a flag the user did not mean)."""
    err = cli_refusal(["fit", "--config", str(REPO / "configs" / "mtp.yaml"), "--trainer.max_ste", "5",
                       "--print_config"], capsys)
    assert "unrecognized arguments: --trainer.max_ste 5" in err, err
