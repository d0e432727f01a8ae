"""Tables and plot of ``bench/e2e_long.py`` from its JSONL rows (no GPU needed).

Rows (``kind``): ``time`` (impl stofc | ort | flex | sdpa | fa4; ``graph`` bool; model,
mask (None for ORT: one figure per model and shape, whatever the mask), B, S, ms; optional
``mem_mib`` (peak device memory of that side), ``rounds`` (per-round medians of the short
points), ``vs_stofc_rel``, ``vs_plain_rel``, ``compile_s``); ``refused`` / ``error`` /
``skip`` / ``na`` (same keys, the reason in ``err`` / ``why``); ``verify``, ``check``,
``profile``, ``step``, ``env``, ``done``.

Written under ``out``: ``STEM.md`` (tables), ``STEM.json`` (all rows) and ``STEM.png``
(speed-up against length, B=1; peak memory against length) where STEM is
``e2e-long-<gpu>-<date>`` unless given.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from e2e_long_bounds import bound_table
from e2e_tables import _fmt, _num, _ratio

TORCH = ("flex", "fa4", "sdpa")
SHORT_TARGET = 1.0


def targets(model: str, mask: str | None, b: int, s: int) -> dict[str, float] | None:
    """Issue 18's targets at a point: {'ORT': x, 'Flex': y} (speed-up at least), or None."""
    if model != "bert32k":
        return None
    if (b, s) in ((1, 128), (8, 512)):
        return {"ORT": SHORT_TARGET}
    if (b, s) in ((1, 8192), (1, 16384)):
        if mask == "causal":
            return {"ORT": 1.5, "Flex": 1.1}
        if mask in ("longformer", "bigbird"):
            return {"ORT": 2.5, "Flex": 2.0}
    return None                      # e.g. dilated: measured, no issue target


def short_of(ratio: float, target: float) -> str:
    """``ratio`` (below ``target``) with two decimals, or as many more (up to six, then cut
    rather than rounded) as it takes not to print the target itself: 2.4961 against 2.5
    reads 2.496, not 2.50."""
    for digits in range(2, 7):
        text = f"{ratio:.{digits}f}"
        if float(text) < target:
            return text
    return f"{math.floor(ratio * 1e6) / 1e6:.6f}"


def verdict(st, others: dict[str, float | None], want: dict[str, float] | None) -> str:
    """'met', 'MISSED (vs X: r)' or 'open (no X)' for stofc's ``st`` ms; '-' without target."""
    if not want:
        return "-"
    if not _num(st):
        return "not measured"
    missing = [k for k in want if not _num(others.get(k))]
    missed = [f"vs {k} {short_of(others[k] / st, v)}x < {v}x" for k, v in want.items()
              if k not in missing and others[k] / st < v]
    if missed:
        return "MISSED (" + ", ".join(missed) + ")"
    return "open (no " + ", ".join(missing) + ")" if missing else "met"


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; unknown names slugged whole."""
    if not name:
        return "gpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


class Cells:
    """Rows indexed by (impl, graph, model, mask, B, S); footnotes numbered as used."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows: dict[tuple, dict] = {}
        self.notes: dict[tuple, str] = {}
        self.footnotes: dict[str, int] = {}
        self.points: list[tuple] = []
        for r in rows:
            if r.get("kind") not in ("time", "refused", "error", "skip", "na") or "B" not in r \
                    or "impl" not in r:
                continue
            key = (r["impl"], bool(r.get("graph")), r["model"], r.get("mask"), r["B"], r["S"])
            if r["kind"] == "time":
                self.rows[key] = r
            else:
                self.notes.setdefault(key, f"{r['kind']}: {r.get('err') or r.get('why', '')}")
            point = (r["model"], r.get("mask"), r["B"], r["S"])
            if r.get("mask") is not None and point not in self.points:
                self.points.append(point)
        self.points.sort(key=lambda p: (p[0], p[1], p[3], p[2]))

    def ms(self, impl, graph, model, mask, b, s):
        r = self.rows.get((impl, graph, model, mask, b, s))
        return r["ms"] if r else None

    def mem(self, impl, model, mask, b, s):
        r = self.rows.get((impl, False, model, mask, b, s))
        return r.get("mem_mib") if r else None

    def cell(self, impl, graph, model, mask, b, s) -> str:
        key = (impl, graph, model, mask, b, s)
        if key in self.notes and key not in self.rows:
            where = model if mask is None else f"{model}/{mask}"
            n = self.note(f"{impl}{' (CUDA graph)' if graph else ''}, {where} at ({b}, {s}): "
                          f"{self.notes[key]}")
            return f"{self.notes[key].split(':')[0]} [{n}]"
        return _fmt(self.ms(*key))

    def note(self, text: str) -> int:
        return self.footnotes.setdefault(text, len(self.footnotes) + 1)

    def has(self, impl, graph, model, mask, b, s) -> bool:
        key = (impl, graph, model, mask, b, s)
        return key in self.rows or key in self.notes


