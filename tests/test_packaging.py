"""The wheel: the bundled configs and ``py.typed`` inside it, the version written once, and the installed wheel's CLI
running every bundled config by name, away from any source checkout.

The wheel is built offline from a copy of the sources (the build writes ``build/`` and ``*.egg-info`` next to them)
and installed with ``--no-deps`` into a scratch virtual environment that sees this environment's packages (torch,
lightning, ...) through a ``.pth`` file, but not its editable ``lightning_mtp``: a ``.pth`` file in a folder added by
another ``.pth`` file is not run, so the editable install's import hook stays out.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_mtp

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]

RUN_EVERY_BUNDLED_CONFIG = """
import contextlib, io, json, sys
import lightning_mtp
from importlib.metadata import version
from lightning_mtp.cli import main
from lightning_mtp.cli_configs import bundled_configs

report = {"module": lightning_mtp.__file__, "version": version("lightning-mtp"), "configs": {}}
for name, file in bundled_configs().items():
    printed, code = io.StringIO(), None
    # a trainer-only config (no top-level model:, as fsdp.yaml) is layered on a model config, as its header shows
    has_model = any(line.startswith("model:") for line in file.read_text().splitlines())
    layered = [] if has_model else ["--config", "quickstart"]
    try:
        with contextlib.redirect_stdout(printed):
            main(["predict" if name.startswith("predict") else "fit", *layered, "--config", name, "--print_config"])
    except SystemExit as done:
        code = done.code
    report["configs"][name] = {"code": code, "printed": printed.getvalue()}
with open(sys.argv[1], "w") as out:
    json.dump(report, out)
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("lightning_mtp", "configs"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    _run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(source)])
    (path,) = dist.glob("lightning_mtp-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A scratch virtual environment holding the wheel, on top of this environment's packages."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(purelib, "_test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(python), *PIP[1:], "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)])
    return root


def test_wheel_holds_every_bundled_config_and_py_typed(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "lightning_mtp/py.typed" in names
        for config in CONFIGS:
            assert archive.read(f"lightning_mtp/configs/{config.name}") == config.read_bytes()  # built from configs/
        assert {n for n in names if n.startswith("lightning_mtp/configs/")} == {
            f"lightning_mtp/configs/{c.name}" for c in CONFIGS}


def test_wheel_holds_every_subpackage(wheel):
    """``[tool.setuptools] packages`` in pyproject.toml is a list: a subpackage missing from it is missing here."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for init in sorted((REPO / "lightning_mtp").rglob("__init__.py")):
        path = init.relative_to(REPO).as_posix()
        assert path in names, f"{path} is not in the wheel: add its package to [tool.setuptools] packages"


def test_version_is_written_once(wheel, venv):
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"lightning_mtp-{lightning_mtp.__version__}.dist-info/METADATA").decode()
    assert f"\nVersion: {lightning_mtp.__version__}\n" in metadata
    installed = _run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version("
                                                          "'lightning-mtp'))"]).stdout.strip()
    assert installed == lightning_mtp.__version__


def test_installed_wheel_prints_every_bundled_config_by_name(venv, tmp_path):
    report_file = tmp_path / "report.json"
    _run([str(venv / "bin" / "python"), "-c", RUN_EVERY_BUNDLED_CONFIG, str(report_file)], cwd=tmp_path)
    report = json.loads(report_file.read_text())
    assert Path(report["module"]).is_relative_to(venv), report["module"]  # the wheel's package, not the checkout
    assert sorted(report["configs"]) == [c.stem for c in CONFIGS]
    for name, run in report["configs"].items():
        assert run["code"] in (0, None), name
        assert "class_path: lightning_mtp.models." in run["printed"] and "trainer:" in run["printed"], name


def test_installed_console_script_takes_a_bundled_name(venv, tmp_path):
    done = _run([str(venv / "bin" / "lightning-mtp"), "fit", "--config", "quickstart", "--print_config"], cwd=tmp_path)
    assert "class_path: lightning_mtp.models.CausalLM" in done.stdout
    assert "default_root_dir: outputs/quickstart" in done.stdout
