"""The attention kernels' frozen launch ABI (kernel_abi 4), checked on every side without a GPU.

``cuda/ort/attention_abi.h`` is the one machine-readable table: the CUDA twin builds
its argument struct and launch array from it. Here it must equal both templates'
kernel signatures, the argument tuple ``AttentionOp.bind`` builds (run on the CPU
with a numpy stand-in for CuPy), and the table in ``cuda/ort/OPS.md``; and the
arrays of a package's ``*.plan.bin`` must equal what ``AttentionOp`` uploads.
"""

from __future__ import annotations

import re
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

import stofc.runtime.attention as rt
from stofc.kernels.attention import AttentionConfig
from stofc.kernels.attention.launch import launch_data
from stofc.lower.twins import KERNEL_ABI
from stofc.masks import encode
from stofc.package.maskbin import read_attention_plan, write_attention_plan
from stofc.targets import get_profile

ROOT = Path(__file__).resolve().parents[2]
ABI_HEADER = ROOT / "cuda" / "ort" / "attention_abi.h"
OPS = ROOT / "cuda" / "ort" / "OPS.md"


def abi_table(macro: str = "STOFC_ATTENTION_ABI") -> list[tuple[str, str]]:
    """The rows of one X-macro table of attention_abi.h: (name, type)."""
    text = ABI_HEADER.read_text()
    body = text[text.index(f"#define {macro}(X)"):]
    body = body[:body.index("\n\n")]                  # a table ends at the first blank line
    return re.findall(r"X\((\w+), (ptr|i64|i32|f32|map)\)", body)


def template_params(name: str, entry: str = "{{ kernel_name }}") -> list[tuple[str, str]]:
    """(name, type) of each parameter of ``entry`` in the template ``name`` (a TmaDesc
    by value is ``map``)."""
    text = (ROOT / "templates" / "attention" / name).read_text()
    sig = text[text.index(f"{entry}(") + len(f"{entry}("):]
    sig = re.sub(r"//[^\n]*", "", sig[:sig.index(") {")])
    out = []
    for param in (p.strip() for p in sig.split(",")):
        pname = re.findall(r"(\w+)$", param)[0]
        kind = ("map" if "TmaDesc" in param and "*" not in param else "ptr" if "*" in param
                else "i64" if "long long" in param else "f32" if param.startswith("float")
                else "i32" if param.startswith("int") else "?")
        out.append((pname, kind))
    return out


def test_abi_table_matches_both_templates():
    table = abi_table()
    assert len(table) == 38
    block, row = template_params("block.cu.j2"), template_params("row.cu.j2")
    assert block == table                                   # names and types, in order
    assert [t for _, t in row] == [t for _, t in table]     # row-wise: same types, own names


def test_abi_table_is_documented_in_ops_md():
    text = OPS.read_text()
    section = text[text.index("### Kernel argument list"):]
    section = section[:section.index("\n### ", 4)]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (ptr|i64|i32|f32) \|", section, re.M)
    assert [(n, t) for _, n, t in rows] == abi_table()
    assert [int(i) for i, _, _ in rows] == list(range(len(rows)))
    assert f"kernel_abi = {KERNEL_ABI}" in text
    assert f"kAttentionKernelAbi = {KERNEL_ABI};" in ABI_HEADER.read_text()


# ---------------------------------------------------------------- AttentionOp on the CPU


class _Ptr:
    def __init__(self, array: np.ndarray) -> None:
        self.ptr = array.__array_interface__["data"][0]


class _Array(np.ndarray):
    """A numpy array that answers ``.data.ptr`` like a CuPy array."""

    @property
    def data(self):  # type: ignore[override]
        return _Ptr(self)


def _wrap(fn):
    return lambda *a, **k: np.asarray(fn(*a, **k)).view(_Array)


FAKE_CUPY = types.SimpleNamespace(
    asarray=_wrap(np.asarray), zeros=_wrap(np.zeros), full=_wrap(np.full), empty=_wrap(np.empty),
    minimum=np.minimum, where=np.where, argmax=np.argmax, packbits=np.packbits,
    int32=np.int32, uint64=np.uint64, float16=np.float16, uint16=np.uint16, bool_=np.bool_)


class _Recorder:
    def __init__(self, kernel, grid, block, args, *, result=None, then=None) -> None:
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args
        self.then = then


@pytest.fixture
def cpu_runtime(monkeypatch):
    monkeypatch.setattr(rt, "_cupy", lambda: FAKE_CUPY)
    monkeypatch.setattr(rt, "device_arch", lambda: "sm_90")
    monkeypatch.setattr("stofc.runtime.launches.BoundLaunch", _Recorder)