def _mib(v) -> str:
    return f"{v:,.0f}" if _num(v) else "-"


def _header(cols: list[str]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]


def main_table(c: Cells) -> list[str]:
    cols = ["model", "mask", "B", "L", "stofc ms", "ORT ms", "Flex ms", "FA4 ms", "SDPA ms",
            "vs ORT", "vs Flex", "stofc MiB", "ORT MiB", "Flex MiB", "target"]
    lines = ["## Plain sessions (median ms; peak device memory per side)", "", *_header(cols)]
    for m, mask, b, s in c.points:
        if not any(c.has(i, False, m, mask, b, s) for i in ("stofc", *TORCH)):
            continue
        st, o, f = (c.ms("stofc", False, m, mask, b, s), c.ms("ort", False, m, None, b, s),
                    c.ms("flex", False, m, mask, b, s))
        cells = [c.cell("stofc", False, m, mask, b, s), c.cell("ort", False, m, None, b, s)]
        cells += [c.cell(i, False, m, mask, b, s) for i in TORCH]
        mems = [_mib(c.mem("stofc", m, mask, b, s)), _mib(c.mem("ort", m, None, b, s)),
                _mib(c.mem("flex", m, mask, b, s))]
        lines.append(f"| {m} | {mask} | {b} | {s} | " + " | ".join(cells) + f" | {_ratio(o, st)} | "
                     f"{_ratio(f, st)} | " + " | ".join(mems) + " | "
                     f"{verdict(st, {'ORT': o, 'Flex': f}, targets(m, mask, b, s))} |")
    return [*lines, ""]


def _rounds(r: dict | None) -> list[float]:
    return list(r.get("rounds") or [r["ms"]]) if r else []


def short_table(c: Cells) -> list[str]:
    """Plain and CUDA-graph rows at the short points, with the same-call rounds."""
    out = []
    for graph in (False, True):
        pts = [p for p in c.points if c.has("stofc", graph, *p) and (graph or len(
            _rounds(c.rows.get(("stofc", False, *p)))) > 1)]
        for m, mask, b, s in pts:
            sr = c.rows.get(("stofc", graph, m, mask, b, s))
            orow = c.rows.get(("ort", graph, m, None, b, s))
            tag = ""
            if graph and orow is None:
                orow, tag = c.rows.get(("ort", False, m, None, b, s)), " (ORT plain)"
            fr = c.rows.get(("flex", graph, m, mask, b, s))
            ratios = [o / x for o, x in zip(_rounds(orow), _rounds(sr), strict=False)]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)})" if ratios else "-"
            st, o = (sr or {}).get("ms"), (orow or {}).get("ms")
            want = targets(m, mask, b, s)
            out.append(f"| {m} | {mask} | {b} | {s} | {'graph' if graph else 'plain'} | "
                       f"{c.cell('stofc', graph, m, mask, b, s)} | "
                       f"{c.cell('ort', graph, m, None, b, s)} | "
                       f"{_fmt((fr or {}).get('ms'))} | {_ratio(o, st, tag)} | {spread} | "
                       f"{verdict(st, {'ORT': o}, want)} |")
    if not out:
        return []
    head = ["## Short inputs: plain sessions and CUDA graphs, same-call rounds", "",
            "ORT enable_cuda_graph and stofc the same (one session per shape), "
            "torch.compile mode=reduce-overhead. Each round times every side once more; "
            "'per round' is the spread of the rounds' ORT/stofc ratios.", ""]
    cols = ["model", "mask", "B", "L", "sessions", "stofc ms", "ORT ms", "Flex ms", "vs ORT",
            "per round", f"target >= {SHORT_TARGET}x"]
    return [*head, *_header(cols), *out, ""]


