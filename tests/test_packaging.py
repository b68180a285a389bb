"""Installs per role: the base package (contract, config, CLI) imports nothing heavy, and the operator's
install (`rawmm[operator]` into a fresh venv, from the package registry) carries no torch and runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "torchvision", "vllm", "numpy", "fastapi", "kopf", "kubernetes")


def imported_heavy_modules(code: str) -> list[str]:
    """Top-level heavy packages in sys.modules after running ``code`` in a fresh interpreter."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.partition('.')[0] for m in sys.modules}})))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return sorted(set(json.loads(result.stdout.splitlines()[-1])) & set(HEAVY))


def test_base_modules_import_nothing_heavy() -> None:
    assert (
        imported_heavy_modules("import rawmm.cli, rawmm.config, rawmm.contract, rawmm.config.quantity") == []
    )


def test_every_command_builds_its_parser_without_heavy_imports() -> None:
    # `rawmm X --help` must work in any role's install: commands import heavy modules inside run().
    code = (
        "import argparse, importlib\n"
        "from rawmm.cli import COMMANDS\n"
        "for command in COMMANDS.values():\n"
        "    importlib.import_module('rawmm.commands.' + command.module).add_arguments(argparse.ArgumentParser())"
    )
    assert imported_heavy_modules(code) == []


def copy_project(destination: Path) -> Path:
    """The files a wheel is built from, so the build writes nothing into the working tree."""
    destination.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(REPO / name, destination / name)
    for name in ("src", "operator"):
        shutil.copytree(
            REPO / name, destination / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    return destination


@pytest.mark.slow
def test_operator_install_pulls_no_torch_and_runs(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "project")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {key: value for key, value in os.environ.items() if key not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "-q", "-c", "constraints.txt", ".[operator]"],
        cwd=project,
        env=env,
        check=True,
        timeout=600,
    )
    installed = subprocess.run(
        [bin_dir / "python", "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    )
    names = {package["name"].lower().replace("_", "-") for package in json.loads(installed.stdout)}
    assert {"kopf", "kubernetes", "httpx", "prometheus-client", "rawmm"} <= names
    assert not names & {"torch", "transformers", "torchvision", "vllm", "numpy"}

    def rawmm(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [bin_dir / "rawmm", *argv], capture_output=True, text=True, env=env, cwd=tmp_path
        )

    help_run = rawmm("operator", "--help")
    assert help_run.returncode == 0 and "--all-namespaces" in help_run.stdout
    crd = rawmm("manifests", "--print")
    assert crd.returncode == 0 and "kind: CustomResourceDefinition" in crd.stdout
    # The kopf entry point and the reconcile logic import with this install alone.
    subprocess.run(
        [bin_dir / "python", "-c", "import rawmm_operator.main, rawmm_operator.reconcile"],
        env=env,
        check=True,
        cwd=tmp_path,
    )
    # Another role's command says which extra it needs, in one line.
    missing = rawmm("tiny-model", "--preset", "qwen2_vl", "--out", str(tmp_path / "tiny"))
    assert missing.returncode == 2
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("rawmm tiny-model: error: needs rawmm's engine extra") and "rawmm[engine]" in line


def test_dev_installs_every_role_but_the_gpu_engine() -> None:
    # `make` installs `.[dev]`; vLLM comes from its own CPU build there (inference is the GPU image's extra).
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (roles,) = [req for req in extras["dev"] if req.startswith("rawmm[")]
    assert set(roles.removeprefix("rawmm[").removesuffix("]").split(",")) == set(extras) - {
        "dev",
        "inference",
    }
