"""Mask encoder benchmark: encode time and peak memory against the format's own size.

For L_max in (4096, 16384, 32768) and the common families, times
``stofc.masks.encode`` (best of ``--repeat`` runs, one core: the encoder is
single-threaded numpy) and measures its peak Python/numpy allocation with
``tracemalloc`` in a separate run (tracing slows numpy down, so it is not timed).
The target (issue 3): L_max = 32768 encodes in < 2 s with peak memory a small
multiple of the format's bytes. Prints a table; writes
``bench/results/mask_encode-<host-or-cpu>-<date>.json``.

Usage: python bench/mask_encode.py [--lens 4096,16384,32768] [--tile 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from stofc.masks import encode, parse_mask, stats

MASKS = {
    "causal": "causal",
    "sliding_w256_causal": "sliding:window=256,causal=true",
    "sliding_w512": "sliding:window=512",
    "longformer_w256_g2": "longformer:window=256,global=2",
    "bigbird_b64_w3_g2_r3": "bigbird:block=64,window=3,global=2,random=3,seed=0",
    "bigbird_b16_w3_g2_r3": "bigbird:block=16,window=3,global=2,random=3,seed=0",
    "strided_128": "strided:stride=128",
    "dilated_w512_d2": "dilated:window=512,dilation=2",
    "dense": "dense",
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(text: str, seq_len: int, tile: int, repeat: int) -> dict:
    spec = parse_mask(text)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fmt = encode(spec, seq_len, tile=tile)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    tracemalloc.reset_peak()
    encode(spec, seq_len, tile=tile)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    st = stats(fmt)
    return {"spec": text, "seq_len": seq_len, "tile": tile, "seconds": min(times),
            "seconds_all": times, "peak_bytes": peak, "format_bytes": st.format_bytes,
            "bitmap_bytes": st.bitmap_bytes, "peak_over_format": peak / st.format_bytes,
            "density": st.density, "tiles_full": st.tiles_full, "tiles_part": st.tiles_part,
            "tiles_empty": st.tiles_empty, "spec_hash": fmt.spec_hash}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="4096,16384,32768")
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    names = args.masks.split(",")
    rows = []
    header = (f"{'mask':24s} {'L_max':>6s} {'time s':>8s} {'peak MB':>8s} {'format MB':>9s} "
              f"{'peak/fmt':>8s} {'density':>8s} {'full':>7s} {'part':>7s}")
    print(header)
    print("-" * len(header))
    for L in lens:
        for name in names:
            r = measure(MASKS[name], L, args.tile, args.repeat)
            r["name"] = name
            rows.append(r)
            print(f"{name:24s} {L:6d} {r['seconds']:8.3f} {r['peak_bytes'] / 1e6:8.2f} "
                  f"{r['format_bytes'] / 1e6:9.2f} {r['peak_over_format']:8.2f} "
                  f"{r['density']:8.4f} {r['tiles_full']:7d} {r['tiles_part']:7d}", flush=True)
    host = socket.gethostname()
    cpu = cpu_name()
    tag = host if host not in ("", "localhost", "vm") else cpu
    tag = re.sub(r"[^A-Za-z0-9]+", "-", tag).strip("-").lower()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    suffix = "" if args.tile == 64 else f"-t{args.tile}"
    out = Path(args.out) / f"mask_encode-{tag}-{date}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "mask_encode", "date_utc": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "host": host, "cpu": cpu,
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
        "numpy": np.__version__, "tile": args.tile, "repeat": args.repeat,
        "target": "L_max=32768: < 2 s on one core; peak memory a small multiple of format bytes",
        "results": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    slow = [r for r in rows if r["seq_len"] == 32768 and r["seconds"] >= 2.0]
    print(f"\nwrote {out}")
    print("all L_max=32768 encodes < 2 s" if not slow else
          f"over 2 s at L_max=32768: {[r['name'] for r in slow]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
