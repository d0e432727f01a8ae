"""stofc.runtime: compiled kernels on the GPU through CuPy.

* :class:`~stofc.runtime.attention.AttentionOp` - sparse attention for one mask format,
  kernel config, dtype and head_dim: ``op.run(q, k, v, ...)`` (checks + launch) or
  ``op.bind(q, k, v, out, ...)`` -> :class:`~stofc.runtime.module.BoundLaunch` whose
  ``launch(stream)`` is a single driver call (timing, tuner, graphs).
* :func:`~stofc.runtime.module.load_kernel` - cubin -> cached CuPy module function.

Importing this package does not import CuPy; the submodules do when used.
"""
