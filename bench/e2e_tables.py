"""The markdown tables of ``bench/e2e.py`` from its JSONL rows, and a self-check without a GPU.

Rows (``kind``): ``time`` (impl stofc | ort | flex, ``graph`` bool, model, mask (None for
ORT: its time holds for every mask), B, S, ms), ``refused`` / ``error`` / ``skip`` (same
keys, the reason in ``err`` / ``why``), ``verify``, ``env``, ``step``, ``done``.

Three tables: plain sessions; CUDA graphs (ORT ``enable_cuda_graph``, stofc the same,
torch.compile ``mode="reduce-overhead"``; where ORT refused capture, the ratio is taken
against ORT's plain time and says so); and the best of each side. Each row states
whether the issue-7 target (>= 1.5x faster than both ORT optimized and torch.compile +
FlexAttention) is met.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

TARGET = 1.5  # TARGETS.md / issue 7: >= 1.5x faster than both, same run


def _num(v) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool)


def _fmt(ms) -> str:
    return f"{ms:.3f}" if _num(ms) else "-"


def _ratio(other, ms, tag: str = "") -> str:
    return f"{other / ms:.2f}x{tag}" if _num(other) and _num(ms) else "-"


def verdict(ms, others: dict[str, float | None]) -> str:
    """'met', 'MISSED (vs X)' or 'open (no X)' for stofc's ``ms`` against ``others``."""
    if not _num(ms):
        return "not measured"
    missing = [k for k, v in others.items() if not _num(v)]
    missed = [k for k, v in others.items() if k not in missing and v / ms < TARGET]
    if missed:
        return "MISSED (" + ", ".join(f"vs {k}" for k in missed) + ")"
    if missing:
        return "open (no " + ", ".join(missing) + ")"
    return "met"


class _Cells:
    """Times and reasons keyed by (impl, graph, model, mask, B, S); numbered footnotes."""

    def __init__(self, rows: list[dict]) -> None:
        self.times: dict[tuple, float] = {}
        self.notes: dict[tuple, str] = {}
        self.footnotes: dict[str, int] = {}
        self.points: list[tuple] = []
        for r in rows:
            if r.get("kind") not in ("time", "refused", "skip", "error") or "B" not in r \
                    or "impl" not in r:
                continue
            key = (r["impl"], bool(r.get("graph")), r["model"], r.get("mask"), r["B"], r["S"])
            if r["kind"] == "time":
                self.times[key] = r["ms"]
                if r.get("cudagraph_skips"):
                    self.notes[key] = (f"ran without CUDA graphs: inductor skipped them "
                                       f"{r['cudagraph_skips']} time(s)")
            else:
                self.notes.setdefault(key, f"{r['kind']}: {r.get('err') or r.get('why', '')}")
            point = (r["model"], r.get("mask"), r["B"], r["S"])
            if r.get("mask") and point not in self.points:
                self.points.append(point)

    def has(self, impl, graph, model, mask, b, s) -> bool:
        key = (impl, graph, model, mask, b, s)
        return key in self.times or key in self.notes

    def get(self, impl, graph, model, mask, b, s) -> tuple[float | None, str]:
        key = (impl, graph, model, mask, b, s)
        if key in self.notes:
            text = f"{impl}{' (CUDA graph)' if graph else ''}: {self.notes[key]}"
            n = self.footnotes.setdefault(text, len(self.footnotes) + 1)
            if key in self.times:  # measured, with a caveat
                return self.times[key], f"{_fmt(self.times[key])} [{n}]"
            return None, f"{self.notes[key].split(':')[0]} [{n}]"
        if key in self.times:
            return self.times[key], _fmt(self.times[key])
        return None, "-"


def _cases(verify_row: dict) -> str:
    errors = verify_row.get("report", {}).get("errors", [])
    return " ".join(sorted({f"({e['batch']}, {e['seq_len']})" for e in errors})) or "-"


def _header(names: tuple[str, ...]) -> list[str]:
    return ["| model | mask | B | L | " + " | ".join(names) + f" | target >= {TARGET}x |",
            "|" + " --- |" * (len(names) + 5)]


