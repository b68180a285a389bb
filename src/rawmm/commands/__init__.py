"""Subcommands of the `rawmm` CLI; each module exposes `add_arguments(parser)` and `run(args) -> int`."""
