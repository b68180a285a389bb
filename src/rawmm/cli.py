"""The `rawmm` command: a thin dispatcher over `rawmm.commands.*` modules."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rawmm.commands import CliError


@dataclass(frozen=True)
class Command:
    module: str  # under rawmm.commands
    help: str
    # The pyproject extras that install what the command imports; None when the base install has it.
    extra: str | None


# Modules are imported only when used, so `rawmm operator` never pulls in torch and `rawmm serve` never
# pulls in kopf, and a role's install runs its commands without the others' dependencies.
COMMANDS: dict[str, Command] = {
    "ingest": Command(
        "ingest",
        "offload image files or folders into the store and print their refs",
        # the placeholder layout of a preset runs transformers' own resize math
        "engine",
    ),
    "ref": Command("ref", "inspect a raw image ref", None),
    "layout": Command("layout", "placeholder layout of an image size for a model preset", "engine"),
    "tiny-model": Command("tiny_model", "write a tiny random-weight checkpoint and tokenizer", "engine"),
    "serve": Command(
        "serve",
        "serve a model over HTTP, materializing raw image refs (transformers on CPU, or vLLM)",
        "engine",
    ),
    "orchestrate": Command(
        "orchestrate", "play rollouts against the engine replicas and write training batches", "trainer"
    ),
    "train": Command(
        "train",
        "train on the run's rollout batches, writing a checkpoint per step (torchrun for DP)",
        "trainer",
    ),
    "run": Command(
        "run",
        "run engines, orchestrator and trainer locally on one machine until the run is done",
        "engine,trainer",
    ),
    # plots need matplotlib; the blind ceiling line builds the run's (built-in) environment
    "report": Command("report", "rebuild a run's report.html and plots from its output directory", "report"),
    "operator": Command(
        "operator", "run the Kubernetes operator that turns RLRun resources into running stacks", "operator"
    ),
    "manifests": Command(
        "manifests", "write the RLRun CRD generated from the models, or render a run's children", "operator"
    ),
    # reading rollout batches needs msgspec; the /metrics of --watch need prometheus-client
    "gc": Command(
        "gc", "remove offload images unused for a while that no rollout batch still needs", "trainer"
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rawmm", description="multimodal RL with raw image offload")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        sub_parser.set_defaults(_module=command.module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Two passes: the first finds the command, the second lets its module add its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    command = COMMANDS[known.command]
    module = importlib.import_module(f"rawmm.commands.{command.module}")
    command_parser = argparse.ArgumentParser(prog=f"rawmm {known.command}", description=command.help)
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except CliError as exc:
        print(f"rawmm {known.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # A role's install lacks another role's dependencies: one line naming the extra, not a traceback.
        if command.extra is None or (exc.name or "").partition(".")[0] in {"rawmm", "rawmm_operator"}:
            raise
        print(
            f"rawmm {known.command}: error: needs rawmm's {command.extra} extra ({exc}): "
            f"pip install 'rawmm[{command.extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
