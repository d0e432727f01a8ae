"""Packages of ``bench/e2e_long.py`` compiled in parallel, each by ``python -m stofc compile``.

A model's masks compile at the same time in separate processes (the CPU-heavy part of a
long-context compile: reading the model's own mask at L_max, NVRTC, the CPU check), while
the main process builds ORT's optimized model. The ONNX Runtime custom-op library is built
once first (:func:`prewarm_library`, in a thread beside the export), so the compiles take
it from stofc's cache instead of building it three times. A compile still running when the
time left falls below the reserve is killed and recorded: a killed compile leaves no
package (stofc writes to a temporary directory and renames).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


def prewarm_library() -> threading.Thread:
    """Build (or find in the cache) the custom-op library in a daemon thread."""

    def build():
        try:
            from stofc.package.ortlib import build_library

            with tempfile.TemporaryDirectory() as tmp:
                build_library(tmp)
        except Exception as err:  # the compiles then build it themselves
            print(f"library prewarm failed: {type(err).__name__}: {err}", flush=True)

    thread = threading.Thread(target=build, name="stofc-ortlib", daemon=True)
    thread.start()
    return thread


@dataclass
class Compile:
    """One running ``stofc compile``."""

    mask: str
    out: Path
    proc: subprocess.Popen
    log: Path
    start: float = field(default_factory=time.time)
    end: float | None = None        # set by a watcher thread when the process exits

    def __post_init__(self) -> None:
        def watch():
            self.proc.wait()
            self.end = time.time()

        threading.Thread(target=watch, daemon=True).start()


def package_dir(work: Path, mask: str, max_seq_len: int) -> Path:
    """Where a mask's package for this L_max lives (a warm work dir keeps it)."""
    return work / f"pkg-{mask}-L{max_seq_len}"


def start_compiles(src: Path, masks: dict[str, str], work: Path, *, gpu: str, dtype: str,
                   max_seq_len: int) -> list[Compile]:
    """Start one ``stofc compile`` per mask whose package is not in ``work`` yet."""
    running = []
    for mask, spec in masks.items():
        out = package_dir(work, mask, max_seq_len)
        if (out / "manifest.json").exists():
            continue
        log = work / f"compile-{mask}.log"
        cmd = [sys.executable, "-m", "stofc", "compile", str(src), "--mask", spec, "--gpu", gpu,
               "--dtype", dtype, "--max-seq-len", str(max_seq_len), "-o", str(out), "--quiet"]
        with log.open("w") as f:
            running.append(Compile(mask, out, subprocess.Popen(cmd, stdout=f, stderr=f), log))
    return running


def wait_compiles(running: list[Compile], left, reserve: float) -> dict[str, tuple[str, str]]:
    """Wait for the compiles; mask -> ("ok", seconds) | ("error", last line) | ("killed", why).

    ``left()`` is the time left in the run; compiles still running when it falls below
    ``reserve`` seconds are killed.
    """
    while any(c.proc.poll() is None for c in running) and left() > reserve:
        time.sleep(0.5)
    results: dict[str, tuple[str, str]] = {}
    for c in running:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
            results[c.mask] = ("killed", f"compile still running after {time.time() - c.start:.0f}"
                               f" s with {left():.0f} s left (reserve {reserve:.0f} s); killed")
        elif c.proc.returncode != 0:
            lines = [ln for ln in c.log.read_text(errors="replace").splitlines() if ln.strip()]
            results[c.mask] = ("error", (lines[-1] if lines else f"exit {c.proc.returncode}")[:600])
        else:
            while c.end is None:  # the watcher sets it right after the exit
                time.sleep(0.01)
            results[c.mask] = ("ok", f"{c.end - c.start:.1f}")
    return results
