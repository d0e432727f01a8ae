"""A deterministic simulated cost model: the reference implementation of the protocols.

It drives the whole engine without a GPU (CI tests, ``--dry-run`` demos) and
shows the plan and kernel modules what to implement:

* :class:`SimOp` / :class:`SimChain`: a layer chain (BERT-like by default,
  :func:`bert_like_chain`) with compute-intensive (GEMM, attention) and
  memory-intensive operators and a base cost per operator.
* :class:`SimSchemeSpace`: the STOF moves (expand / seize / compete) over the
  chain, attention fixed; :func:`boundary_moves` is a plain implementation
  the plan module may reuse.
* :class:`SimSegment`: a 320-point space (block_m, block_n, warps, stages)
  pruned by a shared-memory limit and a tiles-per-warp rule, with reasons.
* Vendor GEMMs (``SimSegment(vendor=True)``, :class:`SimSchemeSpace` with
  ``vendor=True``: segments whose only compute-intensive operator is a GEMM):
  the space also holds ``{"impl": "cublas", "lt_algo", "rows"}`` configs,
  cuBLASLt's heuristic rank 0..7 crossed with the epilogue kernel's rows per
  block, and the default is the vendor path at rank 0 (as the real plans'). The
  heuristic returns :func:`lt_returned` (3..8) candidates per problem; a rank
  past them is rejected when measured. Each rank has a deterministic factor
  (:func:`lt_factor`: rank 0 is 1, others 0.85..1.2), so some problem's best
  rank is not 0 and tests can check the search finds it.
* :class:`SimMeasurer`: time = base cost x fusion factor x config efficiency
  x seeded noise (+-0.5%); some configs fault, some give wrong results; each
  measurement advances a simulated clock (:class:`SimClock`).

The optimum of each segment is known (:meth:`SimMeasurer.true_best`), so tests
can check that the search finds it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stofc.tune.interfaces import Config, Measurement, Move, Scheme, SegmentSpace

CI_KINDS = ("gemm", "attention")

PARAMS: dict[str, tuple[int, ...]] = {
    "block_m": (16, 32, 64, 128, 256),
    "block_n": (32, 64, 128, 256),
    "warps": (1, 2, 4, 8),
    "stages": (1, 2, 3, 4),
}
SMEM_LIMIT = 160 * 1024
LT_RANKS = 8                  # cuBLASLt heuristic ranks in a vendor space (as the real one)
VENDOR_ROWS = (1, 2, 4, 8)    # the vendor epilogue kernel's rows per block
VENDOR_FACTOR = 0.9           # the vendor GEMM at rank 0 vs the template at its optimum


def _unit(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts``."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def lt_returned(problem: tuple) -> int:
    """How many candidates the simulated cuBLASLt heuristic returns for ``problem`` (3..8)."""
    return 3 + int(_unit("lt-returned", *problem) * 6)


def lt_factor(problem: tuple, rank: int) -> float:
    """The simulated cost factor of heuristic rank ``rank`` (rank 0: 1.0; others 0.85..1.2)."""
    return 1.0 if rank == 0 else 0.85 + 0.35 * _unit("lt-rank", *problem, rank)


@dataclass(frozen=True)
class SimOp:
    name: str
    kind: str       # "gemm" | "attention" | "mi"
    cost_ms: float


@dataclass(frozen=True)
class SimChain:
    """A layer chain and how fusion changes its cost.

    ``mi_fused_factor``: an MI op inside a CI segment costs this fraction.
    ``mi_pair_factor``: MI-only segments of several ops cost this fraction.
    ``ci_pair_factor``: a segment with two CI ops costs this multiple of their sum
    (> 1: fusing them is worse, < 1: better).
    """

    ops: tuple[SimOp, ...]
    tokens: int
    mi_fused_factor: float = 0.15
    mi_pair_factor: float = 0.6
    ci_pair_factor: float = 1.3


def bert_like_chain(tokens: int = 2048, ci_pair_factor: float = 1.3) -> SimChain:
    """The 14-op chain of a post-LN BERT layer as the frontend emits it."""
    spec = [("qkv", "gemm", 1.0), ("bias_qkv", "mi", 0.2), ("attention", "attention", 2.0),
            ("out", "gemm", 0.4), ("bias_out", "mi", 0.1), ("residual1", "mi", 0.12),
            ("ln1", "mi", 0.15), ("ffn_in", "gemm", 1.4), ("bias_in", "mi", 0.25),
            ("gelu", "mi", 0.3), ("ffn_out", "gemm", 1.4), ("bias_ffn", "mi", 0.1),
            ("residual2", "mi", 0.12), ("ln2", "mi", 0.15)]
    return SimChain(tuple(SimOp(n, k, c * tokens / 2048) for n, k, c in spec), tokens,
                    ci_pair_factor=ci_pair_factor)


@dataclass(frozen=True)
class SimSegment:
    """One simulated segment (satisfies :class:`~stofc.tune.interfaces.SegmentSpace`)."""

    chain: SimChain = field(repr=False)
    ops: tuple[int, ...]
    compile_options: tuple[str, ...] = ("-arch=sim",)
    vendor: bool = False     # a GEMM with the cuBLASLt vendor path (module doc)

    @property
    def family(self) -> str:
        kinds = [self.chain.ops[i].kind for i in self.ops]
        return "+".join(k for k, _ in itertools.groupby(kinds))

    @property
    def problem(self) -> tuple:
        names = "+".join(self.chain.ops[i].name for i in self.ops)
        return (self.chain.tokens, names, "cublasLt:sim") if self.vendor else \
            (self.chain.tokens, names)

    @property
    def unordered(self) -> tuple[str, ...]:
        """Parameters without a scale (stage 2: every value is a neighbour)."""
        return ("lt_algo",) if self.vendor else ()

    @property
    def label(self) -> str:
        return f"ops {self.ops[0]}-{self.ops[-1]} {self.family}"

    def _prune(self) -> tuple[list[Config], dict[str, int]]:
        return _vendor_space() if self.vendor else _pruned_space()

    def configs(self) -> Sequence[Config]:
        return self._prune()[0]

    def default_config(self) -> Config:
        if self.vendor:
            return Config.of(impl="cublas", lt_algo=0, rows=2)
        return Config.of(block_m=64, block_n=64, warps=4, stages=2)

    def prune_reasons(self) -> Mapping[str, int]:
        return dict(self._prune()[1])

    def base_ms(self) -> float:
        """The cost at the best config, before noise."""
        ops = [self.chain.ops[i] for i in self.ops]
        ci = [op for op in ops if op.kind in CI_KINDS]
        mi = [op for op in ops if op.kind not in CI_KINDS]
        ci_cost = sum(op.cost_ms for op in ci) * (self.chain.ci_pair_factor if len(ci) > 1 else 1)
        if ci:
            mi_cost = sum(op.cost_ms for op in mi) * self.chain.mi_fused_factor
        else:
            mi_cost = sum(op.cost_ms for op in mi) * (self.chain.mi_pair_factor
                                                      if len(mi) > 1 else 1.0)
        return ci_cost + mi_cost


@functools.cache
def _pruned_space() -> tuple[list[Config], dict[str, int]]:
    """The simulated families' configs after pruning, with the reasons (same for all)."""
    kept: list[Config] = []
    reasons: dict[str, int] = {}
    for values in itertools.product(*PARAMS.values()):
        bm, bn, warps, stages = values
        config = Config.of(dict(zip(PARAMS, values, strict=True)))
        smem = (bm + bn) * 64 * 2 * stages
        tiles = bm * bn // (16 * 16)
        if smem > SMEM_LIMIT:
            reason = f"shared memory > {SMEM_LIMIT // 1024} KiB per block"
        elif warps > tiles:
            reason = "more warps than 16x16 tiles"
        else:
            kept.append(config)
            continue
        reasons[reason] = reasons.get(reason, 0) + 1
    return kept, reasons


