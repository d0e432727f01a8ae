"""The board's power and clock under a timed run (``bench/power_pair.py``): an
``nvidia-smi`` sampler, its CSV read back, and a run's steady state from both.

No GPU library is imported here, so the parsing and the summary are unit-tested on CPU
(``tests/unit/test_bench_power_log.py``).
"""

from __future__ import annotations

import datetime
import subprocess

FIELDS = "timestamp,power.draw,power.draw.instant,clocks.sm,temperature.gpu,clocks_event_reasons.active"


def start_sampler(path: str) -> subprocess.Popen:
    """nvidia-smi sampling FIELDS every 50 ms into ``path`` (falls back to the fields an
    older driver knows)."""
    fields = FIELDS
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or "Field" in probe.stdout + probe.stderr:
        fields = "timestamp,power.draw,clocks.sm,temperature.gpu"
    with open(path, "w") as out:
        out.write(fields + "\n")
    with open(path, "a") as out:                     # the child keeps its own descriptor
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}",
                                 "--format=csv,noheader,nounits", "-lms", "50"],
                                stdout=out, stderr=subprocess.DEVNULL)


def read_samples(path: str) -> list[dict]:
    """The samples of a ``start_sampler`` file: per line ``t`` (seconds since the epoch, as
    ``time.time()`` on the same machine: nvidia-smi writes local time), each numeric field
    as a float (NaN where the driver wrote ``[N/A]`` or similar) and ``reasons`` (the
    clock-event bitmask as written). Lines cut short (the sampler stopped mid-line) or
    without a readable timestamp are skipped."""
    with open(path) as f:
        lines = f.read().splitlines()
    names = lines[0].split(",")
    rows = []
    for line in lines[1:]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(names):
            continue
        rec: dict = {}
        for n, p in zip(names, parts, strict=True):
            if n == "timestamp":
                try:
                    rec["t"] = datetime.datetime.strptime(p, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                except ValueError:
                    break
            elif n == "clocks_event_reasons.active":
                rec["reasons"] = p
            else:
                try:
                    rec[n] = float(p)
                except ValueError:
                    rec[n] = float("nan")
        if "t" in rec:
            rows.append(rec)
    return rows


def summarize(run: dict, samples: list[dict]) -> dict:
    """The steady state of ``run`` (``t0``/``t1``: its host window in seconds since the
    epoch; ``ms``: per-call ms of each batch, in order): the median of its last half of
    batches, and over the samples inside the window (less its first 0.2 s, the power
    reading's lag) the mean of each numeric field that has values, the energy a call in
    mJ (the instantaneous power where the driver reports it, else the averaged one, times
    the median ms) and the clock-event reasons seen."""
    inside = [s for s in samples if run["t0"] + 0.2 <= s["t"] <= run["t1"]]
    half = sorted(run["ms"][len(run["ms"]) // 2:])
    ms = half[len(half) // 2]
    out = {"ms": round(ms, 4), "batches": len(run["ms"]), "samples": len(inside)}
    for key in ("power.draw", "power.draw.instant", "clocks.sm", "temperature.gpu"):
        vals = [s[key] for s in inside if key in s and s[key] == s[key]]
        if vals:
            out[key] = round(sum(vals) / len(vals), 1)
    power = out.get("power.draw.instant", out.get("power.draw"))
    if power is not None:
        out["mJ_per_call"] = round(power * ms, 2)          # W x ms = mJ
    out["reasons"] = sorted({s.get("reasons", "") for s in inside})
    return out
