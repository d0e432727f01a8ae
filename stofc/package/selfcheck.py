"""``stofc compile``'s check: the package just written runs and computes the model.

Before a package is moved into place (:func:`stofc.package.destination.write_directory`),
:func:`check_package_runs` loads it from its temporary directory in ONNX Runtime's
CPU execution provider and runs it and ``stofc verify``'s reference (the original
model with the structured mask injected before every Softmax,
:func:`stofc.package.verify.reference_session`) on the same inputs: batch
``CHECK_BATCH`` (one sequence right-padded, as ``verify`` draws them), length
``min(L_max, CHECK_LEN)``; ``CHECK_LEN`` = 72 spans two 64-wide tiles, the last
one partial. The cost is the package's CPU twins at ``2 x 72`` tokens (the
reference runs in ONNX Runtime's own float32 kernels). Each output must be within ``verify``'s bound (relative to the
reference's largest magnitude, at real tokens).

A failure is a :class:`~stofc.errors.CheckError` (exit 2) and the temporary
directory is removed, so no package that does not run is ever written:

* ONNX Runtime cannot load or run the package: its message, which names the
  node and op (``SparseAttention node 'stofc/SparseAttention_4'``);
* an output is off: the check runs both again with every fused segment's output
  exposed (the package writes segment results under ``<value>::stofc_...`` names,
  the reference under ``<value>``) and names the first segment whose result is
  beyond the bound: its layer, family, ops and node.

``--no-check`` skips it. Cost (``bench/compile_check_time.py``, README): a fraction
of a second for the bundled example, seconds for BERT-base shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from stofc.errors import CheckError, PackageError, StofcError
from stofc.lower.emit import EmittedSegment
from stofc.package.layout import MODEL_FILE
from stofc.package.load import CPU_EP, load, session_options
from stofc.package.reference import inject_mask
from stofc.package.verify import (
    END_TO_END_BOUND,
    compare,
    make_inputs,
    output_errors,
    reference_session,
    run_session,
)
from stofc.package.writer import PackageContents

CHECK_BATCH = 2
CHECK_LEN = 72
SEED = 0
HINT = ("this is a stofc bug: please report it with the model and the command; "
        "--no-check writes the package anyway")
DIAGNOSE_MAX_BYTES = 1 << 30  # above this the model is not re-serialised to expose values


@dataclass(frozen=True)
class SegmentError:
    """The first fused segment whose result differs from the reference's."""

    layer: int
    ordinal: int
    family: str
    ops: tuple[str, ...]
    node: str
    value: str
    rel: float


def check_len(max_seq_len: int) -> int:
    """The length the check runs at."""
    return max(1, min(max_seq_len, CHECK_LEN))


def check_package_runs(package: Path, contents: PackageContents, *,
                       bound: float = END_TO_END_BOUND) -> None:
    """Run the package in ``package`` and the reference; raise CheckError unless they agree."""
    try:
        import onnxruntime  # noqa: F401  # optional: ONNX Runtime (the test/ort extras)
    except ImportError:
        raise CheckError("cannot check that the package runs: onnxruntime is not installed",
                         hint="pip install onnxruntime (or onnxruntime-gpu), or pass --no-check"
                         ) from None
    graph, formats = contents.graph, dict(contents.program.masks.formats)
    seq_len = check_len(contents.program.plan.max_seq_len)
    feeds, real = make_inputs(graph, CHECK_BATCH, seq_len, np.random.default_rng(SEED))
    try:
        session = load(package, providers=[CPU_EP],
                       session_options_hook=lambda o: setattr(o, "log_severity_level", 4))
    except PackageError as err:
        raise CheckError(f"the package does not load in ONNX Runtime ({err.message})",
                         hint=HINT) from None
    reference = reference_session(graph, formats, seq_len)
    names = [o.name for o in reference.get_outputs()]
    where = f"the package, batch {CHECK_BATCH}, length {seq_len}"
    try:
        ref_out = run_session(reference, names, feeds, "the reference", CHECK_BATCH, seq_len)
        pkg_out = run_session(session, names, feeds, "the package", CHECK_BATCH, seq_len)
    except StofcError as err:
        raise CheckError(f"checking {where} on the CPU EP: {err.message}", hint=HINT) from None
    errors = output_errors(names, pkg_out, ref_out, real, CHECK_BATCH, seq_len)
    bad = [e for e in errors if not e.rel <= bound]
    if not bad:
        return
    worst = max(bad, key=lambda e: e.rel if np.isfinite(e.rel) else np.inf)
    first = _first_bad_segment(package, contents.program.emitted,
                               reference_model_of(graph, formats, seq_len), feeds, real, bound)
    at = (f"; it first goes wrong at layer {first.layer}, segment {first.ordinal} "
          f"({first.family}: {' + '.join(first.ops)}, node {first.node}), whose result "
          f"{first.value} has relative error {first.rel:.3e}") if first else ""
    raise CheckError(f"the package does not compute the model: output {worst.output} has "
                     f"relative error {worst.rel:.3e} > {bound:g} against the reference at "
                     f"batch {CHECK_BATCH}, length {seq_len} on the CPU EP{at}", hint=HINT)