def long_row_table(c: Cells) -> list[str]:
    """The longest point of each model at batch 1: runs, and peak memory against ORT's."""
    out = []
    for m in dict.fromkeys(p[0] for p in c.points):
        s = max((p[3] for p in c.points if p[0] == m and p[2] == 1), default=None)
        if s is None:
            continue
        o_mem, o_note = c.mem("ort", m, None, 1, s), c.notes.get(("ort", False, m, None, 1, s))
        for mask in dict.fromkeys(p[1] for p in c.points if p[0] == m and p[3] == s):
            st = c.rows.get(("stofc", False, m, mask, 1, s))
            if st is None:
                why = c.notes.get(("stofc", False, m, mask, 1, s), "not run")
                out.append(f"| {m} | {mask} | {s} | no: {why[:120]} | - | - | - |")
                continue
            mem = st.get("mem_mib")
            ort_failed = o_note is not None and o_note.startswith("error")
            ort = _mib(o_mem) if _num(o_mem) else o_note[:160] if o_note else "-"
            if _num(mem) and _num(o_mem):
                ok = "yes" if mem < o_mem else "NO"
            else:
                ok = "yes (ORT failed)" if ort_failed and not _num(o_mem) else "open"
            out.append(f"| {m} | {mask} | {s} | yes ({_fmt(st['ms'])} ms) | {_mib(mem)} | {ort} | "
                       f"{ok} |")
    if not out:
        return []
    head = ["## Longest input at batch 1: runs, peak memory below ORT's dense run", ""]
    cols = ["model", "mask", "L", "stofc runs", "stofc MiB", "ORT MiB",
            "below ORT (or ORT cannot run)"]
    return [*head, *_header(cols), *out, ""]


def check_tables(rows: list[dict]) -> list[str]:
    lines = []
    verify = [r for r in rows if r.get("kind") == "verify"]
    checks = [r for r in rows if r.get("kind") == "check"]
    if verify or checks:
        lines += ["## Correctness", "",
                  "verify: `verify_package` (on the CUDA EP) vs the fp32 original with the mask "
                  "injected (ORT CPU EP); check: the package vs the same model in fp32 torch "
                  "with FlexAttention and the package's own masks, on the GPU (long inputs).",
                  "", *_header(["model", "mask", "how", "(B, L)", "passed", "rel. error",
                                "bound"])]
        for r in verify:
            cases = sorted({(e["batch"], e["seq_len"]) for e in
                            r.get("report", {}).get("errors", [])})
            provider = r.get("report", {}).get("provider", "cuda")
            lines.append(f"| {r['model']} | {r['mask']} | verify ({provider}) | "
                         f"{' '.join(map(str, cases)) or '-'} | {r['passed']} | "
                         f"{r['rel']:.2e} | {r.get('bound', 1e-2):g} |")
        for r in checks:
            lines.append(f"| {r['model']} | {r['mask']} | check (fp32 torch) | ({r['B']}, "
                         f"{r['S']}) | {r['passed']} | {r['rel']:.2e} | {r['bound']:g} |")
        lines.append("")
    graph = [r for r in rows if r.get("kind") == "time" and "vs_plain_rel" in r]
    if graph:
        w = max(graph, key=lambda r: r["vs_plain_rel"])
        lines += [f"CUDA-graph outputs vs plain sessions: worst rel. difference "
                  f"{w['vs_plain_rel']:.2e} ({w['impl']}, {w['model']}, {w.get('mask') or 'ORT'}, "
                  f"({w['B']}, {w['S']})).", ""]
    torch_rows = [r for r in rows if r.get("kind") == "time" and "vs_stofc_rel" in r]
    if torch_rows:
        w = max(torch_rows, key=lambda r: r["vs_stofc_rel"])
        lines += [f"torch sides vs the stofc package on the same tokens: worst rel. difference "
                  f"{w['vs_stofc_rel']:.2e} ({w['impl']}, {w['model']}, {w['mask']}, "
                  f"({w['B']}, {w['S']})).", ""]
    return lines


