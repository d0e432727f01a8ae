"""``stofc.load(DIR)``: check a package, then return a ready ONNX Runtime session.

Checks, each a one-line :class:`~stofc.errors.PackageError` (never a crash):
the directory exists and holds ``manifest.json``; every file the manifest
lists exists with its sha256 (a missing cubin, an edited ``plan.json``); and,
when the CUDA execution provider is asked for, the package's cubins match the
GPU present (same architecture, or a PTX the driver can JIT for a newer one).
Without the CUDA provider the package runs on ORT's CPU twins, which need no
kernels, so no GPU check is made.

The same package also loads with plain ONNX Runtime in two lines (OPS.md)::

    so = onnxruntime.SessionOptions(); so.register_custom_ops_library("PKG/libstofc_ort.so")
    sess = onnxruntime.InferenceSession("PKG/model.onnx", so, providers=[...])
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stofc.errors import DeviceError, PackageError, StofcError
from stofc.masks.decode import load as load_format
from stofc.masks.format import MaskFormat
from stofc.masks.layers import LayerMasks
from stofc.masks.limits import MAX_SEQ_LEN
from stofc.masks.spec import canonical_json
from stofc.package.graph_capture import (
    CPU_EP,
    CUDA_EP,
    check_capturable,
    graph_providers,
    refusal,
)
from stofc.package.layout import (
    LIBRARY_NAME,
    MODEL_FILE,
    PLAN_FILE,
    PLAN_FILE_VERSION,
    PLAN_FORMAT,
)
from stofc.package.manifest import ARCH_RE, Manifest, check_manifest
from stofc.plan.plan import Plan


def _arch_cc(arch: str) -> tuple[int, int]:
    """``sm_90a`` -> ``(9, 0)``; a PackageError for anything that is not ``sm_XY[a]``."""
    if not ARCH_RE.fullmatch(arch):
        raise PackageError(f"the package names GPU architecture {arch!r}, which is not sm_XY",
                           hint="run `stofc compile` again")
    digits = arch.split("_", 1)[1].rstrip("a")
    return int(digits[:-1]), int(digits[-1])


def device_compute_capability() -> tuple[int, int] | None:
    """Compute capability of CUDA device 0 (through CuPy), or None without a GPU."""
    try:
        import cupy  # optional: CuPy, the GPU extras
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(0)
        return int(props["major"]), int(props["minor"])
    except Exception:
        return None


def check_arch(manifest: Manifest, present: tuple[int, int] | None, root: Path) -> None:
    """The package's cubins (or PTX) can run on a GPU of compute capability ``present``."""
    if present is None:
        raise DeviceError("the CUDA execution provider was asked for but no CUDA GPU was found",
                          hint="pass providers=['CPUExecutionProvider'] or run on the GPU")
    want = _arch_cc(manifest.arch)
    here = f"sm_{present[0]}{present[1]}"
    if present == want:
        return
    if present[0] == want[0] and present[1] > want[1] and not manifest.arch.endswith("a"):
        return  # a cubin runs on later minor revisions of its major architecture
    raise PackageError(f"package {root} was compiled for {manifest.arch} ({manifest.gpu}) but the "
                       f"GPU present is {here}",
                       hint="compile it again with --gpu naming this GPU (or --gpu auto)")


@dataclass(frozen=True)
class MaskEntry:
    """One mask format a package stores (plan.json ``mask.formats``)."""

    id: str
    npz: str
    bin: str
    spec_hash: str
    layers: tuple[int, ...]


