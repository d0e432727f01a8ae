"""stofc: a compiler and auto-tuner for sparse transformer inference on NVIDIA GPUs.

The pipeline (see README.md and ``stofc.pipeline``) reads an ONNX model and a
mask spec, builds a fusion plan, renders and compiles CUDA kernels, tunes them
on the target GPU and writes a deployable ONNX Runtime package.
``stofc.load(DIR)`` checks a package and returns an ONNX Runtime session
(:func:`stofc.package.load.load`).
"""

from stofc.package.load import load
from stofc.version import __version__

__all__ = ["__version__", "load"]
