"""``lightning-mtp``: the LightningCLI entry point (fit / validate / test / predict).

Example::

    lightning-mtp fit --config quickstart                  # a bundled config, by name
    lightning-mtp fit --config configs/mtp.yaml --model.init_args.mtp.depth 2
    lightning-mtp predict --config predict --ckpt_path outputs/quickstart/checkpoints/last.ckpt
    lightning-mtp fit --model.help CausalLM                # every init argument, MTPConfig's fields included
    lightning-mtp export --ckpt_path last.ckpt --out DIR   # native MTP layers -> a transformers folder (cli_export)

``--config NAME`` takes a file, or, when no file of that name exists, a config bundled with the package (the
repository's ``configs/``, shipped in the wheel as ``lightning_mtp/configs``). Our classes go by their short names
(``CausalLM``, ``TextDataModule``, ``MTPDepthWarmup``, ``PredictionWriter``). The bundled models configure their own
optimizer, so LightningCLI's ``--optimizer`` / ``--lr_scheduler`` are refused (:data:`OPTIMIZATION`).

With a checkpoint (``--ckpt_path``, or ``--model.init_args.init_from`` for a new fit) the model's architecture and
the tokenizer come from it; a setting given in a config file or as a flag that contradicts the checkpoint is refused
(:mod:`lightning_mtp.cli_checkpoint`). ``predict``/``validate``/``test`` without weights to load are refused unless
``--random_weights true`` asks for them. Bad input ends with one ``lightning-mtp: error: ...`` line and exit status 2
(``LIGHTNING_MTP_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

# Imported for their classes: jsonargparse resolves a short class name (``--model.help CausalLM``,
# ``class_path: MTPDepthWarmup``) among the subclasses that are imported when it parses.
import lightning_mtp.callbacks  # noqa: F401
import lightning_mtp.data  # noqa: F401
import lightning_mtp.decoding  # noqa: F401
import lightning_mtp.models  # noqa: F401
from lightning_mtp import cli_checkpoint as ckpt_rules
from lightning_mtp import cli_errors, cli_export
from lightning_mtp.callbacks import SafeCheckpoint, folder_lock
from lightning_mtp.callbacks.safe_checkpoint import restore_interrupted_swap
from lightning_mtp.checkpoint_files import (
    convert_command,
    is_deepspeed_folder,
    read_checkpoint,
    refuse_deepspeed_folder,
)
from lightning_mtp.checkpointing import TOKENIZER_KEY
from lightning_mtp.cli_configs import bundled_configs, resolve_config_args, with_checkpoint_config
from lightning_mtp.cli_errors import ShortErrorParser, fail, peer_failed, user_error
from lightning_mtp.cli_help import document_fields, print_nested_help
from lightning_mtp.finite import TrainingDiverged, check_finite_state_dict

EVALUATING = ("predict", "validate", "test")
WEIGHT_SOURCES = ("init_from", "pretrained", "mtp_heads")
"""Model init arguments that load weights (besides ``--ckpt_path``)."""
SUBCOMMANDS = ("fit", "validate", "test", "predict")
OPTIMIZATION = (
    "the bundled models (CausalLM, HFCausalLM) build their optimizer themselves: AdamW with decoupled weight decay "
    "on matrices, linear warmup then cosine decay; set --model.init_args.learning_rate, "
    "--model.init_args.weight_decay and --model.init_args.warmup_steps (a module of your own configures its "
    "optimizer in configure_optimizers)"
)
"""Why ``--optimizer`` / ``--lr_scheduler`` are refused, and what to set instead."""
EXPORT_HELP = ("and export: write a checkpoint's native MTP layers as a transformers folder, lightning-mtp export "
               "--ckpt_path CKPT --out DIR (see lightning-mtp export --help)")


class MTPLightningCLI(LightningCLI):
    """LightningCLI whose model and data are chosen by ``class_path`` in the config (any MTP host, any data)."""

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.epilog = EXPORT_HELP
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for action in parser._actions:  # LightningCLI's own --config: say that it takes the bundled names too
            if action.dest == "config":
                action.help = (f"a config file (yaml or json), or the name of a bundled config: "
                               f"{', '.join(bundled_configs())}")
        parser.add_argument(
            "--random_weights", type=bool, default=False,
            help="predict/validate/test with freshly initialised weights when no --ckpt_path (or init_from, "
                 "pretrained, mtp_heads) is given; without it such a run is refused (fit ignores this flag)",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if isinstance(args, (dict, Namespace)):
            self._raw_args: list[str] = []
            self.config = parser.parse_object(args)
            return
        self._raw_args = resolve_config_args(with_checkpoint_config(
            [str(a) for a in (sys.argv[1:] if args is None else args)]))
        refuse_optimizer_settings(self._raw_args)
        cli_errors.CONFIG_FILES[:] = [value for flag, value in zip(self._raw_args, self._raw_args[1:])
                                      if flag in ("--config", "-c")] + [
            token.split("=", 1)[1] for token in self._raw_args if token.startswith("--config=")]
        try:
            self.config = parser.parse_args(self._raw_args)
        except SystemExit as done:
            if done.code in (0, None):
                print_nested_help(parser, self._raw_args)
            raise

    # ----------------------------------------------------------------- checkpoint settings
    def _parse_ckpt_path(self) -> None:
        """Take the model's architecture and the tokenizer from the checkpoint; refuse given settings that differ."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        section = self.config[subcommand]
        current = ckpt_rules.flatten(section.as_dict())
        files = ckpt_rules.config_files(self._raw_args)
        if subcommand in EVALUATING:  # a bundled config's values are templates: the checkpoint's model and data win
            files = [f for f in files if not is_bundled_config(f)]  # (a user's own config still counts as given)
        given = ckpt_rules.given_keys(self._raw_args, files)
        ckpt_path = section.get("ckpt_path")
        if ckpt_path == "last":  # Lightning's word for the checkpoint callback's last.ckpt
            ckpt_path = section["ckpt_path"] = last_checkpoint(section, subcommand)
        init_from = current.get("model.init_from")
        self._tokenizer_record: Optional[dict] = None
        if ckpt_path:
            if restore_interrupted_swap(str(ckpt_path)):
                print(f"lightning-mtp: {ckpt_path} brought back from the copy kept while a save was interrupted",
                      file=sys.stderr)
            strategy = " ".join(str(value) for key, value in current.items() if key.startswith("trainer.strategy"))
            if "deepspeed" not in strategy.lower():  # Lightning reads the shards as a file
                if subcommand == "fit" and is_deepspeed_folder(ckpt_path):
                    raise ValueError(
                        f"--ckpt_path {str(ckpt_path)!r} is a DeepSpeed checkpoint folder: resume it under the "
                        "DeepSpeed config it was written with (--config deepspeed_zero2 or deepspeed_zero3 before the "
                        f"model's config), or convert it to one fp32 file with {convert_command(ckpt_path)} and start "
                        "a new fit from its weights with --model.init_args.init_from model.ckpt")
                refuse_deepspeed_folder(ckpt_path, "--ckpt_path", subcommand)
            checkpoint = read_checkpoint(ckpt_path, "--ckpt_path")
            if subcommand == "predict":
                check_finite_state_dict(checkpoint.get("state_dict") or {}, f"--ckpt_path {ckpt_path}")
            self._apply_checkpoint(subcommand, checkpoint, current, given, resuming=subcommand == "fit")
        elif init_from and subcommand == "fit":
            checkpoint = read_checkpoint(init_from, "--model.init_args.init_from")
            if not self._tokenizer_adds_tokens(checkpoint, current, given):
                self._take_tokenizer(subcommand, checkpoint, current, given,
                                     "the --model.init_args.init_from checkpoint", defaults=())
        elif subcommand in EVALUATING and not section.get("random_weights"):
            sources = [key for key in WEIGHT_SOURCES if current.get(f"model.{key}")]
            if not sources:
                raise ValueError(
                    f"{subcommand} needs trained weights: give --ckpt_path PATH (a checkpoint written by "
                    f"lightning-mtp fit), or --random_weights true to {subcommand} with freshly initialised weights "
                    "(e.g. to try the pipeline)"
                )

    def _apply_checkpoint(self, subcommand: str, checkpoint: dict, current: dict, given: set, resuming: bool) -> None:
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        if self._moved_model_folder(hparams, current, given):
            hparams["pretrained"] = current["model.pretrained"]
        saved = ckpt_rules.model_settings(hparams)
        found = ckpt_rules.conflicts(saved, current, given)
        if not resuming:  # the learning rate and its schedule do not describe the weights
            found = [conflict for conflict in found if conflict[0] not in ckpt_rules.OPTIMIZER_SETTINGS]
        if found:
            advice = (
                "A resumed fit keeps the checkpoint's model: drop the flag (or fix the config) to resume, or start a "
                "new fit from its weights with --model.init_args.init_from PATH instead of --ckpt_path" if resuming
                else f"{subcommand} runs the checkpoint's model: drop the flag (or remove the setting from the config)"
            )
            raise ValueError(ckpt_rules.describe_conflicts(found, "the checkpoint", advice))
        plain = {k: v for k, v in ckpt_rules.without_missing_folder(checkpoint, hparams).items()
                 if k not in ckpt_rules.MODEL_KEYS_NOT_FROM_CHECKPOINT}
        recorded = ckpt_rules.recorded_model_class(checkpoint)
        class_path = recorded or self.config[subcommand].model.class_path
        if recorded is None:
            ckpt_rules.refuse_other_model_class(checkpoint, class_path, "--ckpt_path")
        if plain or class_path != self.config[subcommand].model.class_path:
            update = {subcommand: {"model": {"class_path": class_path, "init_args": plain}}}
            self.config = self.parser.parse_object(update, self.config)
        defaults = ckpt_rules.RESUME_DATA_SETTINGS if resuming else ckpt_rules.EVAL_DATA_SETTINGS
        self._take_tokenizer(subcommand, checkpoint, current, given, "the checkpoint", defaults, strict=resuming)

    @staticmethod
    def _moved_model_folder(hparams: dict, current: dict, given: set) -> bool:
        """Whether ``--model.init_args.pretrained`` names where the checkpoint's model folder went: the checkpoint
        records a folder that is gone, and the flag gives an existing one. The checkpoint's weights then load over
        that folder's model, which checks it is the same model (the trunk's shapes; for a heads-only checkpoint the
        fingerprint of the trunk weights its heads were trained over)."""
        recorded, wanted = hparams.get("pretrained"), current.get("model.pretrained")
        return (ckpt_rules.is_given("model.pretrained", given) and isinstance(recorded, str)
                and isinstance(wanted, str) and not Path(recorded).is_dir() and Path(wanted).is_dir())

    @staticmethod
    def _tokenizer_adds_tokens(checkpoint: dict, current: dict, given: set) -> bool:
        """A new fit from a checkpoint's weights (``init_from``) whose data asks for another model-folder tokenizer
        than the checkpoint's (``--data.init_args.tokenizer``, else the folder of ``--model.init_args.pretrained``):
        ``True`` when it keeps every id of the checkpoint's and adds tokens (special tokens added to the folder, its
        embedding resized), and it is used; refused when it gives other ids; ``False`` where the checkpoint's is."""
        from lightning_mtp.data.pretrained_tokenizer import is_tokenizer_path, load_pretrained_tokenizer
        from lightning_mtp.data.tokenizer_choice import ids_changed

        record = checkpoint.get(TOKENIZER_KEY) or {}
        wanted, flag = current.get("data.tokenizer"), "--data.init_args.tokenizer"
        if not ckpt_rules.is_given("data.tokenizer", given) or wanted is None:
            wanted, flag = current.get("model.pretrained"), "--model.init_args.pretrained"
            if not isinstance(wanted, str) or not any((Path(wanted) / name).is_file()
                                                       for name in ("tokenizer.json", "tokenizer_config.json")):
                return False  # no folder tokenizer: the checkpoint's is used
        if record.get("kind") != "pretrained" or not is_tokenizer_path(wanted):
            return False  # byte / BPE on either side: the checkpoint's rules apply (_take_tokenizer)
        mine = load_pretrained_tokenizer(wanted).spec()
        if mine.get("fingerprint") == record.get("fingerprint"):
            return False
        problem = ids_changed(mine, record)
        if problem is not None:
            raise ValueError(
                f"{flag} {wanted}: its tokenizer gives other ids than {record.get('name')}, the tokenizer the "
                f"--model.init_args.init_from checkpoint was trained with ({problem}), and the checkpoint's weights "
                "mean that tokenizer's ids: start from a checkpoint of this model folder, or from its own weights "
                "without --model.init_args.init_from")
        print(f"lightning-mtp: the tokenizer of {wanted} ({mine.get('vocab_size')} ids) keeps every id of the "
              f"checkpoint's {record.get('name')} and adds tokens: the fit uses it", file=sys.stderr)
        return True

    def _take_tokenizer(self, subcommand: str, checkpoint: dict, current: dict, given: set, source: str,
                        defaults: tuple, strict: bool = False) -> None:
        """Use the checkpoint's tokenizer; its data settings fill ``defaults`` that were not given."""
        record = checkpoint.get(TOKENIZER_KEY)
        if not record:
            rank_zero_warn(f"{source} does not record its tokenizer (written before lightning-mtp stored it, or "
                           "trained without a TextDataModule): make sure --data uses the tokenizer it was trained with")
            return
        data_class = current.get("data.class_path")
        if data_class is not None and _qualified(data_class) != record.get("datamodule"):
            return  # another datamodule: the model still refuses a tokenizer it was not trained with (setup)
        names = ckpt_rules.TOKENIZER_SETTINGS if record.get("kind") == "bpe" else ("tokenizer",)
        found = ckpt_rules.conflicts(ckpt_rules.data_settings(record, names), current, given)
        if record.get("kind") not in ("bpe", "byte"):  # null asks for the model folder's own, which the record is
            # (whether it is the same tokenizer, the data module checks by its fingerprint), and DIR/tokenizer.json is
            # the folder DIR's
            found = [c for c in found if not (c[0] == "data.tokenizer" and (c[1] is None or (
                isinstance(c[1], str) and Path(c[1]).name == "tokenizer.json"
                and ckpt_rules.same(str(Path(c[1]).parent), c[2]))))]
        data_found = ckpt_rules.conflicts(ckpt_rules.data_settings(record, defaults), current, given) if strict else []
        if found or data_found:
            advice = []
            if found:
                advice.append(f"The weights were trained with the tokenizer {record.get('name')}; lightning-mtp uses "
                              "it when --data.init_args.tokenizer and --data.init_args.vocab_size are null or left "
                              "unset")
            if data_found:
                advice.append("A resumed fit keeps the data settings it was trained with: drop the flag to resume, or "
                              "start a new fit from its weights with --model.init_args.init_from")
            raise ValueError(ckpt_rules.describe_conflicts(found + data_found, source, "; ".join(advice)))
        taken = ckpt_rules.data_settings(record, ckpt_rules.TOKENIZER_SETTINGS + tuple(defaults))
        if record.get("kind") not in ("bpe", "byte"):  # a model folder's: rebuilt from the record, not the path
            taken.pop("data.tokenizer", None)
        if subcommand == "predict" and current.get("data.predict_prompts"):
            taken.pop("data.corpus", None)  # prompts given: the training corpus is not read (it may not be here)
        init_args = {key.split(".", 1)[1]: value for key, value in taken.items()
                     if not ckpt_rules.is_given(key, given)}
        if init_args:
            update = {subcommand: {"data": {"class_path": data_class or record["datamodule"], "init_args": init_args}}}
            self.config = self.parser.parse_object(update, self.config)
        self._tokenizer_record = record

    def before_instantiate_classes(self) -> None:
        # Quiet the one-line tokenizers fork warning that would otherwise repeat per dataloader worker.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        record = getattr(self, "_tokenizer_record", None)
        if record is not None and hasattr(self.datamodule, "use_tokenizer"):
            from lightning_mtp.data.tokenizer_choice import tokenizer_from_spec

            self.datamodule.use_tokenizer(tokenizer_from_spec(record))
        self._apply_generation_settings()

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The trainer; only ``fit`` saves its config (``predict`` writes nothing outside its output folder), and
        ``--trainer.enable_checkpointing false`` drops the config's checkpoint callbacks rather than clash with them."""
        if self.subcommand != "fit":
            self.save_config_callback = None
        settings = self._get(self.config_init, "trainer", default={})
        callbacks = settings.get("callbacks")
        if settings.get("enable_checkpointing") is False and callbacks:  # asked for no checkpoints: the config's go
            callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
            settings["callbacks"] = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
        return super().instantiate_trainer(**kwargs)

    def _apply_generation_settings(self) -> None:
        """Generation settings (a config's ``model.init_args.generation`` block, ``--model.init_args.generation.*``
        flags) for a module whose class takes no ``generation`` argument: jsonargparse drops them when the model class
        changes (a checkpoint's own module, ``--model``), so they are read from the arguments and set on the module
        (``mtp_generate_kwargs``, what ``predict_step`` decodes with)."""
        class_path = self.config[self.subcommand].model.get("class_path") if self.subcommand else None
        parameters = ckpt_rules.init_parameters(class_path) if class_path else None
        if parameters is None or "generation" in parameters:
            return
        values = ckpt_rules.given_values(self._raw_args, ckpt_rules.config_files(self._raw_args), "model.generation")
        if values:
            from lightning_mtp.decoding import GenerationConfig

            self.model.mtp_generate_kwargs = GenerationConfig(**values).to_kwargs()

    def before_fit(self) -> None:
        """Check the trainer's settings Lightning leaves unchecked, and take the checkpoint folders' locks before the
        fit starts (and before its config or logs are written): a second fit into the same folder is refused
        (:class:`~lightning_mtp.callbacks.SafeCheckpoint`)."""
        interval = self.trainer.val_check_interval
        if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval <= 0:
            raise ValueError(f"--trainer.val_check_interval must be > 0 (a number of batches, or a share of an epoch "
                             f"in (0, 1]), got {interval!r}")
        if rank_zero_only.rank != 0:
            return
        resuming = bool(self.config[self.subcommand].get("ckpt_path"))
        for callback in self.trainer.callbacks:
            if isinstance(callback, SafeCheckpoint):
                callback.lock_folder()
                callback.check_new_fit(resuming)


