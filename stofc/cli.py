"""The ``stofc`` command line: argument parsing only.

Each command lives in ``stofc.commands.<name>`` and calls the pipeline or a
stage; this module assembles the group. Every way a command can end is turned
into one line on stderr and an exit code by :func:`stofc.errorreport.report`
(user errors, file-system faults and click's usage errors: exit 2; a bug:
exit 1 with the traceback saved for the report). SIGTERM and SIGHUP raise
inside the command, so its cleanup runs. ``STOFC_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from stofc.errorreport import report, signals_as_exceptions
from stofc.version import __version__

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
    """A click group whose every ending is one line and an exit code (stofc.errorreport)."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        given = sys.argv[1:] if args is None else list(args)
        bad = next((i for i, a in enumerate(given) if isinstance(a, str) and "\0" in a), None)
        if bad is not None:  # no shell passes one; an API caller might
            click.echo(f"error: argument {bad + 1} contains a NUL byte; remove it", err=True)
            sys.exit(2)
        with signals_as_exceptions():
            try:
                result = super().main(args, prog_name, complete_var, False, **extra)
            except SystemExit:
                raise
            except BaseException as exc:
                sys.exit(report(exc))
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stofc")
def main() -> None:
    """Compile and tune sparse transformer inference for NVIDIA GPUs."""


for _module, _attr in COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))
