"""Child processes that never outlive stofc: the C++ compiler runs under a small reaper.

Why: ``g++`` is a driver that starts ``cc1plus``, ``as`` and ``ld``. If stofc
is killed (``kill -9``, an OOM kill), its children are re-parented and keep
running, writing into a build directory nobody will clean. Killing ``g++``
alone is not enough either: its own children survive it.

How (Linux): each command runs under a reaper, a few lines of Python run with
``python -c`` (no import of stofc):

1. the reaper asks the kernel for ``SIGTERM`` when its parent (stofc) dies
   (``prctl(PR_SET_PDEATHSIG)``), then checks that stofc is still its parent
   (closing the race with a death before the ``prctl``);
2. it starts the command in a new process group, which the compiler's own
   children inherit, with those three signals blocked until the command is recorded
   (a stop that arrived between the fork and ``Popen``'s return found no command to
   kill and left it running: a compiler outlived a ``kill -9``ed stofc in CI under
   load); the command itself starts with them unblocked;
3. on ``SIGTERM``, ``SIGINT`` or ``SIGHUP`` it kills that whole group with
   ``SIGKILL`` and exits.

stofc starts every reaper from the calling thread (the death signal follows
the thread that forked, so no pool thread may start one) and, when it stops
early itself (an error, Ctrl-C, SIGTERM), sends each running reaper
``SIGTERM`` and waits for it. So however stofc ends, no compiler process is
left. Elsewhere than Linux the reaper only forwards the stop (no death signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REAPER = r"""
import ctypes, os, signal, subprocess, sys, time
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
child = None
def stop(signum, frame):
    if child is not None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(128 + signum)
for s in STOPS:
    signal.signal(s, stop)
signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # a stop waits until the child is known
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != int(os.environ["STOFC_REAPER_PARENT"]):
        os._exit(143)  # stofc died before the prctl
def start():
    os.setpgrp()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
try:
    started = subprocess.Popen(sys.argv[1:], preexec_fn=start)
except OSError as err:
    print(f"cannot run {sys.argv[1]}: {err.strerror}", file=sys.stderr)
    os._exit(127)
time.sleep(float(os.environ.get("STOFC_REAPER_HOLD_S", "0")))  # tests: widen the window
child = started
signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # a stop that came meanwhile runs now
code = child.wait()
os._exit(code if code >= 0 else 128 - code)
"""
# STOFC_REAPER_HOLD_S (tests only): seconds the reaper waits between starting the command
# and recording it, the window in which a stop used to leave the command running
POLL_S = 0.02


@dataclass(frozen=True)
class Finished:
    """One finished command: its exit code and what it wrote (stdout and stderr)."""

    command: tuple[str, ...]
    returncode: int
    output: str


class Timeout(Exception):
    """A command ran longer than its limit (it was stopped)."""

    def __init__(self, command: tuple[str, ...], seconds: float) -> None:
        super().__init__(f"{command[0]} ran longer than {seconds:g} s")
        self.command, self.seconds = command, seconds


def _start(command: tuple[str, ...], log: Path) -> subprocess.Popen:
    env = dict(os.environ, STOFC_REAPER_PARENT=str(os.getpid()))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", REAPER, *command], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _reap(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``proc`` to exit, reaping it with ``os.waitpid`` itself;
    True once it has exited. Not ``Popen.wait``: Popen guards its own waits with a lock that
    ``poll`` takes without blocking, and a stop raised as an exception (stofc turns SIGTERM
    into one) between that acquire and its ``try`` leaves the lock held for good. Every later
    ``Popen.wait`` on that process then blocks for ever (CI, 2026-11-28: ``stofc ortlib``
    hung after a SIGTERM, its main thread in ``Popen.wait`` under ``_stop``)."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (by Popen's own poll): it has exited
            return True
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _stop(proc: subprocess.Popen) -> None:
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)  # the reaper kills its compiler's process group
    if not _reap(proc, 5.0):
        proc.kill()
        _reap(proc, 5.0)


def run_all(commands: list[tuple[str, ...]], work: Path, *, jobs: int,
            timeout_s: float) -> list[Finished]:
    """Run ``commands`` (at most ``jobs`` at once, each under a reaper, logs in ``work``);
    return them in order once all have finished. Any exception (Ctrl-C, SIGTERM raised as
    an exception, :class:`Timeout`) stops every running command first."""
    pending = list(enumerate(commands))
    running: dict[int, tuple[subprocess.Popen, float, Path]] = {}
    done: dict[int, Finished] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, jobs):
                i, command = pending.pop(0)
                log = work / f".job-{i}.log"
                running[i] = (_start(command, log), time.monotonic(), log)
            for i, (proc, started, log) in list(running.items()):
                code = proc.poll()
                if code is None:
                    if time.monotonic() - started > timeout_s:
                        raise Timeout(commands[i], timeout_s)
                    continue
                done[i] = Finished(commands[i], code, log.read_text(errors="replace"))
                log.unlink(missing_ok=True)
                del running[i]
            if running:
                time.sleep(POLL_S)
    finally:
        for proc, _, _ in running.values():
            _stop(proc)
    return [done[i] for i in range(len(commands))]
