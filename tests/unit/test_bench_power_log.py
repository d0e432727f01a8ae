"""bench/power_log.py: the nvidia-smi samples read back and a run's steady state."""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def power_log(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import power_log as mod
    return mod


def _stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def _write(path: Path, header: str, rows: list[str]) -> None:
    path.write_text(header + "\n" + "\n".join(rows) + "\n")


def test_read_samples_parses_fields_and_skips_broken_lines(power_log, tmp_path):
    t0 = 1_800_000_000.0
    path = tmp_path / "s.csv"
    _write(path, power_log.FIELDS, [
        f"{_stamp(t0)}, 684.50, 690.10, 1740, 61, 0x0000000000000004",
        f"{_stamp(t0 + 0.05)}, 685.00, [N/A], 1755, 62, 0x0000000000000000",
        f"{_stamp(t0 + 0.1)}, 686.00",                        # cut short by the stop
        "not a time, 1, 2, 3, 4, 0x0",                        # no readable timestamp
    ])
    rows = power_log.read_samples(str(path))
    assert len(rows) == 2
    assert rows[0]["t"] == pytest.approx(t0, abs=1e-3)
    assert rows[1]["t"] - rows[0]["t"] == pytest.approx(0.05, abs=1e-3)
    assert rows[0]["power.draw"] == 684.5 and rows[0]["power.draw.instant"] == 690.1
    assert rows[0]["clocks.sm"] == 1740.0 and rows[0]["temperature.gpu"] == 61.0
    assert rows[0]["reasons"] == "0x0000000000000004"
    assert math.isnan(rows[1]["power.draw.instant"])


def test_summarize_uses_the_window_and_the_last_half(power_log):
    t0 = 1_800_000_000.0
    samples = [
        {"t": t0 + 0.1, "power.draw": 100.0, "power.draw.instant": 100.0, "clocks.sm": 1980.0,
         "temperature.gpu": 40.0, "reasons": "0x0"},           # before t0 + 0.2: the lag
        {"t": t0 + 0.5, "power.draw": 680.0, "power.draw.instant": 690.0, "clocks.sm": 1700.0,
         "temperature.gpu": 60.0, "reasons": "0x4"},
        {"t": t0 + 1.0, "power.draw": 690.0, "power.draw.instant": float("nan"),
         "clocks.sm": 1720.0, "temperature.gpu": 62.0, "reasons": "0x4"},
        {"t": t0 + 9.0, "power.draw": 100.0, "power.draw.instant": 100.0, "clocks.sm": 1980.0,
         "temperature.gpu": 40.0, "reasons": "0x0"},           # after t1
    ]
    # warm-up batches first (slower), the steady ones last: the median of the last half
    run = {"t0": t0, "t1": t0 + 2.0, "ms": [9.0, 9.0, 9.0, 2.0, 2.5, 2.0]}
    out = power_log.summarize(run, samples)
    assert out["ms"] == 2.0 and out["batches"] == 6 and out["samples"] == 2
    assert out["power.draw"] == 685.0
    assert out["power.draw.instant"] == 690.0                   # NaN readings left out
    assert out["clocks.sm"] == 1710.0 and out["temperature.gpu"] == 61.0
    assert out["mJ_per_call"] == pytest.approx(690.0 * 2.0)
    assert out["reasons"] == ["0x4"]


def test_summarize_falls_back_to_the_averaged_power(power_log):
    t0 = 1_800_000_000.0
    samples = [{"t": t0 + 0.5, "power.draw": 500.0, "clocks.sm": 1800.0,
                "temperature.gpu": 50.0}]                        # an older driver's fields
    out = power_log.summarize({"t0": t0, "t1": t0 + 1.0, "ms": [1.5]}, samples)
    assert "power.draw.instant" not in out
    assert out["mJ_per_call"] == pytest.approx(750.0)
    assert out["reasons"] == [""]
