"""How far any attention kernel can take the end-to-end speedup: bounds from measured profiles.

Reads ``bench/profile_e2e.py`` results (one JSON per model and mask: the package's and
ORT's per-kernel GPU time at each (B, L), and both CUDA-graph medians) and, per point:

* ``attn``: the GPU time of stofc's attention kernels, ``ort attn``: ORT's (cuDNN flash,
  dense: a structured mask reaches ORT only as a dense bias);
* ``rest``: everything else each side runs (GEMMs, norms, GELU, embeddings), busy time
  minus attention;
* bound ``p x cuDNN``: the package's CUDA-graph time with its attention replaced by
  ``density x ORT's attention time`` (a sparse kernel exactly as efficient per allowed
  element as cuDNN's dense one, with nothing else changed), and the ratio of ORT's
  CUDA-graph time to it;
* bound ``attention free``: the same with attention costing nothing.

The ratios say which end-to-end targets an attention kernel can reach at all: when
even ``attention free`` stays below a target, only the rest (cuBLASLt GEMMs, norms)
can close it.

Usage: python3 bench/e2e_bounds.py PROFILE.json [...] > bounds.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import MASKS

from stofc.masks import encode, to_dense


def attention_us(profile: dict, stofc: bool) -> float:
    """GPU microseconds per run of one side's attention kernels."""
    def is_attention(name: str) -> bool:
        return name.startswith("stofc_attn") if stofc else ("sdpa" in name or "flash" in name
                                                             or "fmha" in name.lower())
    return sum(t["us"] for t in profile["top"] if is_attention(t["name"]))


def rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    model, mask = data.get("model", "bert"), data["mask"]
    out = []
    for case, row in data["cases"].items():
        b, s = (int(x) for x in case.split("x"))
        density = float(to_dense(encode(MASKS[mask], s)).mean())
        st, ort = row["stofc"]["profile"], row["ort"]["profile"]
        a_s, a_o = attention_us(st, True) / 1e3, attention_us(ort, False) / 1e3
        graphs = data.get("cuda_graph", {})
        g_s = graphs.get(f"stofc-graph-{case}", {}).get("median_ms")
        g_o = graphs.get(f"ort-graph-{case}", {}).get("median_ms")
        rec = dict(model=model, mask=mask, B=b, L=s, density=density, attn=a_s, ort_attn=a_o,
                   rest=st["gpu_busy_ms"] - a_s, ort_rest=ort["gpu_busy_ms"] - a_o,
                   graph=g_s, ort_graph=g_o)
        if g_s and g_o and a_o:
            rec["now"] = g_o / g_s
            rec["bound_p"] = g_o / (g_s - a_s + density * a_o)
            rec["bound_free"] = g_o / (g_s - a_s)
        out.append(rec)
    return out


def table(recs: list[dict]) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["| model | mask | B | L | density | stofc attn ms | ORT attn ms | stofc rest ms "
             "| ORT rest ms | graph stofc / ORT ms | now | bound p x cuDNN | bound attention free |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        lines.append(
            f"| {r['model']} | {r['mask']} | {r['B']} | {r['L']} | {r['density']:.3f} | "
            f"{f(r['attn'])} | {f(r['ort_attn'])} | {f(r['rest'])} | {f(r['ort_rest'])} | "
            f"{f(r['graph'])} / {f(r['ort_graph'])} | {f(r.get('now'), 2)}x | "
            f"{f(r.get('bound_p'), 2)}x | {f(r.get('bound_free'), 2)}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    recs = [r for p in argv for r in rows(Path(p))]
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
