"""The markdown table of a ``bench/mha_hopper.py`` run (no GPU needed).

``python3 bench/mha_table.py RUN.json`` rewrites ``RUN.md`` beside it from the run's rows.
"""

from __future__ import annotations

import json
import os
import sys

TABLE_NOTE = ("stofc TF/s: the fastest correct stofc candidate (the selector's pick or a "
              "ws variant: what `stofc tune` can choose), and the vs columns use it; "
              "selector TF/s: the selector's own pick (an untuned package), same run.")


def selector_tflops(r: dict) -> float | None:
    """The selector's pick's figure in a row (None if it failed or was not correct)."""
    tol = 1e-2 if r["case"].endswith("bf16") else 2e-3
    for c in r.get("stofc", []):
        if c.get("label") == "selector" and "tflops" in c and c["relerr"] <= tol:
            return c["tflops"]
    return None


def table(rows: list[dict]) -> str:
    lines = [TABLE_NOTE, "",
             "| case | mask | density | FA4 TF/s | cuDNN TF/s | SDPA-bool TF/s | Flex TF/s | "
             "stofc TF/s | selector TF/s | stofc config | vs FA4 | vs cuDNN | vs SDPA-bool | "
             "vs Flex |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        sel = selector_tflops(r)
        lines.append(
            f"| {r['case']} | {r['mask']} | {r['density']} | {r.get('fa4_tflops', '-')} | "
            f"{r.get('cudnn_tflops', '-')} | {r.get('sdpa_bool_tflops', '-')} | "
            f"{r.get('flex_tflops', '-')} | {r.get('stofc_tflops', '-')} | "
            f"{'-' if sel is None else sel} | "
            f"{r.get('stofc_config', '-')} | {r.get('vs_fa4', '-')} | {r.get('vs_cudnn', '-')} | "
            f"{r.get('vs_sdpa_bool', '-')} | {r.get('vs_flex', '-')} |")
    paired = [r for r in rows if "paired" in r]
    if paired:
        lines += ["", "Paired (`--paired`): FA4, the selector's pick and the fastest candidate "
                  "timed in turn; medians in ms.", "",
                  "| case | mask | rounds | FA4 ms | stofc ms (fastest of the two) | vs FA4 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in paired:
            p = r["paired"]
            med = p["median_ms"]
            ours = min(v for k, v in med.items() if k != "fa4")
            lines.append(f"| {r['case']} | {r['mask']} | {p['rounds']} | {med['fa4']:.4f} | "
                         f"{ours:.4f} | {p['vs_fa4']} |")
    return "\n".join(lines)


def main(path: str) -> int:
    with open(path) as f:
        saved = json.load(f)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(f"# {saved['meta']}\n\n{table(saved['rows'])}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
