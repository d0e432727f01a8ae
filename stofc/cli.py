"""The ``stofc`` command line: argument parsing only.

Each command lives in ``stofc.commands.<name>`` and calls the pipeline or a
stage; this module assembles the group and turns a :class:`StofcError` into one
line on stderr and exit code 2 (no traceback). ``STOFC_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from stofc import __version__
from stofc.errors import StofcError

# (module, attribute) of every top-level command, in the order `--help` lists them.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("stofc.commands.tune", "tune"),
    ("stofc.commands.cache", "cache"),
    ("stofc.commands.mask", "mask"),
    ("stofc.commands.inspect", "inspect"),
    ("stofc.commands.ortlib", "ortlib"),
    ("stofc.commands.compile", "compile_command"),
    ("stofc.commands.verify", "verify"),
    ("stofc.commands.bench", "bench"),
)


class _Group(click.Group):
    """A click group that reports user errors in one line with exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except StofcError as err:
            if os.environ.get("STOFC_DEBUG"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(err.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stofc")
def main() -> None:
    """Compile and tune sparse transformer inference for NVIDIA GPUs."""


for _module, _attr in COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))
