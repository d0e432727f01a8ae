"""Compilation of rendered sources with NVRTC (through CuPy), cached by content."""

from stofc.compile.nvrtc import CompiledKernel, compile_source, include_dirs, nvrtc_version

__all__ = ["CompiledKernel", "compile_source", "include_dirs", "nvrtc_version"]