def _kind(a) -> str:
    if isinstance(a, np.int64):
        return "i64"
    if isinstance(a, np.int32):
        return "i32"
    if isinstance(a, np.float32):
        return "f32"
    assert isinstance(a, np.ndarray)
    return "ptr"


CASES = [
    ("bigbird:block=16,window=3,global=1,random=1,seed=0", 256,
     AttentionConfig("block", 64, 16, 4, 2, 1)),
    ("strided:stride=64", 512, AttentionConfig("block", 64, 16, 4, 3, 1, gather=True)),
    ("dilated:window=256,dilation=2", 1000, AttentionConfig("block", 64, 16, 2, 2, 2, permute=True)),
    ("sliding:window=96", 300, AttentionConfig("row", 64, 2, 4)),
    ("causal", 384, AttentionConfig("block", 64, 16, 4, 2, 1, min_blocks=4, mma="wgmma")),
]


@pytest.mark.parametrize("spec,L,config", CASES, ids=[c[2].describe() for c in CASES])
def test_runtime_launch_matches_abi_and_launch_plan(cpu_runtime, tmp_path, spec, L, config):
    fmt = encode(spec, L)
    heads, batch, head_dim, seq = 2, 2, 64, L - 37
    op = rt.AttentionOp(fmt, config, "float16", head_dim, profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: ((
        "kernel", has_bias, has_key_bits, has_softcap),)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float16)
               for _ in range(3))
    key_mask = np.ones((batch, seq), np.int64)
    key_mask[1, seq - 5:] = 0
    bias = rng.standard_normal((1, heads, seq, seq)).astype(np.float16)
    table = abi_table()
    names = [n for n, _ in table]
    data = read_attention_plan(write_attention_plan(launch_data(fmt, config),
                                                    tmp_path / "x.plan.bin"))
    for kw in ({}, {"key_mask": key_mask}, {"key_mask": key_mask, "bias": bias}):
        launch = op.bind(q, k, v, **kw)
        assert [_kind(a) for a in launch.args] == [t for _, t in table]
        args = dict(zip(names, launch.args, strict=True))
        for field, name in (("row_ptr", "tile_row_ptr"), ("col_idx", "tile_key"),
                            ("part_idx", "tile_part"), ("bitmaps", "bitmaps"),
                            ("gather_keys", "gather_keys"), ("q_perm", "q_perm")):
            assert np.array_equal(np.asarray(args[name]), getattr(data, field)), field
        assert np.array_equal(np.asarray(args["row_order"]), data.order(seq))
        assert int(args["permuted"]) == int(data.permuted) == int(config.permute)
        assert int(args["fmt_head_stride"]) == data.fmt_head_stride
        # the C++ twin's geometry: grid = H * B * rows * blocks_per_tile_row, block = threads
        rows = fmt.tile_rows if data.permuted else -(-seq // fmt.tile)
        per_row = config.q_split if config.kind == "block" else config.tile // config.rows_per_block
        assert launch.grid == heads * batch * rows * per_row and launch.block == config.threads
        assert (int(args["B"]), int(args["H"]), int(args["L"])) == (batch, heads, seq)
        assert launch.kernel[1:] == ("bias" in kw, "key_mask" in kw, False)
        assert int(args["kv_group"]) == 1 and float(args["softcap"]) == 0.0
        # what key_prep.cu computes on the device from key_padding_mask
        if "key_mask" in kw:
            assert np.asarray(args["kv_len"]).tolist() == [seq, seq - 5]
            assert int(args["key_words"]) == -(-seq // 64)
        if "bias" in kw:
            assert (int(args["bias_sb"]), int(args["bias_sh"]), int(args["bias_sq"])) == \
                (0, seq * seq, seq)
    # strides the C++ twin passes for a contiguous [B, S, H*D] tensor
    assert [int(args[f"q_s{x}"]) for x in "bsh"] == [seq * heads * head_dim, heads * head_dim,
                                                     head_dim]


def test_launch_plan_roundtrip_and_permutation(tmp_path):
    fmt = encode("dilated:window=256,dilation=2", 1000)
    data = launch_data(fmt, AttentionConfig("block", 64, 16, 4, 2, 1, permute=True))
    back = read_attention_plan(write_attention_plan(data, tmp_path / "p.plan.bin"))
    assert back.permuted and back.kind == "block" and back.tile_rows == fmt.tile_rows
    assert sorted(back.q_perm[:1000].tolist()) == list(range(1000))
    assert (back.q_perm[1000:] == -1).all()
    assert back.row_orders.size == fmt.tile_rows * (fmt.tile_rows + 1) // 2
    assert (back.tile, back.seq_len, back.spec_hash) == (64, 1000, fmt.spec_hash[:32])


def test_grouped_query_and_softcap_launch_arguments(cpu_runtime):
    """K/V with fewer heads pass their own strides and kv_group = H / Hkv; softcap picks
    the soft-capping kernel and is passed as its last argument (launch_plan.cc mirrors it)."""
    fmt = encode("causal", 256)
    op = rt.AttentionOp(fmt, AttentionConfig("block", 64, 16, 4, 2, 1), "float16", 64,
                        profile=get_profile("h100"))
    op._kernel = lambda has_bias, has_key_bits, has_softcap: (("kernel", has_softcap),)
    batch, seq, heads, kv_heads = 2, 200, 8, 2
    rng = np.random.default_rng(1)
    q = rng.standard_normal((batch, seq, heads, 64)).astype(np.float16)
    k, v = (rng.standard_normal((batch, seq, kv_heads, 64)).astype(np.float16) for _ in range(2))
    args = dict(zip([n for n, _ in abi_table()], op.bind(q, k, v, softcap=30.0).args, strict=True))
    assert int(args["kv_group"]) == heads // kv_heads
    assert float(args["softcap"]) == 30.0
    assert [int(args[f"k_s{x}"]) for x in "bsh"] == [seq * kv_heads * 64, kv_heads * 64, 64]
    assert [int(args[f"q_s{x}"]) for x in "bsh"] == [seq * heads * 64, heads * 64, 64]
    assert op.bind(q, k, v, softcap=30.0).kernel == ("kernel", True)
    assert op.bind(q, k, v).kernel == ("kernel", False)
    with pytest.raises(rt.StofcError, match="number of heads that divides"):
        op.bind(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(rt.StofcError, match="softcap"):
        op.bind(q, k, v, softcap=-1.0)


def test_ws_launch_constants_match_the_abi_header():
    """The combine launch's shape is computed on both sides: the CuPy runtime's
    constants must be the CUDA twin's, or one side merges a sixteenth of the rows."""
    from stofc.kernels.attention.ws import COMBINE_GROUPS
    from stofc.runtime.attention_ws import COMBINE_THREADS

    text = ABI_HEADER.read_text()

    def const(name: str) -> int:
        return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))

    assert const("kWsCombineGroups") == COMBINE_GROUPS
    assert const("kWsCombineThreads") == COMBINE_THREADS
    from stofc.kernels.attention.ws_plan import ITEM_FIELDS, MAX_CHUNKS
    assert const("kWsItemFields") == ITEM_FIELDS      # the plan file's items, read on both sides
    # the most chunks of a split row: ws_plan cuts no more, the twin's plan reader refuses more
    plan_reader = (ROOT / "cuda" / "ort" / "launch_plan.cc").read_text()
    assert int(re.search(r"constexpr int kWsMaxChunks = (\d+);", plan_reader).group(1)) == MAX_CHUNKS


WS_SHAPES = r"""
#include <cstdio>
#include "attention_abi.h"
int main() {  // consumers, blocks per SM, threads
    for (int c = 1; c <= 4; ++c)
        std::printf("%d %d %d\n", c, stofc_ort::ws_blocks_per_sm(c), stofc_ort::ws_threads(c));
}
"""


def test_ws_block_shapes_match_the_abi_header(tmp_path):
    """Blocks per SM and threads of each ws block shape, compiled from attention_abi.h: the
    twin's persistent grid (SMs * ws_blocks_per_sm) and its carveout must follow the Python
    runtime's WS_BLOCKS_PER_SM, or one side launches a third of the other's blocks."""
    from stofc.kernels.attention.ws_plan import CONSUMERS, WS_BLOCKS_PER_SM

    (tmp_path / "shapes.cc").write_text(WS_SHAPES)
    exe = tmp_path / "shapes"
    res = subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-I", str(ABI_HEADER.parent),
                          str(tmp_path / "shapes.cc"), "-o", str(exe)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    rows = {int(c): (int(b), int(t)) for c, b, t in (line.split() for line in out.splitlines())}
    assert tuple(rows) == CONSUMERS == (1, 2, 3, 4)
    assert {c: b for c, (b, _) in rows.items()} == WS_BLOCKS_PER_SM
    assert {c: t for c, (_, t) in rows.items()} == {c: 128 * (c + 1) for c in CONSUMERS}
