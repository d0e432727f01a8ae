"""Compile a device function of stofc's CUDA headers for the host, to test it exhaustively.

Header functions that are plain integer logic (``trim_walk``, ``ws_work_index``) are cut
out of their header as written, their ``__device__ __forceinline__`` made ``static
inline``, pasted into a C++ harness and built with the host compiler (skipped without one).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda" / "stofc"


def header_function(header: str, signature: str) -> str:
    """The function of ``cuda/stofc/<header>`` that starts with ``signature`` (through its
    closing brace at column 0), as host C++."""
    text = (CUDA_DIR / header).read_text()
    start = text.index(f"__device__ __forceinline__ {signature}")
    end = text.index("\n}\n", start) + 3
    return text[start:end].replace("__device__ __forceinline__", "static inline")


def build(source: str, where: Path, name: str) -> Path:
    """Compile the C++ ``source`` into the executable ``where/name``."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = where / f"{name}.cc", where / name
    src.write_text(source)
    subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    return exe
