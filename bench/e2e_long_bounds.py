"""What the Flex targets of ``bench/e2e_long.py`` ask of attention, from one run's rows.

At a point with a Flex target (issue 18: Longformer / BigBird >= 2x torch.compile with
FlexAttention at (1, 8192) and (1, 16384), causal >= 1.1x), a profile of the stofc package
and the plain medians of the package and of Flex, all from the same run, give:

* ``rest``: the package's time minus its attention (the profile's attention class,
  each kernel interval counted once): GEMMs, norms, embedding, idle and host time, which no
  attention kernel changes. The package's time is the lower of its plain median and the
  profiled runs' mean wall time: the two differ by up to ~5% either way within one run (the
  GPU's clock), and the lower one makes every bound below the more favourable to stofc, so
  a target the table calls out of reach is out of reach at either figure;
* ``budget``: ``Flex / target - rest``, the most attention may take for the target to hold;
* ``attention free``: ``Flex / rest``, the ratio with attention costing nothing. Below the
  target, no attention kernel can meet it;
* ``at the dense rate``: the ratio with attention running at the best rate per allowed
  element that this run measured on a dense-class mask: the causal package's attention
  and ORT's fused attention (cuDNN flash on every element; a mask reaches ORT only as a
  bias), whichever is faster, scaled by the mask's allowed elements. Below the target, the
  target needs sparse attention faster per allowed element than those dense kernels;
* ``needs``: the rate per allowed element the budget asks for, against that dense rate.

Allowed elements come from each layer group's mask spec (the package's own, recorded in
the run's ``mask`` step rows) encoded at the point's length; FLOPs are ``4 * head_dim``
per allowed element, per head, batch row and layer (the model's shape: :data:`SHAPES`).
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

from e2e_tables import _fmt

SHAPES = {"bert32k": (12, 64)}
"""model -> (heads, head_dim) of its attention (bench/e2e_long_models.py's configs)."""


@cache
def allowed_per_head(spec_json: str, seq_len: int) -> int:
    """Allowed (query, key) pairs of one head at ``seq_len`` for a MASKS.md spec document."""
    from stofc.masks import encode
    from stofc.masks.parse import parse_yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mask.yaml"
        path.write_text(spec_json)          # JSON is YAML
        fmt = encode(parse_yaml(path), seq_len)
    return fmt.nnz // fmt.num_heads


def attention_tflop(groups: list[dict], model: str, b: int, s: int) -> float | None:
    """TFLOP of one run's attention over every layer group, or None for an unknown shape."""
    if model not in SHAPES:
        return None
    heads, head_dim = SHAPES[model]
    elements = sum(len(g["layers"]) * allowed_per_head(json.dumps(g["spec"], sort_keys=True), s)
                   for g in groups)
    return 4 * head_dim * heads * b * elements / 1e12


def _index(rows: list[dict]):
    times, prof, masks = {}, {}, {}
    for r in rows:
        kind = r.get("kind")
        if kind == "time" and not r.get("graph"):
            times[(r["impl"], r["model"], r.get("mask"), r["B"], r["S"])] = r["ms"]
        elif kind == "profile":
            prof[(r["impl"], r["model"], r.get("mask"), r["B"], r["S"])] = r
        elif kind == "step" and r.get("step") == "mask":
            masks[(r["model"], r["mask"])] = r["groups"]
    return times, prof, masks


def dense_rate(rows: list[dict], model: str, b: int, s: int, index=None
               ) -> tuple[float, str] | None:
    """(TFLOP/s per allowed element, which kernel) of the faster of the causal package's
    attention and ORT's dense attention at the point, from the run's profiles (``index``:
    :func:`_index` of ``rows`` when the caller has it)."""
    _, prof, masks = index or _index(rows)
    best = None
    causal = prof.get(("stofc", model, "causal", b, s))
    if causal and (model, "causal") in masks and causal.get("attention_ms"):
        work = attention_tflop(masks[(model, "causal")], model, b, s)
        if work:
            best = (work / (causal["attention_ms"] / 1e3), "stofc causal")
    ort = prof.get(("ort", model, None, b, s))
    if ort and model in SHAPES and ort.get("attention_ms"):
        layers = max((sum(len(g["layers"]) for g in groups)
                      for (m, _), groups in masks.items() if m == model), default=0)
        if layers:
            heads, head_dim = SHAPES[model]
            rate = 4 * head_dim * heads * b * s * s * layers / 1e12 / (ort["attention_ms"] / 1e3)
            if best is None or rate > best[0]:
                best = (rate, "ORT dense (cuDNN)")
    return best


def bound_rows(rows: list[dict], targets) -> list[dict]:
    """One dict per point with a Flex target and the three measurements it needs."""
    index = _index(rows)
    times, prof, masks = index
    out = []
    for (impl, model, mask, b, s), p in sorted(prof.items(), key=lambda kv: str(kv[0])):
        want = (targets(model, mask, b, s) or {}).get("Flex") if impl == "stofc" else None
        st, flex = times.get(("stofc", model, mask, b, s)), times.get(("flex", model, mask, b, s))
        if not want or st is None or flex is None or p.get("attention_ms") is None:
            continue
        attn = p["attention_ms"]
        st = min(st, p.get("wall_ms") or st)   # the package's faster measurement (see doc)
        rest = st - attn
        row = dict(model=model, mask=mask, B=b, S=s, target=want, stofc=st, flex=flex,
                   attention=attn, rest=rest, budget=flex / want - rest,
                   free=flex / rest if rest > 0 else None)
        work = attention_tflop(masks.get((model, mask), []), model, b, s) \
            if (model, mask) in masks else None
        dense = dense_rate(rows, model, b, s, index)
        if work and dense:
            rate, which = dense
            row.update(work=work, rate=work / (attn / 1e3), dense=rate, dense_of=which,
                       at_dense=flex / (rest + work / rate * 1e3),
                       needs=work / (row["budget"] / 1e3) if row["budget"] > 0 else None)
        out.append(row)
    return out


def bound_table(rows: list[dict], targets) -> list[str]:
    """Markdown lines of the bound table (none without a profiled point that has a target)."""
    found = bound_rows(rows, targets)
    if not found:
        return []
    lines = ["## What the Flex targets ask of attention (same run: plain medians, profiles)", "",
             "| model | mask | B | L | target | stofc ms | attention ms | rest ms | Flex ms | "
             "attention budget ms | attention free | at the dense rate | attention TF/s now | "
             "needs TF/s | dense rate TF/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    for r in found:
        def x(v):
            return "-" if v is None else f"{v:.2f}x"

        def tf(v):
            return "-" if v is None else f"{v:.0f}"
        budget = _fmt(r["budget"]) if r["budget"] > 0 else f"none ({_fmt(r['budget'])})"
        needs = tf(r.get("needs")) if r["budget"] > 0 else "impossible"
        dense = (f"{tf(r['dense'])} ({r['dense_of']})" if r.get("dense") else "-")
        lines.append(f"| {r['model']} | {r['mask']} | {r['B']} | {r['S']} | {r['target']}x | "
                     f"{_fmt(r['stofc'])} | {_fmt(r['attention'])} | {_fmt(r['rest'])} | "
                     f"{_fmt(r['flex'])} | {budget} | {x(r['free'])} | {x(r.get('at_dense'))} | "
                     f"{tf(r.get('rate'))} | {needs} | {dense} |")
    lines += ["", "stofc ms: the lower of the plain median and the profiled wall time. rest: that "
              "minus the profiled attention (GEMMs, norms, idle and host time). attention "
              "free: Flex over rest, the ratio if attention cost nothing. "
              "at the dense rate: the ratio if the mask's allowed elements ran at the dense "
              "rate, the faster of this run's causal-package and ORT (cuDNN) attention per "
              "allowed element. TF/s count allowed elements only (4 x head_dim FLOPs each). "
              "A target above 'at the dense rate' needs sparse attention faster per allowed "
              "element than the dense kernels; above 'attention free', no attention kernel "
              "reaches it.", ""]
    return lines