def profile_table(rows: list[dict]) -> list[str]:
    prof = [r for r in rows if r.get("kind") == "profile"]
    if not prof:
        return []
    lines = ["## Where the GPU time goes (CUPTI through torch.profiler, ms per run)", ""]
    lines += _header(["model", "mask", "B", "L", "side", "attention", "GEMMs", "rest",
                      "GPU busy", "idle: host / device", "wall"])
    foreign = []
    for r in prof:
        tl = r.get("timeline") or {}
        idle = (f"{_fmt(tl['host_gap'])} / {_fmt(tl['device_gap'])}" if "host_gap" in tl
                else "-")
        side = r["impl"]
        if r.get("foreign_names"):
            foreign.append(r)
            side += " (names!)"
        lines.append(f"| {r['model']} | {r.get('mask') or '-'} | {r['B']} | {r['S']} | "
                     f"{side} | {_fmt(r['attention_ms'])} | {_fmt(r['gemm_ms'])} | "
                     f"{_fmt(r['other_ms'])} | {_fmt(r['gpu_busy_ms'])} | {idle} | "
                     f"{_fmt(r['wall_ms'])} |")
    lines += ["", "idle: the gaps between a run's GPU activities, 'host' where the next launch "
              "call ended after the GPU went idle (the GPU waited for the host), 'device' "
              "where it was queued (the GPU's own turnaround)."]
    for r in foreign:
        lines += ["", f"names!: the profile of {r['model']}/{r.get('mask')} at ({r['B']}, "
                  f"{r['S']}) recorded kernels this package does not define "
                  f"({', '.join(r['foreign_names'])}): CUPTI named a kernel after a function "
                  "another package loaded in the same process, so its attention / GEMM / rest "
                  "split is not to be trusted (GPU busy, idle and wall stand)."]
    return [*lines, ""]


