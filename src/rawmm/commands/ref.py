"""``rawmm ref inspect REF``: parse a raw image ref and show what it says (and, given a root, check it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rawmm.commands import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    inspect = sub.add_parser("inspect", help="parse a ref and print its fields as JSON")
    inspect.add_argument("ref", metavar="REF", help="an mmraw: ref, or - to read one from stdin")
    inspect.add_argument(
        "--offload-root",
        type=Path,
        metavar="DIR",
        help="also resolve the image under DIR and verify its hash",
    )


def run(args: argparse.Namespace) -> int:
    from rawmm.contract import InvalidImageRef, OffloadStore, get_family, parse_ref

    text = sys.stdin.read().strip() if args.ref == "-" else args.ref
    try:
        ref = parse_ref(text)
        report: dict[str, Any] = {
            "family": ref.family,
            "modality": ref.modality,
            "engine_modality": ref.descriptor().engine_modality,
            "mm_hash": ref.mm_hash,
            "fingerprint": ref.fingerprint,
            "raw_image_uri": ref.raw_image_uri,
            "payload": ref.payload,
            "grid_thw": list(get_family(ref.family).grid_from_payload(ref.payload)),
        }
        if args.offload_root is not None:
            store = OffloadStore(args.offload_root)
            report["path"] = str(store.resolve(ref.raw_image_uri))
            report["bytes_verified"] = len(store.read_verified(ref.raw_image_uri, ref.mm_hash))
    except InvalidImageRef as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(report, indent=2))
    return 0
