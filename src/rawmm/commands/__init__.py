"""The `rawmm` subcommands, one module each (dispatched by `rawmm.cli`), and the error they report."""


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""
