"""``ws_work_index`` (cuda/stofc/ws.cuh), the persistent ws kernel's work order, compiled for
the host.

The kernel's producer and consumers of block ``c`` walk works ``ws_work_index(k, c, grid)``
for k = 0, 1, ... until the first index at or past ``n_work``. Every work must be dealt to
exactly one block, for any grid (the launch uses ``min(n_work, SMs)`` blocks) and any count
of works (whole and partial waves). Works come longest first, so the deal decides the
critical path: on a causal mask (rows of every length) each block's total must stay near
the mean. The plain deal ``c + k * grid`` put block 0 19% above the mean at B=1, L=8192
(the kernel then ran 17% slower, bench/results/ws-variants-snake-h100-2026-11-26.jsonl).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from stofc.kernels.attention.ws_cost import _item_ns, dealt_loads, ws_config
from stofc.kernels.attention.ws_plan import consumers_of, default_split, plan_ws
from stofc.masks import encode
from stofc.targets import get_profile
from tests.unit.host_cuda import build, header_function

HARNESS = r"""
#include <cstdio>
#include <cstdlib>
@FN@
int main(int argc, char** argv) {
    const int grid = std::atoi(argv[1]), n_work = std::atoi(argv[2]);
    for (int block = 0; block < grid; ++block) {
        std::printf("%d:", block);
        for (int k = 0, w = ws_work_index(0, block, grid); w < n_work; w = ws_work_index(++k, block, grid))
            std::printf(" %d", w);
        std::printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def deal(tmp_path_factory):
    """``deal(grid, n_work)`` -> each block's works, from the compiled header function."""
    fn = header_function("ws.cuh", "int ws_work_index(")
    exe = build(HARNESS.replace("@FN@", fn), tmp_path_factory.mktemp("work_order"), "order")

    def run(grid: int, n_work: int) -> list[list[int]]:
        out = subprocess.run([str(exe), str(grid), str(n_work)], check=True,
                             capture_output=True, text=True).stdout
        return [[int(w) for w in line.split(":")[1].split()] for line in out.splitlines()]
    return run


@pytest.mark.parametrize("grid,n_work", [(132, 132), (132, 516), (132, 852), (132, 2064),
                                         (7, 7), (7, 50), (1, 5), (132, 133), (132, 263)])
def test_every_work_is_dealt_once(deal, grid, n_work):
    blocks = deal(min(grid, n_work), n_work)
    dealt = sorted(w for works in blocks for w in works)
    assert dealt == list(range(n_work))
    counts = [len(works) for works in blocks]
    assert max(counts) - min(counts) <= 1          # whole waves first, one partial at most


@pytest.mark.parametrize("spec,L,B,H,D,consumers,bound,plain_bound", [
    ("causal", 8192, 1, 12, 64, 3, 1.03, 1.15),     # plain deal: 1.19
    # four (the selector's pick since 2026-11-27): 384 works on 132 SMs, under three waves,
    # so the last partial wave leaves the busiest block 10% above the mean; measured level
    # with three there (ws-variants-c4-h100-2026-11-27.jsonl, causal 1:12:8192)
    ("causal", 8192, 1, 12, 64, 4, 1.11, 1.15),     # plain deal: 1.19
    ("causal", 8192, 1, 16, 128, None, 1.05, 1.15),     # plain deal: 1.18
    ("causal", 16384, 1, 16, 128, None, 1.03, 1.08),    # plain deal: 1.09
    ("sliding:window=4095,causal=true", 16384, 1, 16, 128, None, 1.03, 1.05),   # plain: 1.053
])
def test_causal_rows_are_balanced_over_the_blocks(deal, spec, L, B, H, D, consumers, bound,
                                                  plain_bound):
    """Per-block totals of the cost model's item times (launch order, longest first) under
    the kernel's deal, for the selector's config (its consumer count, or ``consumers``):
    the busiest block within ``bound`` of the mean, where the plain deal put one above
    ``plain_bound``."""
    h100 = get_profile("h100")
    fmt = encode(spec, L)
    cfg = ws_config(fmt, h100, batch=B, heads=H, head_dim=D)
    assert cfg is not None
    consumers = consumers or consumers_of(cfg.warps)
    split = default_split(fmt, batch=B, heads=H, sm_count=h100.sm_count, consumers=consumers)
    plan = plan_ws(fmt, split_tiles=split, consumers=consumers)
    off, n = plan.launch_items(L)
    cost = _item_ns(plan, 0, L, D, h100.fp16_tflops / h100.sm_count)[plan.orders[0, off:off + n]]
    # work w -> (head w % H, batch (w / H) % B, item w / (H * B)); one shared format
    work_cost = np.repeat(cost, H * B)
    grid = min(h100.sm_count, work_cost.size)
    loads = np.array([work_cost[works].sum() for works in deal(grid, work_cost.size)])
    assert loads.max() <= bound * loads.mean(), (loads.max() / loads.mean())
    plain = np.array([work_cost[c::grid].sum() for c in range(grid)])
    assert plain.max() > plain_bound * plain.mean()    # what the snake is for


@pytest.mark.parametrize("spec,L,B,H,consumers", [
    ("causal", 8192, 1, 4, 3), ("dense", 8192, 1, 4, 3), ("causal", 2048, 3, 5, 4),
    ("longformer:window=256,global=16", 4096, 2, 12, 4)])
def test_dealt_loads_mirror_the_kernels_deal(deal, spec, L, B, H, consumers):
    """``ws_cost.dealt_loads`` (the estimator's busiest block) gives each block the works
    the compiled ``ws_work_index`` deals it."""
    h100 = get_profile("h100")
    fmt = encode(spec, L)
    plan = plan_ws(fmt, split_tiles=default_split(fmt, batch=B, heads=H, sm_count=132,
                                                  consumers=consumers), consumers=consumers)
    cost = _item_ns(plan, 0, L, 64, h100.fp16_tflops / h100.sm_count)
    loads = dealt_loads(plan, [cost], L, heads=H, batch=B, sm_count=132)
    off, n = plan.launch_items(L)
    work_cost = np.repeat(cost[plan.orders[0, off:off + n]], H * B)
    grid = min(132, work_cost.size)
    want = [work_cost[works].sum() for works in deal(grid, work_cost.size)]
    assert np.allclose(loads, want)


def test_a_partial_last_wave_is_the_critical_path():
    """B=1 H=4 L=8192 dense: three consumers make 172 equal works on 132 SMs, so 40 blocks
    run two (1.53x the mean); four make 128, one each. Measured: 249 against 155 us
    (bench/results/ws-variants-d64-consumers-pingpong-h100-2026-11-27.jsonl)."""
    h100 = get_profile("h100")
    fmt = encode("dense", 8192)
    est = {}
    for consumers in (3, 4):
        plan = plan_ws(fmt, split_tiles=0, consumers=consumers)
        cost = _item_ns(plan, 0, 8192, 64, h100.fp16_tflops / h100.sm_count)
        loads = dealt_loads(plan, [cost], 8192, heads=4, batch=1, sm_count=132)
        est[consumers] = loads.max()
        assert loads.max() / loads.mean() == pytest.approx(
            {3: 2 / (172 / 132), 4: 1.0}[consumers], rel=0.01)
    assert est[4] < 0.8 * est[3]
