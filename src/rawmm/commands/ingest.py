"""``rawmm ingest``: offload image files or folders into the store and print one JSON line per image.

All or nothing: every file is fully decoded first (the decoder the engines use, so a truncated PNG or a
decompression bomb never enters the store) and, with a model, laid out; if any file fails, each failure
is listed on stderr, nothing is written and the exit status is 2. A reader that closes the output early
(``rawmm ingest … | head``) ends the ingest quietly with status 141, as a program killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rawmm.commands import CliError

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})


def add_model_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """``--preset`` / ``--model`` (mutually exclusive) and ``--backend``, shared with ``rawmm layout``."""
    from rawmm.contract.families import BACKENDS, PRESETS

    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--preset", help=f"model preset: {', '.join(PRESETS)}")
    group.add_argument(
        "--model", type=Path, metavar="DIR", help="checkpoint directory (its preprocessor config)"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="image-processor backend (fingerprint); default: the one vLLM's own image path runs for the "
        "model's family (torchvision for Qwen-VL, pil for Kimi K2.5), as `rawmm serve` and the run config",
    )


def resolve_model(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """(family, config) from ``--preset`` or ``--model``; None when neither was given."""
    from rawmm.contract import detect_family, resolve_preset

    try:
        if args.preset is not None:
            return resolve_preset(args.preset)
        if args.model is not None:
            family = detect_family(args.model)
            return family, family.config_from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="image files or folders (recursive)"
    )
    parser.add_argument("--offload-root", type=Path, required=True, metavar="DIR", help="offload store root")
    add_model_arguments(parser, required=False)


def image_files(paths: list[Path]) -> Iterator[Path]:
    """Named files as given; folders walked recursively (sorted) for files with image suffixes."""
    for path in paths:
        if path.is_dir():
            yield from (
                p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            )
        elif path.is_file():
            yield path
        else:
            raise CliError(f"{path}: no such file or directory")


def check_files(files: list[Path], model: tuple[Any, Any] | None) -> list[str]:
    """One line per file that cannot be ingested: unreadable, not fully decodable, too large, no layout."""
    from rawmm.contract import InvalidImageRef
    from rawmm.materialize.decode import DEFAULT_MAX_IMAGE_PIXELS, decode_image

    problems = []
    for file in files:
        try:
            image = decode_image(file.read_bytes(), max_pixels=DEFAULT_MAX_IMAGE_PIXELS, source=str(file))
            if model is not None:
                family, config = model
                family.describe(width=image.width, height=image.height, config=config)
        except InvalidImageRef as exc:  # decode_error or image_too_large; the message names the file
            problems.append(exc.message)
        except OSError as exc:
            problems.append(f"{file}: cannot read: {exc.strerror or exc}")
        except ValueError as exc:
            problems.append(f"{file}: {exc}")
    return problems


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from rawmm.contract import ImageIngestError, OffloadStore, describe_stored_image, encode_ref

    model = resolve_model(args)
    files = list(image_files(args.paths))
    if not files:
        raise CliError("no image files found")
    problems = check_files(files, model)
    if len(files) == 1 and problems:
        raise CliError(problems[0])
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        raise CliError(f"{len(problems)} of {len(files)} files cannot be ingested; nothing was written")
    store = OffloadStore(args.offload_root)
    fingerprint = model[0].fingerprint(model[1], args.backend or model[0].default_backend) if model else None
    columns = (TextColumn("ingest"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    console = Console(stderr=True)
    try:
        with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
            for file in progress.track(files, description="ingest"):
                try:
                    stored = store.put(file)
                except ImageIngestError as exc:
                    raise CliError(str(exc)) from None
                line: dict[str, Any] = {
                    "source": str(file),
                    "uri": stored.uri,
                    "sha256": stored.sha256,
                    "mm_hash": stored.mm_hash,
                    "width": stored.width,
                    "height": stored.height,
                }
                if model is not None:
                    family, config = model
                    descriptor, layout = describe_stored_image(
                        family, config, stored, fingerprint=fingerprint
                    )
                    line["placeholder_tokens"] = layout.num_placeholder_tokens
                    line["ref"] = encode_ref(descriptor, stored.mm_hash)
                print(json.dumps(line), flush=True)
    except BrokenPipeError:
        # The reader is gone: nothing more to say, and no flush of stdout at exit may raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0
