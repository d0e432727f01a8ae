"""Render and compile the attention templates (logic-free: every value comes from here)."""

from __future__ import annotations

from stofc.codegen import Source, render
from stofc.compile import CompiledKernel, compile_source
from stofc.errors import StofcError
from stofc.kernels.attention.config import (
    DTYPES,
    KINDS,
    KernelSpec,
    check_dtype,
    check_head_dim,
    kernel_target,
)
from stofc.kernels.attention.ws import MAX_CHUNKS, ws_q_in_regs, ws_reg_split

# -lineinfo costs nothing at run time and lets ncu map stalls to source lines.
COMPILE_OPTIONS: tuple[str, ...] = ("-lineinfo",)


def render_kernel(spec: KernelSpec) -> Source:
    """The CUDA source of ``spec`` (one ``extern "C"`` kernel named ``spec.name``)."""
    check_head_dim(spec.head_dim)
    check_dtype(spec.dtype)
    c = spec.config
    if c.kind not in KINDS:
        raise StofcError(f"unknown attention kernel {c.kind!r}", hint="use 'block', 'row' or 'ws'")
    if c.kind == "ws":
        return render(spec.template, spec.name, (spec.name, f"{spec.name}_combine"),
                      **ws_template_values(spec))
    return render(
        spec.template, spec.name, (spec.name,),
        kernel_name=spec.name,
        dtype=DTYPES[spec.dtype],
        head_dim=spec.head_dim,
        tile=c.tile,
        warp_m=c.warp_m,
        warps=c.warps,
        stages=c.stages,
        q_split=c.q_split,
        min_blocks=c.min_blocks,
        has_bias="true" if spec.has_bias else "false",
        has_key_bits="true" if spec.has_key_bits else "false",
        has_softcap="true" if spec.has_softcap else "false",
        q_in_regs="true" if spec.q_in_regs else "false",
    )


def ws_template_values(spec: KernelSpec) -> dict[str, object]:
    """Every value ``block_ws.cu.j2`` substitutes, for a ``kind="ws"`` spec."""
    c = spec.config
    producer, consumer = ws_reg_split(c.kstep)
    flag = {True: "true", False: "false"}
    return dict(kernel_name=spec.name, dtype=DTYPES[spec.dtype], head_dim=spec.head_dim,
                stages=c.stages, pingpong=flag[c.pingpong], kstep=c.kstep,
                producer_regs=producer, consumer_regs=consumer, max_chunks=MAX_CHUNKS,
                has_bias=flag[spec.has_bias], has_key_bits=flag[spec.has_key_bits],
                has_softcap=flag[spec.has_softcap],
                q_in_regs=flag[ws_q_in_regs(spec.head_dim, c.kstep)])


def compile_kernel(spec: KernelSpec, target: str) -> CompiledKernel:
    """Render ``spec`` and compile it for the GPU ``target`` (``sm_90``, ...); cached by content.

    A wgmma spec compiles for the arch-specific variant (``sm_90a``, :func:`kernel_target`).
    """
    return compile_source(render_kernel(spec), kernel_target(spec.config.mma, target),
                          options=COMPILE_OPTIONS)