def model_notes(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r.get("kind") == "step" and r.get("step") == "left_to_ort":
            left = "; ".join(f"{e['reason']} ({e['nodes']} nodes)" for e in r["left"]) or "nothing"
            lines.append(f"- {r['model']}: left to ONNX Runtime: {left}")
        if r.get("kind") == "step" and r.get("step") == "baseline_ops":
            ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
            lines.append(f"- {r['model']}: ORT optimizer (model type {r['model_type']}) left: {ops}")
    return (["## Models", "", *lines, ""]) if lines else []


def write_tables(rows: list[dict], out: Path, stem: str | None = None, *,
                 draw: bool = True) -> str:
    """Write STEM.md, STEM.json and (``draw``) STEM.png under ``out``; return the markdown."""
    env = next((r for r in rows if r.get("kind") == "env"), {})
    stem = stem or default_stem(rows)
    c = Cells(rows)
    lines = [f"# Long-context end to end: stofc vs ORT optimized vs torch.compile ({env.get('gpu')})",
             "", f"onnxruntime {env.get('onnxruntime')}, torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}; {env.get('date', '')}. ORT's time is dense attention (a "
             "structured mask reaches it only as a dense bias): one figure per model and shape. "
             "Targets (issue 18, BERT-base 32K): (1, 8192) and (1, 16384) >= 2.5x ORT and "
             ">= 2x Flex (Longformer, BigBird), >= 1.5x ORT and >= 1.1x Flex (causal); short "
             "points >= 1.0x ORT, plain and CUDA graphs.", ""]
    lines += main_table(c) + short_table(c) + long_row_table(c) + check_tables(rows)
    lines += profile_table(rows) + bound_table(rows, targets) + model_notes(rows)
    if c.footnotes:
        lines += ["Notes:", ""] + [f"{n}. {t}" for t, n in c.footnotes.items()] + [""]
    other = [r for r in rows if r.get("kind") in ("skip", "error", "na") and "B" not in r]
    if other:
        lines += ["Not run or failed (whole steps):", ""]
        lines += [f"- {r['kind']} {r.get('step', '')} {r.get('model', '')} {r.get('mask') or ''}"
                  f"{' ' + r['impl'] if r.get('impl') else ''}: {r.get('err') or r.get('why', '')}"
                  for r in other] + [""]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    try:
        if draw:
            plot(rows, out / f"{stem}.png")
    except ImportError as err:  # the tables stand; --table-from redraws it elsewhere
        print(f"plot skipped: {err}")
    return text


def default_stem(rows: list[dict]) -> str:
    env = next((r for r in rows if r.get("kind") == "env"), {})
    return f"e2e-long-{gpu_slug(env.get('gpu'))}-{env.get('date', 'undated')}"


def plot(rows: list[dict], path: Path) -> Path | None:
    """Speed-up against length at batch 1 (vs ORT solid, vs Flex dashed, one colour per
    model and mask) and peak device memory against length (stofc vs ORT). None if no point."""
    c = Cells(rows)
    series: dict[tuple, dict[str, list]] = {}
    for m, mask, b, s in c.points:
        st = c.ms("stofc", False, m, mask, b, s)
        if b != 1 or not _num(st):
            continue
        d = series.setdefault((m, mask), {"ort": [], "flex": [], "mem": [], "ort_mem": []})
        for side, key in (("ort", None), ("flex", mask)):
            other = c.ms(side, False, m, key, b, s)
            if _num(other):
                d[side].append((s, other / st))
        if _num(c.mem("stofc", m, mask, b, s)):
            d["mem"].append((s, c.mem("stofc", m, mask, b, s)))
        if _num(c.mem("ort", m, None, b, s)):
            d["ort_mem"].append((s, c.mem("ort", m, None, b, s)))
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, mx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lengths: set[int] = set()
    for i, ((m, mask), d) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
        col = colours[i % len(colours)]
        for side, style in (("ort", "-o"), ("flex", "--s")):
            if d[side]:
                xs, ys = zip(*sorted(d[side]), strict=True)
                lengths.update(xs)
                ax.plot(xs, ys, style, color=col,
                        label=f"{m} {mask} vs {'ORT' if side == 'ort' else 'Flex'}")
        if d["mem"]:
            xs, ys = zip(*sorted(d["mem"]), strict=True)
            lengths.update(xs)
            mx.plot(xs, ys, "-o", color=col, label=f"{m} {mask} stofc")
    for i, m in enumerate(dict.fromkeys(k[0] for k in series)):
        pts = sorted({p for (mm, _), d in series.items() if mm == m for p in d["ort_mem"]})
        if pts:
            xs, ys = zip(*pts, strict=True)
            mx.plot(xs, ys, ":x", color="black" if i == 0 else colours[-1 - i],
                    label=f"{m} ORT (dense)")
    failed = sorted({(m, s) for (impl, _, m, _, b, s), note in c.notes.items()
                     if impl == "ort" and b == 1 and note.startswith("error")
                     and any(k[0] == m for k in series)})
    for m, s in failed:  # ORT could not run this length at all
        lengths.add(s)
        mx.annotate(f"{m}: ORT failed", (s, 1), xycoords=("data", "axes fraction"),
                    xytext=(0, -4), textcoords="offset points", ha="right", va="top",
                    rotation=90, fontsize=7, color="red")
    for a in (ax, mx):
        a.set_xscale("log", base=2)
        a.set_xlabel("sequence length L (batch 1)")
        if lengths:
            a.set_xticks(sorted(lengths))
            a.set_xticklabels([str(x) for x in sorted(lengths)])
        a.legend(fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speed-up of the stofc package (x)")
    mx.set_yscale("log")
    mx.set_ylabel("peak device memory (MiB)")
    env = next((r for r in rows if r.get("kind") == "env"), {})
    fig.suptitle(f"stofc end to end at long inputs ({env.get('gpu')}, {env.get('date', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
