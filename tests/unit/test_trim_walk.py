"""``trim_walk`` (cuda/stofc/attention.cuh), the walk trimming of every block-wise and
warp-specialised attention kernel, compiled for the host and checked exhaustively.

Its rounds (the last/first keys, the consecutive-tile guess and its narrowing, the binary
search) must return exactly the first entry whose key is at or past the run's key length,
for every walk shape the formats produce: gathered tiles first (negative keys), then
ascending tile starts, consecutive (windows, global rows) or with gaps (BigBird's random
blocks, dilated rows); tiles of 64 and 128 keys; every key length from before the first
key to past the last. A walk of consecutive tiles must be trimmed in four key reads (the
guess round: a global row of a long package run short took nine rounds before).
"""

from __future__ import annotations

import re
import subprocess

from tests.unit.host_cuda import build, header_function

HARNESS = r"""
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>
using std::max; using std::min;
static long loads = 0;                                 // key reads of the last call
static inline int ld(const int* key, int j) { ++loads; return key[j]; }
@FN@
int main() {
    std::mt19937 rng(7);
    long checked = 0;
    for (int tile : {64, 128}) {
        for (int trial = 0; trial < 4000; ++trial) {
            std::vector<int> key;
            const int pad = rng() % 3;                 // entries before the walk
            for (int i = 0; i < pad; ++i) key.push_back(12345);
            const int j0 = static_cast<int>(key.size());
            const int gathered = trial % 5 == 0 ? 1 + rng() % 3 : 0;
            for (int i = 0; i < gathered; ++i) key.push_back(-1 - static_cast<int>(rng() % 50));
            int col = rng() % 6;
            const int n = rng() % 40;
            const int mode = trial % 3;                // 0 consecutive, 1 gaps, 2 mixed
            for (int i = 0; i < n; ++i) {
                key.push_back(col * tile);
                col += mode == 0 ? 1 : mode == 1 ? 1 + rng() % 4 : (rng() % 4 == 0 ? 2 + rng() % 3 : 1);
            }
            const int j1 = static_cast<int>(key.size());
            key.push_back(0);                          // the plans' sentinel
            const int top = (col + 2) * tile;
            for (int kvl = -2; kvl <= top; kvl += 1 + rng() % 17) {
                int want = j1;
                for (int j = j0; j < j1; ++j)
                    if (key[j] >= kvl && key[j] >= 0) { want = j; break; }
                if (gathered && kvl <= 0) {
                    // gathered keys (< 0) are always below a key length > their value: the
                    // kernels never pass kvl <= 0 with a walk (an empty run launches nothing)
                    continue;
                }
                loads = 0;
                const int got = trim_walk(key.data(), j0, j1, kvl, tile);
                ++checked;
                // consecutive tiles (windows, global rows): the guess is exact, four reads
                if (mode == 0 && !gathered && loads > 4) {
                    std::printf("SLOW tile=%d trial=%d kvl=%d n=%d loads=%ld\n", tile, trial,
                                kvl, n, loads);
                    return 3;
                }
                if (got != want) {
                    std::printf("MISMATCH tile=%d trial=%d kvl=%d j0=%d j1=%d got=%d want=%d\n",
                                tile, trial, kvl, j0, j1, got, want);
                    return 1;
                }
            }
        }
    }
    std::printf("checked %ld\n", checked);
    return checked > 100000 ? 0 : 2;
}
"""


def _function() -> str:
    fn = header_function("attention.cuh", "int trim_walk(")
    return re.sub(r"\bkey\[([^\[\]]+)\]", r"ld(key, \1)", fn)   # counted reads


def test_trim_walk_matches_the_first_key_at_or_past_the_length(tmp_path):
    fn = _function()
    assert re.search(r"int tile\)", fn), "trim_walk takes the tile width (the guess round)"
    exe = build(HARNESS.replace("@FN@", fn), tmp_path, "trim")
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("checked ")