def write_tables(rows: list[dict], out: Path) -> str:
    """Write ``e2e-table.md`` and ``e2e.json`` under ``out`` from ``rows``; return the md."""
    c = _Cells(rows)
    env = next((r for r in rows if r.get("kind") == "env"), {})
    lines = [f"# End to end: stofc vs ORT optimized vs torch.compile + FlexAttention "
             f"({env.get('gpu')})", "",
             f"onnxruntime {env.get('onnxruntime')}, torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}. Median ms. Target (issue 7, TARGETS.md): >= {TARGET}x "
             "faster than both ORT optimized and torch.compile + FlexAttention, same run. "
             "ORT's time is dense attention (a structured mask reaches it only as a dense "
             "bias): one figure per model and shape.", ""]

    plain = [p for p in c.points if c.has("stofc", False, *p) or c.has("flex", False, *p)]
    if plain:
        lines += ["## Plain sessions", ""]
        lines += _header(("stofc ms", "ORT ms", "Flex ms", "vs ORT", "vs Flex"))
        for m, mask, b, s in plain:
            st, st_c = c.get("stofc", False, m, mask, b, s)
            o, o_c = c.get("ort", False, m, None, b, s)
            f, f_c = c.get("flex", False, m, mask, b, s)
            lines.append(f"| {m} | {mask} | {b} | {s} | {st_c} | {o_c} | {f_c} | "
                         f"{_ratio(o, st)} | {_ratio(f, st)} | {verdict(st, {'ORT': o, 'Flex': f})} |")
        lines.append("")

    graph = [p for p in c.points if c.has("stofc", True, *p) or c.has("flex", True, *p)]
    if graph:
        lines += ["## CUDA graphs (ORT enable_cuda_graph, one session per shape; "
                  "torch.compile mode=reduce-overhead)", ""]
        lines += _header(("stofc graph ms", "ORT graph ms", "Flex r-o ms", "vs ORT graph",
                          "vs Flex r-o"))
        for m, mask, b, s in graph:
            st, st_c = c.get("stofc", True, m, mask, b, s)
            o, o_c = c.get("ort", True, m, None, b, s)
            tag = ""
            if o is None and _num(c.times.get(("ort", False, m, None, b, s))):
                o, tag = c.times[("ort", False, m, None, b, s)], " (ORT plain)"
            f, f_c = c.get("flex", True, m, mask, b, s)
            lines.append(f"| {m} | {mask} | {b} | {s} | {st_c} | {o_c} | {f_c} | "
                         f"{_ratio(o, st, tag)} | {_ratio(f, st)} | "
                         f"{verdict(st, {'ORT': o, 'Flex': f})} |")
        lines.append("")

    if graph:
        lines += ["## Best of each side (plain or graph, whichever is faster)", ""]
        lines += _header(("stofc ms", "ORT ms", "Flex ms", "vs ORT", "vs Flex"))
        for m, mask, b, s in plain + [p for p in graph if p not in plain]:
            best = {}
            for impl, key_mask in (("stofc", mask), ("ort", None), ("flex", mask)):
                cand = [(c.times[k], "graph" if g else "plain") for g in (False, True)
                        if _num(c.times.get(k := (impl, g, m, key_mask, b, s)))]
                best[impl] = min(cand) if cand else (None, "")
            cells = [f"{_fmt(v)} ({how})" if _num(v) else "-" for v, how in best.values()]
            st, o, f = (best[i][0] for i in ("stofc", "ort", "flex"))
            lines.append(f"| {m} | {mask} | {b} | {s} | {' | '.join(cells)} | {_ratio(o, st)} | "
                         f"{_ratio(f, st)} | {verdict(st, {'ORT': o, 'Flex': f})} |")
        lines.append("")

    verify = [r for r in rows if r.get("kind") == "verify"]
    if verify:
        lines += ["## verify_package (vs the fp32 original with the same mask injected, "
                  "bound 1e-2)", "",
                  "| model | mask | provider | cases | passed | rel. error | mask effect | "
                  "compile s |", "|" + " --- |" * 8]
        lines += [f"| {r['model']} | {r['mask']} | {r.get('report', {}).get('provider')} | "
                  f"{_cases(r)} | {r['passed']} | {r['rel']:.2e} | {r['mask_effect']:.2e} | "
                  f"{r.get('compile_s')} |" for r in verify]
        lines.append("")
    graph_checks = [r for r in rows if r.get("kind") == "time" and "vs_plain_rel" in r]
    if graph_checks:
        worst = max(graph_checks, key=lambda r: r["vs_plain_rel"])
        lines += [f"CUDA-graph outputs vs the same session kind without graphs: worst rel. "
                  f"difference {worst['vs_plain_rel']:.2e} ({worst['impl']}, {worst['model']}, "
                  f"{worst.get('mask') or 'ORT'}, ({worst['B']}, {worst['S']})).", ""]
    if c.footnotes:
        lines += ["Notes:", ""] + [f"{n}. {t}" for t, n in c.footnotes.items()] + [""]
    other = [r for r in rows if r.get("kind") in ("skip", "error") and "B" not in r]
    if other:
        lines += ["Not run or failed (whole steps):", ""]
        lines += [f"- {r['kind']} {r.get('step', '')} {r.get('model', '')} {r.get('mask') or ''}: "
                  f"{r.get('err') or r.get('why', '')}" for r in other]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e-table.md").write_text(text)
    (out / "e2e.json").write_text(json.dumps(rows, indent=1))
    return text


# ----------------------------------------------------------------------------- self-check

