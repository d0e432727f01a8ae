"""stofc: a compiler and auto-tuner for sparse transformer inference on NVIDIA GPUs.

The pipeline (see README.md and ``stofc.pipeline``) reads an ONNX model and a
mask spec, builds a fusion plan, renders and compiles CUDA kernels, tunes them
on the target GPU and writes a deployable ONNX Runtime package.
"""

__version__ = "0.1.0"


def load(path, providers=None):
    """Check the package in ``path`` and return an ``onnxruntime.InferenceSession`` (see
    :func:`stofc.package.load.load`)."""
    from stofc.package.load import load as _load

    return _load(path, providers)
