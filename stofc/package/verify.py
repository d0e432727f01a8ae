"""``stofc verify``: run a package and its reference on the same random inputs; compare.

The reference is the original model with the structured mask added before
every Softmax (:mod:`stofc.package.reference`), run by ONNX Runtime's CPU EP
in float32: the function the package is meant to compute. Comparing against
the bare original would only be honest for a ``dense`` mask.

Inputs: token ids drawn below the vocabulary size (read from the embedding
Gather), ``position_ids`` = 0..S-1, ``token_type_ids`` = 0, float inputs
standard normal; the padding mask (``attention_mask``) is right-padded: the
first sequence is full, the others real for a random length in ``[S/2, S]``.
Only real token positions are compared (padded rows are undefined by
convention: the package writes zeros where no key is allowed, the reference
an average). Per output: max abs error, max abs reference value, and the
relative error ``max|pkg - ref| / max|ref|``; the bound is TARGETS.md's
end-to-end ``1e-2``. ``mask_effect`` is the same measure for the bare original
(no structured mask) against the reference: how much the mask changes the
function at these lengths (about 0 means the mask is dense there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stofc.errors import PackageError, StofcError
from stofc.frontend import ModelGraph, load_model
from stofc.frontend.graph import GraphIndex
from stofc.masks.format import MaskFormat
from stofc.package.feeds import input_shape
from stofc.package.load import (
    CPU_EP,
    CUDA_EP,
    PackageDocument,
    check_package,
    load,
    read_plan_document,
)
from stofc.package.manifest import sha256_file
from stofc.package.reference import inject_mask

END_TO_END_BOUND = 1e-2   # TARGETS.md: end to end <= 1e-2 vs the fp32 ORT run
PROVIDERS = {"cpu": [CPU_EP], "cuda": [CUDA_EP, CPU_EP]}


@dataclass(frozen=True)
class OutputError:
    """One output of one (batch, seq_len) case."""

    output: str
    batch: int
    seq_len: int
    max_abs: float
    max_ref: float
    rel: float
    compared: int     # elements compared (real token positions)
    mask_effect: float = 0.0  # rel. difference of the bare original (no structured mask)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class VerifyReport:
    package: str
    reference: str
    provider: str
    bound: float
    errors: tuple[OutputError, ...]

    @property
    def worst(self) -> OutputError:
        return max(self.errors, key=lambda e: e.rel)

    @property
    def passed(self) -> bool:
        return all(e.rel <= self.bound for e in self.errors)

    def to_dict(self) -> dict:
        return {"package": self.package, "reference": self.reference, "provider": self.provider,
                "bound": self.bound, "passed": self.passed,
                "errors": [e.to_dict() for e in self.errors]}


def original_model(package: Path, doc: PackageDocument, model: str | Path | None) -> Path:
    """The original model: ``--model``, else the path recorded at compile time (hash-checked)."""
    if model is not None:
        path = Path(model)
        if not path.is_file():
            raise StofcError(f"original model {path} not found", hint="check --model")
        return path
    path = Path(doc.source_model)
    if not doc.source_model or not path.is_file():
        raise StofcError(f"the original model of {package} ({path}) is not there any more",
                         hint="pass it with --model ORIGINAL.onnx")
    if sha256_file(path) != doc.source_model_sha256:
        raise StofcError(f"{path} changed since {package} was compiled",
                         hint="pass the original with --model, or compile again")
    return path


def _vocab(idx: GraphIndex, name: str) -> int | None:
    for node in idx.users(name):
        if node.op_type == "Gather" and node.input[1] == name:
            table = idx.const(node.input[0])
            if table is not None:
                return int(table.shape[0])
    return None


def make_inputs(graph: ModelGraph, batch: int, seq_len: int, rng: np.random.Generator,
                shapes: dict[str, tuple[int, ...]] | None = None
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random feeds for ``graph`` and the ``[B, S]`` bool mask of real tokens; image and
    feature inputs take ``shapes[name]`` or what the model says (:mod:`stofc.package.feeds`)."""
    idx = GraphIndex(graph.model)
    lengths = np.full(batch, seq_len)
    if batch > 1:
        lengths[1:] = rng.integers(max(1, seq_len // 2), seq_len + 1, batch - 1)
    real = np.arange(seq_len)[None, :] < lengths[:, None]
    feeds: dict[str, np.ndarray] = {}
    for vi in graph.inputs:
        shape = input_shape(graph, idx, vi, batch, seq_len, shapes or {})
        dtype = np.dtype(vi.dtype) if vi.dtype in np.sctypeDict else np.dtype(np.float32)
        lname = vi.name.lower()
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif vi.name == graph.padding_mask_input or "mask" in lname:
            feeds[vi.name] = real.astype(dtype).reshape(shape)
        elif "position" in lname:
            feeds[vi.name] = np.broadcast_to(np.arange(seq_len, dtype=dtype), shape).copy()
        elif "type" in lname:
            feeds[vi.name] = np.zeros(shape, dtype)
        else:
            vocab = _vocab(idx, vi.name) or 2
            feeds[vi.name] = rng.integers(0, vocab, shape).astype(dtype)
    if graph.padding_mask_input is None and not any("mask" in n.lower() for n in feeds):
        real = np.ones((batch, seq_len), bool)
    return feeds, real


def compare(out: np.ndarray, ref: np.ndarray, real: np.ndarray) -> tuple[float, float, int]:
    """Max abs error and max abs reference over real token positions."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise StofcError(f"package output shape {out.shape} differs from the reference's "
                         f"{ref.shape}", hint="this is a stofc bug; report it")
    if out.ndim >= 2 and out.shape[:2] == real.shape:
        out, ref = out[real], ref[real]
    if not np.isfinite(out).all():
        return float("inf"), float(np.abs(ref).max()), out.size
    return float(np.abs(out - ref).max()), float(np.abs(ref).max()), out.size


def verify_package(package: str | Path, *, model: str | Path | None = None,
                   provider: str = "cpu", cases: list[tuple[int, int]] | None = None,
                   seed: int = 0, bound: float = END_TO_END_BOUND,
                   input_shapes: dict[str, tuple[int, ...]] | None = None) -> VerifyReport:
    """Compare the package with the reference on every ``(batch, seq_len)`` case."""
    import onnxruntime as ort  # optional: ONNX Runtime

    package = Path(package)
    check_package(package)  # the manifest first: an edited plan.json is "modified", not a crash
    doc = read_plan_document(package)
    if provider not in PROVIDERS:
        raise StofcError(f"unknown provider {provider!r}", hint="use cpu or cuda")
    if provider == "cuda" and CUDA_EP not in ort.get_available_providers():
        raise StofcError("onnxruntime has no CUDAExecutionProvider here",
                         hint="install onnxruntime-gpu on a GPU machine, or use --provider cpu")
    source = original_model(package, doc, model)
    graph = load_model(source)
    formats = dict(doc.masks().formats)
    if set(formats) != {layer.index for layer in graph.layers}:
        raise PackageError(f"{source} has {len(graph.layers)} attention layers, the package's "
                           f"masks cover {len(formats)}", hint="pass the model it was compiled from")
    max_len = doc.plan.max_seq_len
    cases = cases or default_cases(max_len)
    for _, seq_len in cases:
        if seq_len > max_len:
            raise StofcError(f"--seq-len {seq_len} exceeds the package's max_seq_len {max_len}",
                             hint=f"use lengths <= {max_len}")
    longest = max(n for _, n in cases)
    bare = _session(graph.model.SerializeToString())
    reference = reference_session(graph, formats, longest)
    session = load(package, providers=PROVIDERS[provider],
                   session_options_hook=lambda o: setattr(o, "log_severity_level", 4))
    rng = np.random.default_rng(seed)
    names = [o.name for o in reference.get_outputs()]
    errors = []
    for batch, seq_len in cases:
        feeds, real = make_inputs(graph, batch, seq_len, rng, input_shapes)
        ref_out = run_session(reference, names, feeds, f"the reference ({source.name})", batch,
                              seq_len)
        pkg_out = run_session(session, names, feeds, f"the package ({package.name})", batch,
                              seq_len)
        bare_out = run_session(bare, names, feeds, f"the original ({source.name})", batch,
                               seq_len)
        errors += output_errors(names, pkg_out, ref_out, real, batch, seq_len, bare_out)
    return VerifyReport(str(package), str(source), provider, bound, tuple(errors))


DEFAULT_MAX_LEN = 512  # default cases stay short enough for a CPU run


def default_cases(max_len: int) -> list[tuple[int, int]]:
    """Batch 2 (one sequence padded) at two lengths: min(L_max, 512) and an odd third of it."""
    top = min(max_len, DEFAULT_MAX_LEN)
    return [(2, n) for n in sorted({max(1, top // 3) | 1, top})]


def _session(model: bytes):
    import onnxruntime as ort  # optional: ONNX Runtime (the test/ort extras)

    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors come back as one line, not ORT's log
    return ort.InferenceSession(model, so, providers=[CPU_EP])


def reference_session(graph: ModelGraph, formats: dict[int, MaskFormat], size: int):
    """THE reference of ``stofc verify`` and of ``stofc compile``'s check, as an ONNX Runtime
    CPU session: the original model with the structured mask injected before every Softmax
    (:func:`~stofc.package.reference.inject_mask`), for runs of length ``<= size``."""
    return _session(inject_mask(graph, formats, size=size).SerializeToString())


def output_errors(names: list[str], pkg_out: list[np.ndarray], ref_out: list[np.ndarray],
                  real: np.ndarray, batch: int, seq_len: int,
                  bare_out: list[np.ndarray] | None = None) -> list[OutputError]:
    """One :class:`OutputError` per output (``bare_out``: the original without the mask)."""
    errors = []
    for i, (name, o, r) in enumerate(zip(names, pkg_out, ref_out, strict=True)):
        max_abs, max_ref, n = compare(o, r, real)
        scale = max(max_ref, 1e-30)
        effect = compare(bare_out[i], r, real)[0] / scale if bare_out is not None else 0.0
        errors.append(OutputError(name, batch, seq_len, max_abs, max_ref, max_abs / scale, n,
                                  effect))
    return errors


def run_session(session, names: list[str], feeds: dict[str, np.ndarray], what: str, batch: int,
                seq_len: int) -> list[np.ndarray]:
    """``session.run`` with ONNX Runtime's failure as one StofcError line."""
    try:
        return session.run(names, feeds)
    except Exception as err:  # ORT's own exception types; keep one line
        text = str(err).strip().splitlines()
        first = text[0] if text else type(err).__name__
        raise StofcError(f"ONNX Runtime failed running {what} at batch {batch}, length "
                         f"{seq_len}: {first[:300]}",
                         hint="check --seq-len against the model's own limits "
                              "(e.g. its position embeddings)") from None
