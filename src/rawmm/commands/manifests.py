"""`rawmm manifests`: write the RLRun CRD (generated from the pydantic models), or render a run's children."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rawmm.commands import CliError

CRD_FILE = "rlruns.rawmm.dev.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("manifests/crds"),
        help="where the CRD is written (default: %(default)s)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the file is out of date"
    )
    parser.add_argument("--print", action="store_true", help="print the CRD to stdout instead of writing it")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RLRUN_YAML",
        help="print the children the operator would create for this RLRun, all but its weights Secret "
        "(a dry run of its builders)",
    )


def run(args: argparse.Namespace) -> int:
    from rawmm_operator.crd import crd_yaml

    if args.render is not None:
        print(_render(args.render), end="")
        return 0
    text = crd_yaml()
    if args.print:
        sys.stdout.write(text)
        return 0
    path = args.out_dir / CRD_FILE
    current = path.read_text() if path.exists() else None
    if args.check:
        if current != text:
            print(f"{path} is out of date: run `rawmm manifests`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def _render(path: Path) -> str:
    import yaml

    from rawmm.config import UniqueKeyLoader, yaml_error_line
    from rawmm_operator.catalogue import build_children
    from rawmm_operator.objects import run_ref
    from rawmm_operator.spec import InvalidSpec, parse_spec

    try:
        body = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise CliError(yaml_error_line(path, exc)) from None
    if not isinstance(body, dict) or body.get("kind") != "RLRun":
        raise CliError(f"{path}: not an RLRun manifest")
    # What the API server guarantees the operator: a metadata mapping, string name and namespace, string labels.
    meta = body.get("metadata") or {}
    labels = (meta.get("labels") or {}) if isinstance(meta, dict) else None
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("name", ""), str)
        and isinstance(meta.get("namespace", "default"), str)
        and isinstance(labels, dict)
        and all(isinstance(value, str) for value in labels.values())
    ):
        raise CliError(f"{path}: metadata must be a mapping with a string name, namespace and labels")
    name = meta.get("name", "")
    try:
        spec = parse_spec(name, body.get("spec"))
    except InvalidSpec as exc:
        raise CliError(f"{path}: {exc}") from None
    run = run_ref(
        {**meta, "name": name}, namespace=meta.get("namespace", "default"), uid="<uid of the RLRun>"
    )
    return yaml.safe_dump_all(build_children(run, spec), sort_keys=False)