@dataclass(frozen=True)
class PackageDocument:
    """What a package's ``plan.json`` says that later stages read back (typed, checked).

    ``mask_spec``: the spec as the user gave it; ``mask_effective``: the effective
    spec's canonical JSON (``causal`` ANDed in when ``mask_causal_from_model``);
    ``pack_projections``: the plan was built from the graph with Q, K, V packed;
    ``source_model`` / ``source_model_sha256``: the model compiled (provenance).
    """

    root: Path
    plan: Plan
    mask_spec: str
    mask_effective: str
    mask_causal_from_model: bool
    mask_formats: tuple[MaskEntry, ...]
    pack_projections: bool
    source_model: str
    source_model_sha256: str | None
    tuned: bool

    def masks(self) -> LayerMasks:
        """The package's mask formats by layer (each file hash-checked on load)."""
        formats: dict[int, MaskFormat] = {}
        for entry in self.mask_formats:
            fmt = load_format(self.root / entry.npz)
            formats.update({layer: fmt for layer in entry.layers})
        return LayerMasks(formats, self.plan.mask)


def _raw_document(root: Path) -> dict[str, Any]:
    path = root / PLAN_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PackageError(f"{root} has no plan.json, so it is not a stofc package",
                           hint="write one with `stofc compile MODEL ...`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PackageError(f"{path} is not valid JSON ({err})",
                           hint="run `stofc compile` again") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PackageError(f"{path} is not a stofc package plan", hint="run `stofc compile` again")
    if doc.get("version") != PLAN_FILE_VERSION:
        raise PackageError(f"{path} has version {doc.get('version')!r}, this stofc reads "
                           f"{PLAN_FILE_VERSION}", hint="run `stofc compile` again")
    problem = _document_problem(doc)
    if problem:
        raise PackageError(f"{path} is malformed ({problem})", hint="run `stofc compile` again")
    return doc


def _document_problem(doc: dict[str, Any]) -> str | None:
    """What is wrong with the fields other modules read from plan.json, or None."""
    plan, mask = doc.get("plan"), doc.get("mask")
    if not isinstance(plan, dict):
        return "no 'plan' object"
    if not isinstance(plan.get("max_seq_len"), int) or isinstance(plan.get("max_seq_len"), bool) \
            or not 1 <= plan["max_seq_len"] <= MAX_SEQ_LEN:
        return f"plan.max_seq_len is {plan.get('max_seq_len')!r}, not 1..{MAX_SEQ_LEN}"
    if not isinstance(mask, dict) or not isinstance(mask.get("formats"), list):
        return "no 'mask.formats' list"
    for entry in mask["formats"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("npz"), str) \
                or not isinstance(entry.get("layers"), list) \
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry["layers"]):
            return f"mask format entry {str(entry)[:80]!r} needs 'npz' and integer 'layers'"
        if entry["npz"].startswith("/") or ".." in entry["npz"].split("/"):
            return f"mask file {entry['npz']!r} is outside the package"
    for key in ("model", "gpu", "provenance"):
        if key in doc and not isinstance(doc[key], dict):
            return f"'{key}' is not an object"
    return None