def reference_model_of(graph: Any, formats: dict, seq_len: int) -> onnx.ModelProto:
    """The reference model (the same one :func:`reference_session` runs)."""
    return inject_mask(graph, formats, size=seq_len)


def _first_bad_segment(package: Path, emitted: tuple[EmittedSegment, ...],
                       ref_model: onnx.ModelProto, feeds: dict[str, np.ndarray], real: np.ndarray,
                       bound: float) -> SegmentError | None:
    """Run both with every segment result exposed (the segments the package's nodes run,
    ``emitted``); the first one beyond ``bound``."""
    import onnxruntime as ort  # optional: ONNX Runtime (checked by check_package_runs)

    pkg_model = onnx.load(str(package / MODEL_FILE))
    if pkg_model.ByteSize() > DIAGNOSE_MAX_BYTES or ref_model.ByteSize() > DIAGNOSE_MAX_BYTES:
        return None
    produced = {o: n for n in pkg_model.graph.node for o in n.output}
    ref_values = {o for n in ref_model.graph.node for o in n.output}
    pairs: list[tuple[EmittedSegment, str, str, str]] = []  # (segment, node, package, reference)
    for seg in (e for e in emitted if e.nodes):
        node = seg.nodes[-1]
        for value, producer in produced.items():
            base = value.split("::", 1)[0]
            if producer.name == node and base in ref_values and base != value:
                pairs.append((seg, node, value, base))
    if not pairs:
        return None
    for model, values in ((pkg_model, [p[2] for p in pairs]), (ref_model, [p[3] for p in pairs])):
        have = {o.name for o in model.graph.output}
        model.graph.output.extend(onnx.ValueInfoProto(name=v) for v in dict.fromkeys(values)
                                  if v not in have)
    so = session_options(package)
    so.log_severity_level = 4
    try:
        pkg = ort.InferenceSession(pkg_model.SerializeToString(), so, providers=[CPU_EP])
        ref_so = ort.SessionOptions()
        ref_so.log_severity_level = 4
        ref = ort.InferenceSession(ref_model.SerializeToString(), ref_so, providers=[CPU_EP])
        pkg_vals = pkg.run([p[2] for p in pairs], feeds)
        ref_vals = ref.run([p[3] for p in pairs], feeds)
    except Exception:  # the diagnosis is best effort; the check's own error stands
        return None
    for (seg, node, value, _), got, want in zip(pairs, pkg_vals, ref_vals, strict=True):
        if got.shape != want.shape:
            continue
        max_abs, max_ref, _n = compare(got, want, real)
        rel = max_abs / max(max_ref, 1e-30)
        if not rel <= bound:
            return SegmentError(seg.layer, seg.ordinal, seg.family, tuple(seg.ops), node,
                                value.split("::", 1)[0], rel)
    return None
