"""The kernel selector: STOF's density formula, refined by each family's cost model.

STOF (design/STOF.md): with ``n = ceil(L/16)`` and ``nnz16`` the non-empty 16x16
blocks, ``threshold = nnz16 / n^2 - 1.2 / (log2 n)^2``; row-wise when negative.
That formula ignores the GPU and the batch. stofc asks every registered attention
family (:func:`~stofc.kernels.attention.config.attention_families`, by preference)
for its starting config on this mask and shape and for that config's estimated
time on this GPU (the block-wise and row-wise cost models are in :mod:`.block` and
:mod:`.row`), and picks the cheapest; a tie goes to the family listed first. The
explanation states the winner's and the runner-up's estimates, why the winner is
better, STOF's verdict and whether it agrees. A family without a config for the
mask (block-wise below T=64, or no config fitting the GPU) is skipped with its
reason. A family that *refines* the choice (``refines``: the warp-specialised Hopper
kernel, :mod:`.ws_cost`) is compared with that pick afterwards and takes it where its
estimate is lower; the explanation says so either way. The tuner refines the choice
by measurement.

Each family may then turn its choice into a base kernel plus run-time variants
(:meth:`~stofc.kernels.attention.family.AttentionFamily.runtime_variants`: the
block-wise query split for short grids): :func:`choose_attention`.

Both take the node's inputs besides Q, K and V (``extras``,
:class:`~.config.ExtraInputs`; default none): a starting config may not spill with them
(four ws consumer warpgroups do with a bias, :func:`.ws_cost.ws_spills`).
Both are memoised (``MEMO_SIZE`` entries) on the format's content digest, the GPU
profile, the shape, those inputs and the registered families: layers with the same mask
share one selection (ModernBERT's 14 local layers: one block-wise search, not 14).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from stofc.kernels.attention.config import (
    NO_EXTRAS,
    AttentionConfig,
    ExtraInputs,
    attention_families,
    check_head_dim,
)
from stofc.masks.format import MaskFormat, content_digest
from stofc.targets import GpuProfile

TAU = 1.2                 # STOF's empirical constant
MEMO_SIZE = 256
T = TypeVar("T")
_MEMO: OrderedDict[tuple, Any] = OrderedDict()


def _memoised(what: str, fmt: MaskFormat, profile: GpuProfile, shape: tuple[int, ...],
              extras: ExtraInputs, make: Callable[[], T]) -> T:
    """``make()``, once per (what, format content, profile, shape, extra inputs, families,
    TAU)."""
    families = tuple((type(f).__module__, type(f).__qualname__, f.kind)
                     for f in attention_families())
    key = (what, content_digest(fmt), profile, shape, extras, families, TAU)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    value = make()
    _MEMO[key] = value
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


@dataclass(frozen=True)
class KernelChoice:
    """The selector's pick: the family's kind, its starting config, why, and the estimates
    (``estimates``: per family kind compared first, in us, inf for a family with no config
    here; ``refinements``: the same for the families that refine the pick)."""

    kernel: str
    config: AttentionConfig
    explanation: str
    stof_threshold: float
    estimates: tuple[tuple[str, float], ...]
    refinements: tuple[tuple[str, float], ...] = ()

    def estimate(self, kind: str) -> float:
        return dict(self.estimates + self.refinements).get(kind, math.inf)

    @property
    def block_us(self) -> float:
        return self.estimate("block")

    @property
    def row_us(self) -> float:
        return self.estimate("row")

    @property
    def ws_us(self) -> float:
        return self.estimate("ws")


@dataclass(frozen=True)
class AttentionVariant:
    """A kernel a layer's SparseAttention node switches to at run time (OPS.md, variants).

    Eligible when the run's ``S <= max_seq_len`` and ``B * ceil(S / T) <= max_batch_rows``
    (0 = no bound); the node takes its first eligible variant, else the base kernel.
    """

    max_seq_len: int
    max_batch_rows: int
    choice: KernelChoice
    reason: str


def nonempty_blocks16(fmt: MaskFormat) -> float:
    """Non-empty 16x16 blocks, averaged over the format's heads."""
    t, itn = fmt.tile, fmt.tile // 8
    per_tile16 = (t // 16) ** 2
    total = 0
    n_full = int(np.asarray(fmt.load_part_idx < 0).sum())
    total += n_full * per_tile16        # edge tiles overcount a little; fine for a model
    if fmt.part_bitmaps.size:
        w = np.asarray(fmt.part_bitmaps).reshape(-1, itn, itn) != 0   # [p, ic, ir]
        w16 = w.reshape(-1, itn // 2, 2, itn // 2, 2).any(axis=(2, 4))
        total += int(w16.sum())
    return total / fmt.num_heads


def stof_threshold(fmt: MaskFormat, seq_len: int) -> float:
    """STOF's ``nnz16 / n^2 - tau / (log2 n)^2`` (negative: row-wise)."""
    n = max(2, math.ceil(seq_len / 16))
    return nonempty_blocks16(fmt) / n**2 - TAU / math.log2(n) ** 2


def select_kernel(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                  seq_len: int, head_dim: int, extras: ExtraInputs = NO_EXTRAS
                  ) -> KernelChoice:
    """Pick the attention family and starting config for this mask and shape on this GPU,
    for a node that also reads ``extras``, with a reason (see the module doc; memoised)."""
    check_head_dim(head_dim)
    return _memoised("select", fmt, profile, (batch, heads, seq_len, head_dim), extras,
                     lambda: _select(fmt, profile, batch=batch, heads=heads, seq_len=seq_len,
                                     head_dim=head_dim, extras=extras))


def _select(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
            seq_len: int, head_dim: int, extras: ExtraInputs) -> KernelChoice:
    seq_len = min(seq_len, fmt.seq_len)
    thr = stof_threshold(fmt, seq_len)
    shape = {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim}
    ranked: list[tuple[float, int, Any, AttentionConfig]] = []   # (us, order, family, config)
    refining: list[tuple[float, int, Any, AttentionConfig]] = []
    estimates: list[tuple[str, float]] = []
    refined: list[tuple[str, float]] = []
    missing: list[str] = []
    for order, fam in enumerate(f for f in attention_families() if f.selectable):
        cfg = fam.starting_config(fmt, profile, **shape, extras=extras)
        if cfg is None:
            if not fam.refines:
                missing.append(fam.unavailable(fmt, head_dim))
            (refined if fam.refines else estimates).append((fam.kind, math.inf))
            continue
        us = fam.estimate_us(fmt, profile, cfg, **shape)
        (refined if fam.refines else estimates).append((fam.kind, us))
        (refining if fam.refines else ranked).append((us, order, fam, cfg))
    if not ranked:
        raise ValueError(f"no attention family runs T={fmt.tile}, head_dim={head_dim} "
                         f"({'; '.join(missing)})")
    ranked.sort(key=lambda r: (r[0], r[1]))
    us, order, fam, cfg = ranked[0]
    if len(ranked) == 1:
        why = "; ".join(missing)
    else:
        other_us, other_order, other, _ = ranked[1]
        op = "<=" if order < other_order else "<"
        why = (f"{fam.label} est. {us:.1f} us {op} {other.label} {other_us:.1f} us: "
               f"{fam.advantage(fmt)}")
    stof = "row-wise" if thr < 0 else "block-wise"
    agree = "agrees" if (thr < 0) == (fam.stof_class == "row") else "is overruled"
    for rus, _, rfam, rcfg in refining:
        if rus < us:
            why = (f"{rfam.label} est. {rus:.1f} us < {fam.label} {us:.1f} us: "
                   f"{rfam.advantage(fmt)}")
            us, fam, cfg, agree = rus, rfam, rcfg, "is refined"
        else:
            why += f" ({rfam.label} est. {rus:.1f} us)"
    explanation = (f"{fam.label} ({cfg.describe()}) on {profile.full_name}: {why}; "
                   f"STOF's threshold {thr:+.4f} says {stof} and {agree}")
    return KernelChoice(fam.kind, cfg, explanation, thr, tuple(estimates), tuple(refined))


def choose_attention(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int,
                     seq_len: int, head_dim: int, extras: ExtraInputs = NO_EXTRAS
                     ) -> tuple[KernelChoice, tuple[AttentionVariant, ...]]:
    """The selector's choice as the base kernel of a layer whose node also reads
    ``extras``, and its run-time variants (those the chosen family adds for shapes the
    base kernel serves badly; memoised)."""
    return _memoised("choose", fmt, profile, (batch, heads, seq_len, head_dim), extras,
                     lambda: _choose(fmt, profile, batch=batch, heads=heads, seq_len=seq_len,
                                     head_dim=head_dim, extras=extras))


def _choose(fmt: MaskFormat, profile: GpuProfile, *, batch: int, heads: int, seq_len: int,
            head_dim: int, extras: ExtraInputs
            ) -> tuple[KernelChoice, tuple[AttentionVariant, ...]]:
    choice = select_kernel(fmt, profile, batch=batch, heads=heads, seq_len=seq_len,
                           head_dim=head_dim, extras=extras)
    fam = next(f for f in attention_families() if f.kind == choice.kernel)
    return fam.runtime_variants(choice, fmt, profile, batch=batch, heads=heads,
                                head_dim=head_dim)


def planned_choice(choice: KernelChoice, config: AttentionConfig) -> KernelChoice:
    """``choice`` replaced by a plan's (the tuner's) ``config``, saying so."""
    return replace(choice, kernel=config.kind, config=config,
                   explanation=f"from the plan: {config.describe()} (the selector's analytical "
                               f"choice was {choice.config.describe()})")
