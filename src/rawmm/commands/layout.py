"""``rawmm layout --preset P WxH``: the placeholder layout of image sizes, from the layout math alone."""

from __future__ import annotations

import argparse
import json
import re

from rawmm.commands import CliError
from rawmm.commands.ingest import add_model_arguments, resolve_model

_SIZE_RE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


def parse_size(text: str) -> tuple[int, int]:
    match = _SIZE_RE.fullmatch(text.strip().lower())
    if match is None:
        raise CliError(f"image size must look like WIDTHxHEIGHT (e.g. 1920x1080), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sizes", nargs="+", metavar="WxH", help="image sizes, e.g. 1920x1080")
    add_model_arguments(parser, required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object per size")


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(text) for text in args.sizes]
    resolved = resolve_model(args)
    assert resolved is not None  # --preset/--model is required
    family, config = resolved
    for width, height in sizes:
        try:
            layout = family.describe(width=width, height=height, config=config)
        except ValueError as exc:
            raise CliError(f"{width}x{height}: {exc}") from None
        if args.json:
            print(
                json.dumps(
                    {
                        "width": width,
                        "height": height,
                        "family": family.name,
                        "resized": {"height": layout.resized[0], "width": layout.resized[1]},
                        "grid_thw": list(layout.grid_thw),
                        "placeholder_tokens": layout.num_placeholder_tokens,
                        "vision_tokens": layout.num_vision_tokens,
                        "payload": family.payload(layout),
                    }
                )
            )
        else:
            resized_h, resized_w = layout.resized
            print(
                f"{width}x{height} -> resized {resized_w}x{resized_h}, grid {list(layout.grid_thw)}, "
                f"{layout.num_placeholder_tokens} placeholder tokens, {layout.num_vision_tokens} vision tokens"
            )
    return 0