@functools.cache
def _vendor_space() -> tuple[list[Config], dict[str, int]]:
    """A vendor GEMM's configs: the template's, then cuBLASLt rank x epilogue rows."""
    kept, reasons = _pruned_space()
    vendor = [Config.of(impl="cublas", lt_algo=rank, rows=rows)
              for rows in VENDOR_ROWS for rank in range(LT_RANKS)]
    return [*kept, *vendor], reasons


def is_vendor(config: Config) -> bool:
    return config.get("impl") == "cublas"


class SimClock:
    """A clock the simulated measurer advances (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def faults(config: Config) -> bool:
    """The simulated illegal-address region: 8 warps with 4 stages."""
    return config.get("warps") == 8 and config.get("stages") == 4


def rank_missing(segment: SimSegment, config: Config) -> bool:
    """A cuBLASLt rank the simulated heuristic does not return for ``segment``."""
    return is_vendor(config) and int(config["lt_algo"]) >= lt_returned(segment.problem)


class SimMeasurer:
    """Simulated timings (satisfies :class:`~stofc.tune.interfaces.Measurer`).

    ``wrong``: config keys whose verification fails. ``seconds_per_measure``:
    how far each measurement advances ``clock``. ``calls`` counts measure calls.
    """

    gpu = "SIM GPU"
    driver = "0.0"

    def __init__(self, *, seed: int = 0, noise: float = 0.005, wrong: frozenset[str] = frozenset(),
                 clock: SimClock | None = None, seconds_per_measure: float = 0.05) -> None:
        self.seed = seed
        self.noise = noise
        self.wrong = wrong
        self.clock = clock or SimClock()
        self.seconds_per_measure = seconds_per_measure
        self.calls = 0
        self.verified: list[tuple[str, str]] = []
        self._optima: dict[tuple, Config] = {}

    def optimum(self, segment: SimSegment) -> Config:
        """The config the efficiency model centres on (feasible, not faulting)."""
        key = (segment.family, segment.problem)
        if key not in self._optima:
            valid = [c for c in segment.configs() if not faults(c) and not is_vendor(c)]
            self._optima[key] = valid[int(_unit("opt", *key) * len(valid))]
        return self._optima[key]

    def efficiency(self, segment: SimSegment, config: Config) -> float:
        if is_vendor(config):   # the rank's factor, and the epilogue rows around 2 or 4
            best_rows = 2 if _unit("rows", *segment.problem) < 0.5 else 4
            rows = 1.0 + 0.02 * (math.log2(float(config["rows"])) - math.log2(best_rows)) ** 2
            return VENDOR_FACTOR * lt_factor(segment.problem, int(config["lt_algo"])) * rows
        opt = self.optimum(segment)
        return 1.0 + 0.08 * sum((math.log2(float(config[p])) - math.log2(float(opt[p]))) ** 2
                                for p in PARAMS)

    def time_ms(self, segment: SimSegment, config: Config) -> float | None:
        """The measured time (deterministic), or None for a faulting config."""
        if faults(config) or rank_missing(segment, config):
            return None
        jitter = 1.0 + self.noise * (2 * _unit(self.seed, segment.problem, config.key) - 1)
        return segment.base_ms() * self.efficiency(segment, config) * jitter

    def true_best(self, segment: SimSegment) -> tuple[Config, float]:
        """The fastest config by brute force (what the search should find)."""
        timed = [(c, self.time_ms(segment, c)) for c in segment.configs()]
        return min(((c, t) for c, t in timed if t is not None), key=lambda ct: ct[1])

    def measure(self, segment: SegmentSpace, config: Config) -> Measurement:
        assert isinstance(segment, SimSegment)
        self.calls += 1
        self.clock.now += self.seconds_per_measure
        t = self.time_ms(segment, config)
        if t is None and rank_missing(segment, config):
            return Measurement(None, f"rejected: cuBLASLt's heuristic returned "
                               f"{lt_returned(segment.problem)} algorithm(s) (simulated)")
        if t is None:
            return Measurement(None, "CUDARuntimeError: cudaErrorIllegalAddress (simulated)")
        return Measurement(t)

    def verify(self, segment: SegmentSpace, config: Config) -> bool:
        self.verified.append((segment.label, config.key))
        return config.key not in self.wrong


def ci_count(chain: SimChain, group: Sequence[int]) -> int:
    return sum(1 for i in group if chain.ops[i].kind in CI_KINDS)


def boundary_moves(scheme: Scheme, is_ci: Sequence[bool], fixed: frozenset[int],
                   max_ci: int = 2) -> list[Move]:
    """STOF's moves from ``scheme``, left to right: expand, seize, compete.

    * expand: a segment merges its right neighbour.
    * seize: a segment with a CI op takes the adjacent end op of an MI-only
      neighbour of two or more ops.
    * compete: a single MI op between two CI segments joins the side holding
      one CI op (the left one on a tie).

    Segments holding a ``fixed`` op never change. Moves that would put more
    than ``max_ci`` CI ops in a segment are not proposed.
    """
    groups = [list(g) for g in scheme.segments()]
    moves: list[Move] = []

    def ci(group: Sequence[int]) -> int:
        return sum(1 for i in group if is_ci[i])

    def movable(group: Sequence[int]) -> bool:
        return not any(i in fixed for i in group)

    def emit(kind: str, ops: Sequence[int], new_groups: list[list[int]], why: str) -> None:
        if all(ci(g) <= max_ci for g in new_groups):
            moves.append(Move(kind, tuple(ops), Scheme.from_segments(new_groups), why))  # type: ignore[arg-type]

    for i in range(len(groups) - 1):
        left, right = groups[i], groups[i + 1]
        if not (movable(left) and movable(right)):
            continue
        emit("expand", right, [*groups[:i], left + right, *groups[i + 2:]],
             f"merge ops {right} into {left}")
        if ci(left) and not ci(right) and len(right) > 1:
            emit("seize", right[:1], [*groups[:i], [*left, right[0]], right[1:], *groups[i + 2:]],
                 f"segment {left} seizes op {right[0]}")
        if ci(right) and not ci(left) and len(left) > 1:
            emit("seize", left[-1:], [*groups[:i], left[:-1], [left[-1], *right], *groups[i + 2:]],
                 f"segment {right} seizes op {left[-1]}")
    for i in range(1, len(groups) - 1):
        prev, mid, nxt = groups[i - 1], groups[i], groups[i + 1]
        if (len(mid) == 1 and not ci(mid) and ci(prev) and ci(nxt)
                and movable(prev) and movable(nxt) and movable(mid)):
            if ci(nxt) == 1 and ci(prev) != 1:
                emit("compete", mid, [*groups[:i - 1], prev, [*mid, *nxt], *groups[i + 2:]],
                     f"op {mid[0]} goes to {nxt} (one CI op)")
            else:
                emit("compete", mid, [*groups[:i - 1], prev + mid, nxt, *groups[i + 2:]],
                     f"op {mid[0]} goes to {prev} (one CI op)")
    return moves


class SimSchemeSpace:
    """Schemes over a :class:`SimChain` (satisfies :class:`~stofc.tune.interfaces.SchemeSpace`).

    The initial scheme is one segment per operator. ``propose_illegal`` also
    proposes moves breaking the two-CI rule (to test the engine's guard).
    ``vendor``: segments whose only CI operator is a GEMM have the vendor path.
    """

    def __init__(self, chain: SimChain, *, propose_illegal: bool = False,
                 vendor: bool = False) -> None:
        self.chain = chain
        self.propose_illegal = propose_illegal
        self.vendor = vendor
        self.compute_intensive = frozenset(i for i, op in enumerate(chain.ops)
                                           if op.kind in CI_KINDS)
        self.fixed = frozenset(i for i, op in enumerate(chain.ops) if op.kind == "attention")
        self.segment_calls = 0

    def initial(self) -> Scheme:
        return Scheme.from_segments([[i] for i in range(len(self.chain.ops))])

    def moves(self, scheme: Scheme) -> Sequence[Move]:
        is_ci = [i in self.compute_intensive for i in range(len(self.chain.ops))]
        limit = len(self.chain.ops) if self.propose_illegal else 2
        return boundary_moves(scheme, is_ci, self.fixed, max_ci=limit)

    def segments(self, scheme: Scheme) -> Sequence[SimSegment]:
        self.segment_calls += 1
        return [SimSegment(self.chain, group, vendor=self.vendor and self._one_gemm(group))
                for group in scheme.segments()]

    def _one_gemm(self, group: Sequence[int]) -> bool:
        kinds = [self.chain.ops[i].kind for i in group if self.chain.ops[i].kind in CI_KINDS]
        return kinds == ["gemm"]


# ---- a simulated measurement runner (for :class:`~stofc.tune.measure.WorkerMeasurer`) ----

_POISONED = False


class SimulatedCudaError(RuntimeError):
    """Stands in for a CUDA error that leaves the context unusable (sticky)."""


def describe() -> dict[str, str]:
    """The simulated device identity (the worker protocol's optional hook)."""
    return {"gpu": "SIM GPU", "driver": "0.0"}


def compile_simulated(payload: dict, config_key: str) -> None:
    """A compiler for the worker protocol: fails for ``payload["compile_errors"]`` keys.

    With ``payload["compile_log"]`` (a file) it appends ``pid config_key`` per call.
    """
    import os

    log = payload.get("compile_log")
    if log is not None:
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {config_key}\n")
    if config_key in payload.get("compile_errors", ()):
        raise RuntimeError(f"NVRTC: too many resources requested for {config_key} (simulated)")


def run_simulated_task(task) -> float | bool:
    """A runner for the worker protocol, driven by ``task.payload``.

    ``payload = {"base_ms": float, "behaviour": {config_key: what}}`` where
    ``what`` is ``"raise"`` (a sticky simulated CUDA error: every later task
    in this process fails too, as in a real poisoned context), ``"abort"``
    (``os.abort``), ``"exit"`` (``os._exit(3)``), ``"sleep"`` (hangs),
    ``"reject"`` (:class:`~stofc.tune.measure.CandidateRejected`) or
    ``"wrong"`` (verification fails). With ``payload["log"]`` (a file), each
    task appends ``pid start end`` after holding for ``hold_s``. Other configs take ``base_ms`` x a
    deterministic factor of the config.
    """
    import os
    import time as _time

    from stofc.tune.measure import CandidateRejected

    global _POISONED
    log = task.payload.get("log")
    if log is not None:  # record when this candidate held the GPU (lock tests)
        start = _time.time()
        _time.sleep(task.payload.get("hold_s", 0.02))
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {start:.6f} {_time.time():.6f}\n")
    if _POISONED:
        raise SimulatedCudaError("cudaErrorIllegalAddress: an illegal memory access "
                                 "was encountered (sticky)")
    what = task.payload["behaviour"].get(task.config)
    if what == "raise":
        _POISONED = True
        raise SimulatedCudaError("cudaErrorIllegalAddress: an illegal memory access "
                                 "was encountered")
    if what == "abort":
        os.abort()
    if what == "exit":
        os._exit(3)
    if what == "sleep":
        _time.sleep(3600)
    if what == "reject":
        raise CandidateRejected("needs 300 KiB shared memory")
    if task.mode == "verify":
        return what != "wrong"
    return task.payload["base_ms"] * (1.0 + _unit("runner", task.config))
