"""``rawmm tiny-model``: write a tiny random-weight checkpoint (model, tokenizer, processor) to a folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from rawmm.commands import CliError
from rawmm.run.tiny import TINY_PRESETS  # imports transformers only inside its builders: --help stays fast


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, choices=TINY_PRESETS)
    parser.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="checkpoint directory to write"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="image processor max_pixels (default: 256 placeholder tokens' worth, to keep demos fast)",
    )
    parser.add_argument(
        "--gpu-shape",
        action="store_true",
        help="attention head_dim 128 for GPU attention kernels (default: 32, which vLLM's CPU attention takes)",
    )


def run(args: argparse.Namespace) -> int:
    from rawmm.run.tiny import build_tiny_model

    try:
        out = build_tiny_model(
            args.preset, args.out, seed=args.seed, max_pixels=args.max_pixels, gpu_shape=args.gpu_shape
        )
    except (OSError, ValueError) as exc:
        raise CliError(str(exc)) from None
    size = sum(path.stat().st_size for path in out.iterdir())
    print(f"wrote tiny {args.preset} checkpoint to {out} ({size / 1e6:.2f} MB)")
    return 0
