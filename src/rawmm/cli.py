"""The `rawmm` command: a thin dispatcher over `rawmm.commands.*` modules."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module under rawmm.commands, one-line help). Modules are imported only when used,
# so `rawmm operator` never pulls in torch and `rawmm serve` never pulls in kopf.
COMMANDS: dict[str, tuple[str, str]] = {
    "ingest": ("ingest", "offload image files or folders into the store and print their refs"),
    "ref": ("ref", "inspect a raw image ref"),
    "layout": ("layout", "placeholder layout of an image size for a model preset"),
    "tiny-model": ("tiny_model", "write a tiny random-weight checkpoint and tokenizer"),
    "serve": (
        "serve",
        "serve a model over HTTP, materializing raw image refs (transformers on CPU, or vLLM)",
    ),
    "orchestrate": ("orchestrate", "play rollouts against the engine replicas and write training batches"),
    "train": ("train", "train on the run's rollout batches, writing a checkpoint per step (torchrun for DP)"),
    "run": ("run", "run engines, orchestrator and trainer locally on one machine until the run is done"),
    "operator": ("operator", "run the Kubernetes operator that turns RLRun resources into running stacks"),
    "manifests": ("manifests", "write the RLRun CRD generated from the models, or render a run's children"),
}


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rawmm", description="multimodal RL with raw image offload")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Two passes: the first finds the command, the second lets its module add its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module = importlib.import_module(f"rawmm.commands.{known._module}")
    command_parser = argparse.ArgumentParser(
        prog=f"rawmm {known.command}", description=COMMANDS[known.command][1]
    )
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except CliError as exc:
        print(f"rawmm {known.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Under `python -m rawmm.cli` this module is `__main__`; commands raise the CliError of `rawmm.cli`,
    # so dispatch through that module or its errors would surface as tracebacks.
    from rawmm.cli import main as entry

    sys.exit(entry())
