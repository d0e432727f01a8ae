"""How the ``stofc`` command line ends: one line on stderr and an exit code, for every fault.

The policy (README "Guarantees"):

==============================================  =====  ==========================================
what happened                                   exit   what is printed
==============================================  =====  ==========================================
success                                         0      the command's output
``stofc verify`` found a mismatch               1      the report, then ``verify failed: ...``
a :class:`~stofc.errors.StofcError`             2      ``error: <problem>; <fix>``
a usage error click found (bad option, value)   2      ``error: <problem>; see 'stofc X --help'``
an :class:`OSError` (read-only, disk full ...)  2      ``error: cannot ...: <reason> (<path>); <fix>``
out of memory (``MemoryError``)                 2      ``error: out of memory ...; <fix>``
Ctrl-C / SIGTERM / SIGHUP                       130,   ``error: interrupted`` (temporary files
                                                143,   are removed on the way out)
                                                129
anything else: a bug in stofc                   1      ``error: internal error ... this is a stofc
                                                       bug``, with the traceback saved to a file
                                                       to attach to the report
==============================================  =====  ==========================================

``STOFC_DEBUG=1`` re-raises instead, so the traceback is printed as Python would.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import click

from stofc.errors import StofcError
from stofc.fsutil import os_error
from stofc.version import __version__

BUG_EXIT = 1
REPORT_TO = "the stofc maintainers (an issue in the stofc repository)"


class Terminated(BaseException):
    """Raised in the main thread when stofc receives SIGTERM or SIGHUP, so that every
    ``finally`` and ``except BaseException`` cleanup runs (temporary directories go)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Terminated` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _echo(text: str) -> None:
    click.echo(" ".join(text.split()) if "\n" in text else text, err=True)


def _first_lower(text: str) -> str:
    text = " ".join(text.split()).rstrip(".")
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def _crash_file(exc: BaseException) -> str | None:
    """Write the traceback of ``exc`` to a file for the bug report; its path, or None."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"stofc-crash-{time.strftime('%Y%m%d-%H%M%S')}-",
                                    suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"stofc command: {' '.join(sys.argv)}\n")
            f.write(f"stofc {__version__}, Python {sys.version.split()[0]}\n\n")
            f.write("".join(traceback.format_exception(exc)))
        return path
    except OSError:
        return None


def report(exc: BaseException) -> int:
    """Print the one line for ``exc`` (see the module doc); return the exit code.

    ``SystemExit`` is re-raised (a command chose its exit code).
    """
    if isinstance(exc, SystemExit):
        raise exc
    debug = bool(os.environ.get("STOFC_DEBUG"))
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())
    if no_args and isinstance(exc, no_args) and exc.ctx is not None:
        click.echo(exc.ctx.get_help())  # `stofc` or `stofc mask` alone: the help, as asked
        return 0
    if isinstance(exc, click.exceptions.UsageError):
        ctx = exc.ctx
        where = f"see '{ctx.command_path} --help'" if ctx is not None else "see 'stofc --help'"
        _echo(f"error: {_first_lower(exc.format_message())}; {where}")
        return 2
    if isinstance(exc, click.ClickException):
        _echo(f"error: {_first_lower(exc.format_message())}")
        return exc.exit_code if exc.exit_code else 2
    if isinstance(exc, (click.exceptions.Abort, KeyboardInterrupt)):
        _echo("error: interrupted; nothing was left half-written")
        return 130
    if isinstance(exc, Terminated):
        name = signal.Signals(exc.signum).name
        _echo(f"error: stopped by {name}; nothing was left half-written")
        return 128 + exc.signum
    if debug:
        raise exc
    if isinstance(exc, StofcError):
        _echo(f"error: {exc}")
        return exc.exit_code
    if isinstance(exc, OSError):
        _echo(f"error: {os_error(exc)}")
        return 2
    if isinstance(exc, ValueError) and "embedded null byte" in str(exc):
        _echo("error: a path or name contains a NUL byte; remove it")
        return 2
    if isinstance(exc, MemoryError):
        _echo(f"error: out of memory ({type(exc).__name__}: {str(exc)[:200]}); ask for less "
              "(a shorter --seq-len / --max-seq-len, fewer heads) or run on a machine with "
              "more memory")
        return 2
    crash = _crash_file(exc)
    saved = f"the traceback is in {crash}" if crash else "rerun with STOFC_DEBUG=1 to see it"
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    _echo(f"error: internal error ({type(exc).__name__}{': ' + first if first else ''}); "
          f"this is a stofc bug: please report it to {REPORT_TO} with the command you ran; "
          f"{saved}")
    return BUG_EXIT