def last_checkpoint(section: Any, subcommand: str) -> Optional[str]:
    """``--ckpt_path last``: ``last.ckpt`` in the folder of the config's checkpoint callback (``SafeCheckpoint``);
    for ``fit``, ``None`` (a new fit) while there is none."""
    callbacks = section.get("trainer", {}).get("callbacks") or []
    folders = [str(c.get("init_args", {}).get("dirpath")) for c in (callbacks if isinstance(callbacks, list)
               else [callbacks]) if hasattr(c, "get") and str(c.get("class_path", "")).endswith("Checkpoint")
               and c.get("init_args", {}).get("dirpath")]
    if not folders:
        raise ValueError("--ckpt_path last: the config's checkpoint callback names no dirpath (its checkpoints go to "
                         "the logger's folder of each fit, a new version each time): give the checkpoint's path, or "
                         "set the callback's dirpath in the config to resume with last")
    path = Path(folders[0]) / "last.ckpt"
    restore_interrupted_swap(str(path))
    # with enable_version_counter a later fit writes last-v1.ckpt beside it: the newest is the fit to resume, as
    # Lightning's own "last" takes it
    path = max(Path(folders[0]).glob("last*.ckpt"), key=lambda p: p.stat().st_mtime, default=path)
    if not path.exists():
        if subcommand != "fit":
            raise ValueError(f"--ckpt_path last: there is no {path} yet (no fit has written one)")
        # Lightning's reading: set once, it resumes a fit that was stopped and starts one that never ran (a job a
        # scheduler requeues runs one command)
        if rank_zero_only.rank == 0:
            print(f"lightning-mtp: --ckpt_path last: there is no {path} yet: a new fit starts", file=sys.stderr)
        return None
    return str(path)


