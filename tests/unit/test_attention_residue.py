"""The residue split of dilated masks (``stofc.kernels.attention.residue``) without a GPU.

The split mask ``S`` must reproduce every residue's rows and keys of the original mask
exactly (for every run length, up to each residue's own length), the original must
allow nothing across residues, and masks that are not periodic, or whose residues
differ, must not split. The warp-specialised family then offers the split (search
space, starting config, cost model), its launch data walks ``S`` once per residue, the
bound launch steps its tensor maps ``P`` rows and launches ``P`` times the works, and
the other families refuse the field.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import stofc.runtime.attention as rt
from stofc.kernels.attention import AttentionConfig, KernelSpec, prune
from stofc.kernels.attention.config import attention_family
from stofc.kernels.attention.family import AttentionProblem
from stofc.kernels.attention.reference import dense_from_format, format_from_dense
from stofc.kernels.attention.residue import choose_period, pure_word, residue_format, split_format
from stofc.kernels.attention.ws_cost import ws_config, ws_estimate
from stofc.kernels.attention.ws_launch import ws_launch_data
from stofc.masks import encode
from stofc.runtime import tensor_map
from stofc.targets import get_profile
from tests.unit.test_attention_ws import decode, ws
from tests.unit.test_ortlib_abi import FAKE_CUPY, _Recorder

H100, A100 = get_profile("h100"), get_profile("a100")


def dense(fmt) -> np.ndarray:
    d = dense_from_format(fmt)
    return d if d.ndim == 3 else d[None]


def check_contract(fmt, period: int, sub) -> None:
    """module doc of residue.py: every residue's sub-mask is S's corner, for the longest
    run and a shorter one, and nothing is allowed across residues."""
    m, s = dense(fmt), dense(sub)
    n = fmt.seq_len
    assert sub.seq_len == -(-n // period)
    q, k = np.nonzero(m.any(axis=0))
    assert ((q - k) % period == 0).all()
    for run in (n, n - 77):
        for r in range(period):
            lr = -(-(run - r) // period)
            np.testing.assert_array_equal(m[:, r:run:period, r:run:period], s[:, :lr, :lr])


@pytest.mark.parametrize("spec,L,period", [
    ("dilated:window=256,dilation=2", 4096, 2),
    ("dilated:window=256,dilation=2", 1001, 2),           # L odd: residue 1 one row short
    ("dilated:window=100,dilation=4", 1500, 4),
    ("dilated:window=300,dilation=4", 2051, 4),
    ("dilated:window=256,dilation=2,causal=true", 2000, 2),
    ("dilated:window=64,dilation=8", 2048, 4),            # period 8 splits as 4 (4 | 8)
])
def test_dilated_masks_split_into_one_shared_sub_mask(spec, L, period):
    fmt = encode(spec, L)
    chosen = choose_period(fmt)
    assert chosen is not None and chosen[0] == period
    check_contract(fmt, period, chosen[1])
    assert chosen[1].load_col_idx.size * period < fmt.load_col_idx.size   # fewer tiles walked


def test_a_period_four_mask_also_splits_by_two_but_four_is_taken():
    fmt = encode("dilated:window=200,dilation=4", 2048)
    two = residue_format(fmt, 2)
    assert two is not None
    check_contract(fmt, 2, two)
    assert choose_period(fmt)[0] == 4


@pytest.mark.parametrize("spec,L", [
    ("causal", 1024), ("dense", 512), ("sliding:window=128", 2048),
    ("longformer:window=256,global=16", 2048),
    ("bigbird:block=64,window=3,global=2,random=3,seed=0", 2048),
    ("strided:stride=64", 1024), ("dilated:window=256,dilation=3", 2048),   # 3 does not divide 8
    ("dilated:window=256,dilation=1", 2048),
])
def test_masks_without_a_shared_residue_sub_mask_do_not_split(spec, L):
    assert choose_period(encode(spec, L)) is None


def test_periodic_masks_whose_residues_differ_do_not_split():
    """Every allowed pair is on one residue, but residue 1 sees a wider band than residue 0."""
    n = 1024
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    even = ((q - k) % 2 == 0) & (np.abs(q - k) <= np.where(q % 2 == 0, 64, 128))
    assert residue_format(format_from_dense(even), 2) is None
    same = ((q - k) % 2 == 0) & (np.abs(q - k) <= 64)
    assert residue_format(format_from_dense(same), 2) is not None
    global_row = same.copy()                       # a global query on residue 0 only
    global_row[10, ::2] = True
    assert residue_format(format_from_dense(global_row), 2) is None


def test_per_head_masks_split_head_by_head():
    n = 1024
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    heads = np.stack([((q - k) % 2 == 0) & (np.abs(q - k) <= w) for w in (64, 256, 100)])
    fmt = format_from_dense(heads)
    chosen = choose_period(fmt)
    assert chosen is not None and chosen[0] == 2 and chosen[1].num_heads == 3
    check_contract(fmt, 2, chosen[1])


def test_pure_word_is_the_allowed_diagonals():
    word = int(pure_word(2))
    bits = [(r, c) for r in range(8) for c in range(8) if word >> (r * 8 + c) & 1]
    assert len(bits) == 32 and all((r - c) % 2 == 0 for r, c in bits)
    assert bin(int(pure_word(4))).count("1") == 16


def test_split_format_refuses_a_period_the_mask_lacks():
    assert split_format(encode("causal", 512), 1).seq_len == 512
    with pytest.raises(ValueError, match="does not split into 2 residues"):
        split_format(encode("causal", 512), 2)


def test_only_the_ws_family_takes_a_period():
    assert prune(ws(period=2), 64, H100) is None and prune(ws(period=4), 128, H100) is None
    assert "period 2 or 4" in prune(ws(period=3), 64, H100)
    block = AttentionConfig("block", 64, 16, 4, 2, 1, period=2)
    assert "no residue split" in prune(block, 64, H100)


def test_the_ws_search_space_offers_the_split_only_where_the_mask_has_one():
    fam = attention_family("ws")

    def space(spec, L):
        problem = AttentionProblem(encode(spec, L), 2, 12, 64, L, "float16")
        return fam.candidates(problem, H100)[0]

    dil = space("dilated:window=256,dilation=2", 4096)
    assert {c.period for c in dil} == {1, 2}
    assert len([c for c in dil if c.period == 2]) == len([c for c in dil if c.period == 1])
    assert {c.period for c in space("causal", 4096)} == {1}


def test_the_starting_config_takes_the_split_where_it_walks_fewer_tiles():
    fmt = encode("dilated:window=256,dilation=2", 8192)
    cfg = ws_config(fmt, H100, batch=1, heads=12, head_dim=64)
    assert cfg is not None and cfg.period == 2
    whole = ws_estimate(fmt, H100, ws(stages=4, period=1), batch=1, heads=12, seq_len=8192,
                        head_dim=64)
    split = ws_estimate(fmt, H100, ws(stages=4, period=2), batch=1, heads=12, seq_len=8192,
                        head_dim=64)
    assert split < 0.75 * whole
    assert ws_config(encode("causal", 8192), H100, batch=1, heads=12, head_dim=64).period == 1
    kernel = KernelSpec(cfg, "float16", 64)
    assert kernel.name.endswith("_p2_b0_k0")
    assert attention_family("ws").launch_key(cfg).endswith("-p2")
    assert "residues=2" in cfg.describe()


@pytest.mark.parametrize("period,spec,L", [(2, "dilated:window=256,dilation=2", 1001),
                                           (4, "dilated:window=100,dilation=4", 1500)])
def test_the_launch_data_walks_the_split_mask_for_every_residue(period, spec, L):
    fmt = encode(spec, L)
    data = ws_launch_data(fmt, ws(split=8, period=period))
    assert data.period == period and data.seq_len == L and data.tile_rows == fmt.tile_rows
    sub = split_format(fmt, period)
    assert data.pairs == -(-sub.seq_len // 128)
    # the items cover S exactly once; S is every residue's mask (check_contract)
    from stofc.kernels.attention.ws_plan import plan_ws
    plan = plan_ws(sub, split_tiles=8)
    np.testing.assert_array_equal(decode(plan, sub), dense(sub))
    # a run of L rows launches the pair rows residue 0 covers
    assert data.launch_items(L) == plan.launch_items(-(-L // period))
    assert data.launch_items(300) == plan.launch_items(-(-300 // period))


def test_the_bound_launch_steps_its_maps_and_launches_every_residue(monkeypatch):
    fake = types.SimpleNamespace(**vars(FAKE_CUPY), float32=np.float32)
    monkeypatch.setattr(rt, "_cupy", lambda: fake)
    monkeypatch.setattr(rt, "device_arch", lambda: "sm_90")
    import stofc.runtime.attention_ws as rws
    monkeypatch.setattr(rws, "BoundLaunch", _Recorder)
    maps = []

    def get(self, *args):
        maps.append(args)
        return tensor_map.TensorMap(bytes(128))

    monkeypatch.setattr(tensor_map.TensorMapCache, "get", get)
    fmt = encode("dilated:window=256,dilation=2", 2048)
    cfg = ws(split=8, period=2)
    op = rt.AttentionOp(fmt, cfg, "float16", 64, profile=H100)
    op._kernel = lambda *a: ("kernel", "combine")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 1999, 2, 64)).astype(np.float16) for _ in range(3))
    launch = op.bind(q, k, v)
    plan = op._launch.ws.plan
    assert plan.period == 2
    _, count = plan.launch_items(1999)
    assert launch.args[-1] == 2 * 3 * 2 * count                 # n_work: H * B * P * items
    assert launch.grid == min(2 * 3 * 2 * count, H100.sm_count)
    for args in maps:     # (address, dtype, dims, strides, box, steps): the real rows, 2 apart
        assert args[2][2] == 1999 and args[4] == (64, 1, 128, 1) and args[5] == (1, 1, 2, 1)
    assert len(maps) == 3
    if plan.splits:
        assert launch.then.grid == 2 * 3 * 2 * plan.n_split * 16


def test_the_selector_explains_the_split():
    from stofc.kernels.attention import select_kernel
    choice = select_kernel(encode("dilated:window=256,dilation=2", 8192), H100, batch=1,
                           heads=12, seq_len=8192, head_dim=64)
    assert choice.kernel == "ws" and choice.config.period == 2
    assert "splits into 2 residues" in choice.explanation and "residues=2" in choice.explanation
    causal = select_kernel(encode("causal", 8192), H100, batch=1, heads=12, seq_len=8192,
                           head_dim=64)
    assert "residues" not in causal.explanation