def read_plan_document(root: str | Path) -> PackageDocument:
    """``plan.json`` of a package as a :class:`PackageDocument` (format, version and shape
    checked: a PackageError names what is wrong)."""
    root = Path(root)
    doc = _raw_document(root)
    try:
        plan = Plan.from_dict(doc["plan"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise PackageError(f"{root / PLAN_FILE} is malformed: its plan does not parse "
                           f"({type(err).__name__}: {str(err)[:120]})",
                           hint="run `stofc compile` again") from None
    try:
        mask, prov = doc["mask"], doc.get("provenance", {})
        entries = tuple(MaskEntry(str(e["id"]), str(e["npz"]), str(e["bin"]),
                                  str(e["spec_hash"]), tuple(int(x) for x in e["layers"]))
                        for e in mask["formats"])
        return PackageDocument(
            root=root, plan=plan, mask_spec=str(mask["spec"]),
            mask_effective=canonical_json(mask["effective"]),
            mask_causal_from_model=bool(mask["causal_from_model"]), mask_formats=entries,
            pack_projections=bool(doc.get("model", {}).get("pack_projections", False)),
            source_model=str(prov.get("source_model", "")),
            source_model_sha256=prov.get("source_model_sha256"),
            tuned=bool(prov.get("tuned", False)))
    except StofcError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise PackageError(f"{root / PLAN_FILE} is malformed ({type(err).__name__}: {err})",
                           hint="run `stofc compile` again; do not edit plan.json") from None


def read_plan(root: str | Path) -> Plan:
    """The :class:`~stofc.plan.plan.Plan` stored in a package (for ``stofc tune``)."""
    return read_plan_document(root).plan


def check_package(root: str | Path, *, providers: Sequence[Any] | None = None,
                  device_cc: Callable[[], tuple[int, int] | None] = device_compute_capability
                  ) -> Manifest:
    """Run the checks of the module doc; returns the manifest."""
    root = Path(root)
    if not root.is_dir():
        raise PackageError(f"package directory {root} does not exist",
                           hint="write one with `stofc compile MODEL --mask SPEC -o DIR`")
    manifest = check_manifest(root)
    read_plan_document(root)
    if any(_provider_name(p) == CUDA_EP for p in providers or ()):
        check_arch(manifest, device_cc(), root)
    return manifest


def _provider_name(provider: Any) -> str:
    return provider[0] if isinstance(provider, tuple) else str(provider)


def session_options(root: str | Path):
    """SessionOptions with the package's custom-op library registered."""
    import onnxruntime as ort  # optional: ONNX Runtime

    root = Path(root).absolute()
    so = ort.SessionOptions()
    so.add_session_config_entry("stofc.package_dir", str(root))
    so.register_custom_ops_library(str(root / LIBRARY_NAME))
    return so


def load(root: str | Path, providers: Sequence[Any] | None = None, *,
         session_options_hook: Callable[[Any], None] | None = None,
         cuda_graph: bool = False):
    """Check the package in ``root`` and return an ``onnxruntime.InferenceSession``.

    ``providers`` as for ONNX Runtime; default: CUDA then CPU when the installed
    onnxruntime has the CUDA provider and a GPU is present, else CPU.

    ``cuda_graph=True`` (fixed shapes): the CUDA EP gets ONNX Runtime's
    ``enable_cuda_graph`` option, after checking that every node of the package's
    model can run on the CUDA EP (:mod:`stofc.package.graph_capture`; else one
    StofcError line naming the node and the fix). Such a session must be run with
    IOBinding, every input and output bound to a device buffer that stays at its
    address (``OrtValue`` on ``cuda:0``, new inputs written with
    ``update_inplace``), one shape per session: ORT captures the graph at the
    second run and replays it from then on. :func:`stofc.package.bench.time_graph`
    is such a loop; README "Loading a package" shows one.
    """
    try:
        import onnxruntime as ort  # optional: ONNX Runtime
    except ImportError:
        raise PackageError("onnxruntime is not installed",
                           hint="pip install onnxruntime (CPU) or onnxruntime-gpu") from None
    root = Path(root)
    if cuda_graph:
        if CUDA_EP not in ort.get_available_providers():
            raise DeviceError("cuda_graph=True needs onnxruntime-gpu's CUDA execution "
                              "provider, which the installed onnxruntime lacks",
                              hint="pip install onnxruntime-gpu, or load without cuda_graph=True")
        providers = graph_providers(providers)
    elif providers is None:
        providers = [CPU_EP]
        if CUDA_EP in ort.get_available_providers() and device_compute_capability() is not None:
            providers = [CUDA_EP, CPU_EP]
    check_package(root, providers=providers)
    if cuda_graph:
        check_capturable(root / MODEL_FILE)
    try:
        so = session_options(root)
        if session_options_hook is not None:
            session_options_hook(so)
        return ort.InferenceSession(str(root.absolute() / MODEL_FILE), so,
                                    providers=list(providers))
    except Exception as err:  # ORT raises its own exception types
        if cuda_graph and re.search(r"cuda graph|graph capture", str(err), re.IGNORECASE):
            raise refusal(root, err) from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PackageError(f"ONNX Runtime could not load package {root}: {first}",
                           hint="run `stofc compile` again; OPS.md lists what the library needs"
                           ) from None