# --------------------------------------------------------------------- bundled configs
def is_bundled_config(path: str) -> bool:
    """Whether a (resolved) ``--config`` value is one of the bundled configs' files."""
    try:
        return Path(path).is_file() and any(Path(str(f)).resolve() == Path(path).resolve()
                                            for f in bundled_configs().values())
    except (OSError, ValueError):  # YAML text given as the value, or a name too long for a path
        return False


def refuse_optimizer_settings(args: list[str]) -> None:
    """Raise ``ValueError`` when a flag or a ``--config`` file sets LightningCLI's ``optimizer`` / ``lr_scheduler``."""
    try:
        given = ckpt_rules.given_keys(args, ckpt_rules.config_files(args))
    except (OSError, yaml.YAMLError):
        return  # an unreadable config: the parser reports it
    for key in sorted(given):
        parts = key.split(".")
        parts = parts[1:] if parts[0] in SUBCOMMANDS else parts  # a top-level config: ``fit: {optimizer: ...}``
        if parts and parts[0] in ("optimizer", "lr_scheduler"):
            raise ValueError(f"--{parts[0]} is not supported: {OPTIMIZATION}")


def _qualified(class_path: str) -> str:
    """``lightning_mtp.data.TextDataModule`` -> ``lightning_mtp.data.datamodule.TextDataModule`` (its definition)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return class_path
    return f"{cls.__module__}.{cls.__qualname__}"


def _deepspeed_logs_to_stderr() -> None:
    """DeepSpeed logs to stdout (on a machine without a GPU its first import warns that it chose the CPU), which put a
    log line at the top of a DeepSpeed config printed by ``--print_config``: a file that does not parse back. Imported
    here with stdout pointing at stderr, its log handler keeps writing there."""
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import deepspeed.utils.logging  # noqa: F401
        except ImportError:  # pragma: no cover - deepspeed is a core dependency
            pass


def main(args: Optional[list[str]] = None) -> None:
    argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
    if argv[:1] == ["export"]:  # not a Trainer subcommand: checkpoint -> transformers folder (cli_export)
        try:
            return cli_export.main(argv[1:])
        except Exception as error:
            message = user_error(error)
            if message is None or os.environ.get("LIGHTNING_MTP_TRACEBACK"):
                raise
            fail(message)
    document_fields()
    if any(arg.startswith("--print_config") for arg in argv):
        _deepspeed_logs_to_stderr()
    try:
        MTPLightningCLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            auto_configure_optimizers=False,
            parser_class=ShortErrorParser,
        )
        tear_down_process_group()
    except TrainingDiverged as error:
        if os.environ.get("LIGHTNING_MTP_TRACEBACK"):
            raise
        fail(str(error), status=1)
    except Exception as error:
        message = user_error(error)
        if os.environ.get("LIGHTNING_MTP_TRACEBACK"):
            raise
        if message is None and peer_failed(error):
            fail(f"process {os.environ.get('RANK', os.environ.get('LOCAL_RANK', '?'))} stopped: another process of "
                 "this run failed (its error is printed above or below)", status=1)
        if message is None:
            raise
        fail(message)
    finally:
        folder_lock.release_all()  # the fit's checkpoint folders, also when it was refused before it started


def tear_down_process_group() -> None:
    """After a command that ran on several processes: wait for every process, then destroy the process group. Left to
    the interpreter's exit, a gloo thread still joinable aborted a finished run ("terminate called without an active
    exception", exit status 134 / -6) after every output was written, which a scheduler reads as a failed job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # (one process: nothing to wait
        # for, and a one-process group may be DeepSpeed's, which later runs in the same process reuse)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