def _synthetic_rows() -> list[dict]:
    t = dict(kind="time", model="bert")
    return [
        dict(kind="env", gpu="TEST GPU", onnxruntime="x", torch="y", transformers="z"),
        dict(t, impl="ort", mask=None, graph=False, B=1, S=128, ms=3.0),
        dict(kind="refused", model="bert", impl="ort", mask=None, graph=True, B=1, S=128,
             err="Fail: graph capture needs every node on the CUDA EP"),
        dict(t, impl="stofc", mask="bigbird", graph=False, B=1, S=128, ms=1.0),
        dict(t, impl="flex", mask="bigbird", graph=False, B=1, S=128, ms=2.0),
        dict(t, impl="stofc", mask="bigbird", graph=True, B=1, S=128, ms=0.5, vs_plain_rel=1e-4),
        dict(t, impl="flex", mask="bigbird", graph=True, B=1, S=128, ms=0.6, cudagraph_skips=1),
        dict(t, impl="stofc", mask="causal", graph=False, B=1, S=128, ms=1.2),
        dict(kind="skip", model="bert", impl="flex", mask="causal", graph=False, B=1, S=128,
             why="deadline: 3 s left"),
        dict(kind="verify", model="bert", mask="bigbird", passed=True, rel=2e-3,
             mask_effect=0.02, compile_s=9.0, report=dict(provider="cuda", errors=[
                 dict(batch=2, seq_len=512)])),
        dict(kind="skip", step="package", model="gpt2", mask="longformer",
             why="deadline: 40 s left, step needs ~60 s"),
    ]


def _check_tables() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        text = write_tables(_synthetic_rows(), Path(tmp))
        assert (Path(tmp) / "e2e-table.md").read_text() == text
        assert len(json.loads((Path(tmp) / "e2e.json").read_text())) == len(_synthetic_rows())
    lines = text.splitlines()
    plain = lines.index("## Plain sessions")
    graph = next(i for i, ln in enumerate(lines) if ln.startswith("## CUDA graphs"))
    best = lines.index("## Best of each side (plain or graph, whichever is faster)")
    row = lines[plain + 4]
    assert row == "| bert | bigbird | 1 | 128 | 1.000 | 3.000 | 2.000 | 3.00x | 2.00x | met |", row
    row = lines[plain + 5]
    assert row.startswith("| bert | causal | 1 | 128 | 1.200 | 3.000 | skip [") and \
        row.endswith("| 2.50x | - | open (no Flex) |"), row
    row = lines[graph + 4]
    assert row.startswith("| bert | bigbird | 1 | 128 | 0.500 | refused [") and \
        row.endswith("| 0.600 [3] | 6.00x (ORT plain) | 1.20x | MISSED (vs Flex) |"), row
    assert "3. flex (CUDA graph): ran without CUDA graphs: inductor skipped them 1 time(s)" in lines
    row = lines[best + 4]
    assert row == ("| bert | bigbird | 1 | 128 | 0.500 (graph) | 3.000 (plain) | 0.600 (graph) | "
                   "6.00x | 1.20x | MISSED (vs Flex) |"), row
    assert any("graph capture needs every node on the CUDA EP" in ln for ln in lines)
    assert any("deadline: 3 s left" in ln for ln in lines)
    assert "- skip package gpt2 longformer: deadline: 40 s left, step needs ~60 s" in lines
    assert "| bert | bigbird | cuda | (2, 512) | True | 2.00e-03 | 2.00e-02 | 9.0 |" in lines
    assert verdict(1.0, {"ORT": 1.49, "Flex": 9.0}) == "MISSED (vs ORT)"
    assert verdict(1.0, {"ORT": 1.5, "Flex": 1.5}) == "met"
    print("tables: ok")


def _check_masks(work: Path) -> None:
    """Each package's extracted mask against MASKS.md's predicate (AND causal for GPT-2)."""
    from e2e_models import package_dense_mask

    from stofc.masks import predicate

    packages = sorted(p.parent for p in work.glob("**/plan.json"))
    if not packages:
        print(f"masks: no compiled packages under {work}; skipped")
    for pkg in packages:
        doc = json.loads((pkg / "plan.json").read_text())
        dense = package_dense_mask(pkg)
        n = dense.shape[0]
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        want = np.broadcast_to(predicate(doc["mask"]["spec"], n).allowed(q, k), (n, n))
        if doc["mask"]["causal_from_model"]:
            want = want & (q >= k)
        assert dense.shape == (n, n) and dense.dtype == bool
        assert np.array_equal(dense, want), f"{pkg}: {int((dense != want).sum())} cells differ"
        print(f"masks: {pkg.parent.name}/{pkg.name}: L={n} density {dense.mean():.4f} causal_from_model="
              f"{doc['mask']['causal_from_model']} upper-triangle cells "
              f"{int(np.triu(dense, 1).sum())}: ok")


def selftest(work: Path) -> None:
    """The table writer on synthetic rows; the mask extraction on packages under ``work``."""
    _check_tables()
    _check_masks(work)
