"""Render and compile the attention templates (logic-free: every value comes from here).

The family of a spec's config says which template renders it, which ``extern "C"``
kernels the source defines (a form may add one, e.g. the warp-specialised kernel's
combine kernel) and every value the template substitutes
(:meth:`~stofc.kernels.attention.family.AttentionFamily.template_values`); the
values every attention template shares are :func:`common_values`.
"""

from __future__ import annotations

from typing import Any

from stofc.codegen import Source, render
from stofc.compile import CompiledKernel, compile_source
from stofc.kernels.attention.config import (
    DTYPES,
    KernelSpec,
    attention_family,
    check_dtype,
    check_head_dim,
)

# -lineinfo costs nothing at run time and lets ncu map stalls to source lines.
COMPILE_OPTIONS: tuple[str, ...] = ("-lineinfo",)
FLAG = {True: "true", False: "false"}


def common_values(spec: KernelSpec) -> dict[str, Any]:
    """The values every attention template takes: name, types, shape, the input flags."""
    return {"kernel_name": spec.name, "dtype": DTYPES[spec.dtype], "head_dim": spec.head_dim,
            "has_bias": FLAG[spec.has_bias], "has_key_bits": FLAG[spec.has_key_bits],
            "has_softcap": FLAG[spec.has_softcap]}


def render_kernel(spec: KernelSpec) -> Source:
    """The CUDA source of ``spec`` (its main kernel named ``spec.name``)."""
    check_head_dim(spec.head_dim)
    check_dtype(spec.dtype)
    fam = attention_family(spec.config.kind)       # an unknown kind is a StofcError
    return render(spec.template, spec.name, fam.entry_points(spec),
                  **fam.template_values(spec))


def compile_kernel(spec: KernelSpec, target: str) -> CompiledKernel:
    """Render ``spec`` and compile it for the GPU ``target`` (``sm_90``, ...); cached by content.

    The family picks the NVRTC target (a wgmma spec compiles for ``sm_90a``) and options.
    """
    fam = attention_family(spec.config.kind)
    return compile_source(render_kernel(spec), fam.target_for(spec.config, target),
                          options=fam.compile_options)
