"""``stofc.load(DIR, cuda_graph=True)``: ONNX Runtime's CUDA graph, checked before it is asked.

ORT captures a model into one CUDA graph (provider option ``enable_cuda_graph`` of the
CUDA EP) only when every compute node runs on the CUDA EP: a node on the CPU EP needs
copies between host and device inside the run, and ORT then refuses the session with a
message that names no node. So before asking, :func:`check_capturable` walks the
package's ``model.onnx`` and names the first node the CUDA EP has no kernel for
(ONNX Runtime's own kernel registry, ``get_all_opkernel_def``: op, domain and opset
version; the ``ai.stofc`` ops have their CUDA twins in ``libstofc_ort.so``) or the
first control-flow node (``If``, ``Loop``, ``Scan``: ORT never captures those). What
the registry cannot tell (an element type the CUDA kernel lacks, ORT's own placement of
shape computations) ORT still checks when the session is created; its refusal becomes a
one-line :class:`~stofc.errors.StofcError` too (:func:`refusal`).

A captured graph replays on the addresses it was captured with: the caller binds every
input and output with IOBinding to buffers that stay put (``OrtValue``s on ``cuda:0``),
updates inputs in place (``OrtValue.update_inplace``), and keeps one shape per session
(ORT captures at the second run and replays from the third; another shape needs another
session). :func:`stofc.package.bench.time_graph` is such a loop.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from stofc.errors import StofcError

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
STOFC_DOMAIN = "ai.stofc"
CONTROL_FLOW = ("If", "Loop", "Scan")
FIX = ("load it without cuda_graph=True (a plain CUDA EP session), or compile the model so "
       "that ONNX Runtime's CUDA EP runs every node")


@dataclass(frozen=True)
class KernelRange:
    """One CUDA kernel registration: ``op`` of ``domain`` ("" = ai.onnx) for opsets
    ``since..until`` (inclusive)."""

    domain: str
    op: str
    since: int
    until: int


_TABLE_SCRIPT = """
import json
from onnxruntime.capi import _pybind_state as capi
print(json.dumps([[k.domain, k.op_name, *k.version_range] for k in capi.get_all_opkernel_def()
                  if k.provider == "CUDAExecutionProvider"]))
"""


@functools.lru_cache(maxsize=1)
def cuda_kernels() -> tuple[KernelRange, ...] | None:
    """The CUDA EP's kernel registrations of the installed ONNX Runtime (empty without
    one), or None when they cannot be read.

    ORT's ``get_all_opkernel_def`` loads every provider library of the wheel; where one
    cannot load (the TensorRT EP without libnvinfer) the process crashed on the H100, so
    the table is read in a child process: a child that fails leaves the check to ORT.
    """
    try:
        done = subprocess.run([sys.executable, "-c", _TABLE_SCRIPT], capture_output=True,
                              text=True, timeout=120, check=False)
        rows = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        rows = None
    if rows is None:
        return None
    return tuple(KernelRange(_domain(d), op, int(since), int(until))
                 for d, op, since, until in rows)


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def graph_providers(providers: Sequence[Any] | None) -> list[Any]:
    """``providers`` with ``enable_cuda_graph`` on the CUDA EP (its other options kept);
    default CUDA then CPU. A list without the CUDA EP is refused."""
    asked = list(providers) if providers is not None else [CUDA_EP, CPU_EP]
    out: list[Any] = []
    found = False
    for p in asked:
        name, options = (p[0], dict(p[1])) if isinstance(p, tuple) else (str(p), {})
        if name == CUDA_EP:
            found = True
            options["enable_cuda_graph"] = "1"
            out.append((name, options))
        else:
            out.append(p)
    if not found:
        names = ", ".join(p[0] if isinstance(p, tuple) else str(p) for p in asked) or "none"
        raise StofcError(f"cuda_graph=True needs the CUDA execution provider, and the providers "
                         f"given are {names}",
                         hint="add 'CUDAExecutionProvider' (or leave providers out), or load "
                              "without cuda_graph=True")
    return out


def _opset(model: Any, domain: str) -> int | None:
    for imp in model.opset_import:
        if _domain(imp.domain) == domain:
            return int(imp.version)
    return None


def uncapturable_node(model: Any, kernels: Iterable[KernelRange]) -> str | None:
    """Why ``model`` (an ``onnx.ModelProto``) cannot run wholly on the CUDA EP: the first
    node in graph order with no CUDA kernel, or of a control-flow op; None when none."""
    table: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for k in kernels:
        table.setdefault((k.domain, k.op), []).append((k.since, k.until))
    for index, node in enumerate(model.graph.node):
        name = node.name or f"#{index}"
        domain = _domain(node.domain)
        if domain == STOFC_DOMAIN:
            continue  # the package's library registers a CUDA twin of every ai.stofc op
        if node.op_type in CONTROL_FLOW and domain == "":
            return (f"node {name!r} is a {node.op_type} (control flow), which ONNX Runtime "
                    "never captures in a CUDA graph")
        ranges = table.get((domain, node.op_type))
        opset = _opset(model, domain)
        label = f"{domain}.{node.op_type}" if domain else node.op_type
        if not ranges:
            return (f"node {name!r} ({label}) has no CUDA kernel in this ONNX Runtime, so it "
                    "would run on the CPU EP")
        if opset is not None and not any(lo <= opset <= hi for lo, hi in ranges):
            return (f"node {name!r} ({label}, opset {opset}) has no CUDA kernel for that opset "
                    "in this ONNX Runtime, so it would run on the CPU EP")
    return None


def check_capturable(model_path: str | Path,
                     kernels: Callable[[], Iterable[KernelRange] | None] | None = None) -> None:
    """A one-line StofcError naming the node that keeps ``model_path`` off a CUDA graph
    (``kernels``: the CUDA kernel table, default :func:`cuda_kernels`; a table that cannot
    be read skips this check, and ORT's own refusal at session creation still applies)."""
    table = (kernels or cuda_kernels)()
    if table is None:
        return
    model = onnx.load(str(model_path), load_external_data=False)
    problem = uncapturable_node(model, table)
    if problem is not None:
        raise StofcError(f"cuda_graph=True: {problem}, and ONNX Runtime captures a CUDA graph "
                         f"only when every node runs on the CUDA EP", hint=FIX)


def refusal(root: Path, err: BaseException) -> StofcError:
    """ORT's refusal of the CUDA-graph session as one line (what the registry could not
    tell: an element type, ORT's own placement)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return StofcError(f"ONNX Runtime would not capture package {root} in a CUDA graph: {first}",
                      hint=FIX)
