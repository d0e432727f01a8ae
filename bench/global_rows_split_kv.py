"""How fast 16 global queries against every key can be as a pass of their own (a
development probe: the floor of the lever in NOTES.md, "Longformer's global rows").

A flash-decoding pass for head_dim 64 fp16, batch 1: each warp takes ``tiles`` 64-key tiles
of one head, computes S = Q K^T for the 16 queries with mma.sync m16n8k16 (Q and K read
straight from global memory in a matching permutation of head_dim, so each K row is two
16-byte loads), keeps an online softmax, and adds P V (V staged in shared memory and read
with ldmatrix.trans); it writes its unnormalised O, row max and row sum, and a second
kernel merges every warp's partials by their log-sum-exp. Times both kernels together with
CUDA events (20 pairs captured in a CUDA graph, 50 replays, two rounds) for several ``tiles``, and times the first kernel alone too, and checks the output against
float32 SDPA on the same inputs. Compare with ``global_rows_probe.py``'s in-launch cost.
Usage: PYTHONPATH=.:bench python3 bench/global_rows_split_kv.py [H:L ...]
"""

from __future__ import annotations

import json
import math
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from ws_trace import time_us

SOURCE = r"""
#include <cuda_fp16.h>
constexpr int D = 64, NQ = 16, VSTRIDE = 72;     // V rows padded: ldmatrix without conflicts

__device__ __forceinline__ unsigned pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void unpack(const uint4& x, const uint4& y, unsigned (&w)[8]) {
    w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w; w[4] = y.x; w[5] = y.y; w[6] = y.z; w[7] = y.w;
}

// q, k, v: [L, H, D]; part_o: [H, warps, NQ, D]; part_ml: [H, warps, NQ, 2]
extern "C" __global__ void __launch_bounds__(128)
gq_partial(const __half* __restrict__ q, const __half* __restrict__ k, const __half* __restrict__ v,
           float* __restrict__ part_o, float* __restrict__ part_ml, int H, int tiles, float scale_log2) {
    __shared__ __align__(16) __half vs[4][64 * VSTRIDE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int h = blockIdx.x % H, wid = (blockIdx.x / H) * 4 + warp, nw = (gridDim.x / H) * 4;
    // head_dim permuted alike in Q and K: thread t4 holds d = 16 t4 + 4 kk + {0..3} at k-step kk
    unsigned qa[4][4];
    {
        unsigned x[8], y[8];
        const uint4* r0 = reinterpret_cast<const uint4*>(q + (static_cast<size_t>(g) * H + h) * D + 16 * t4);
        const uint4* r1 = reinterpret_cast<const uint4*>(q + (static_cast<size_t>(g + 8) * H + h) * D + 16 * t4);
        unpack(r0[0], r0[1], x);
        unpack(r1[0], r1[1], y);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            qa[kk][0] = x[2 * kk]; qa[kk][1] = y[2 * kk]; qa[kk][2] = x[2 * kk + 1]; qa[kk][3] = y[2 * kk + 1];
        }
    }
    float m0 = -__int_as_float(0x7f800000), m1 = -__int_as_float(0x7f800000), l0 = 0.0f, l1 = 0.0f;
    float o[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    __half* vw = vs[warp];
    const unsigned vbase = static_cast<unsigned>(__cvta_generic_to_shared(vw));
    for (int it = 0; it < tiles; ++it) {
        const int base = (wid * tiles + it) * 64;
#pragma unroll 4
        for (int i = lane; i < 512; i += 32) {
            const int r = i >> 3, c = i & 7;
            *reinterpret_cast<uint4*>(vw + r * VSTRIDE + c * 8) =
                *reinterpret_cast<const uint4*>(v + (static_cast<size_t>(base + r) * H + h) * D + c * 8);
        }
        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const uint4* kr = reinterpret_cast<const uint4*>(k + (static_cast<size_t>(base + 8 * j + g) * H + h) * D + 16 * t4);
            unsigned w[8];
            unpack(kr[0], kr[1], w);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) mma(s[j], qa[kk], w[2 * kk], w[2 * kk + 1]);
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        const float a0 = exp2f(m0 - mx0), a1 = exp2f(m1 - mx1);   // 0 on the first tile
        m0 = mx0; m1 = mx1;
        l0 *= a0; l1 *= a1;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            o[j][0] *= a0; o[j][1] *= a0; o[j][2] *= a1; o[j][3] *= a1;
            s[j][0] = exp2f(s[j][0] - m0); s[j][1] = exp2f(s[j][1] - m0);
            s[j][2] = exp2f(s[j][2] - m1); s[j][3] = exp2f(s[j][3] - m1);
            l0 += s[j][0] + s[j][1];
            l1 += s[j][2] + s[j][3];
        }
        __syncwarp();                              // V is in shared memory
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const unsigned pa[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                                    pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int tile = lane >> 3, r = lane & 7;
#pragma unroll
            for (int jd = 0; jd < 8; jd += 2) {
                const unsigned addr = vbase + 2u * ((16 * kk + (tile & 1) * 8 + r) * VSTRIDE + 8 * jd + (tile >> 1) * 8);
                unsigned b0, b1, b2, b3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "r"(addr));
                mma(o[jd], pa, b0, b1);
                mma(o[jd + 1], pa, b2, b3);
            }
        }
        __syncwarp();                              // before the next tile's V
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    float* po = part_o + (static_cast<size_t>(h) * nw + wid) * NQ * D;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<float2*>(po + g * D + 8 * j + 2 * t4) = make_float2(o[j][0], o[j][1]);
        *reinterpret_cast<float2*>(po + (g + 8) * D + 8 * j + 2 * t4) = make_float2(o[j][2], o[j][3]);
    }
    if (t4 == 0) {
        float* pml = part_ml + (static_cast<size_t>(h) * nw + wid) * NQ * 2;
        *reinterpret_cast<float2*>(pml + 2 * g) = make_float2(m0, l0);
        *reinterpret_cast<float2*>(pml + 2 * (g + 8)) = make_float2(m1, l1);
    }
}

// out: [NQ, H, D]; one block per head, a thread per (query, four columns)
extern "C" __global__ void __launch_bounds__(256)
gq_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml, __half* __restrict__ out,
         int H, int nw) {
    const int h = blockIdx.x, row = threadIdx.x >> 4, col = 4 * (threadIdx.x & 15);
    float mx = -__int_as_float(0x7f800000);
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, part_ml[((static_cast<size_t>(h) * nw + w) * NQ + row) * 2]);
    float total = 0.0f;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int w = 0; w < nw; ++w) {
        const size_t at = (static_cast<size_t>(h) * nw + w) * NQ + row;
        const float2 ml = *reinterpret_cast<const float2*>(part_ml + at * 2);
        const float e = exp2f(ml.x - mx);
        const float4 x = *reinterpret_cast<const float4*>(part_o + at * D + col);
        total = fmaf(e, ml.y, total);
        sum.x = fmaf(e, x.x, sum.x); sum.y = fmaf(e, x.y, sum.y);
        sum.z = fmaf(e, x.z, sum.z); sum.w = fmaf(e, x.w, sum.w);
    }
    const float inv = 1.0f / total;
    __half* dst = out + (static_cast<size_t>(row) * H + h) * D + col;
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(sum.x * inv, sum.y * inv);
    *reinterpret_cast<__half2*>(dst + 2) = __floats2half2_rn(sum.z * inv, sum.w * inv);
}
"""

D, NQ = 64, 16
REPEAT = 20


def main() -> int:
    cases = sys.argv[1:] or ["12:8192", "12:16384"]
    module = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    partial, merge = module.get_function("gq_partial"), module.get_function("gq_merge")
    stream = cp.cuda.Stream(non_blocking=True)
    for case in cases:
        H, L = (int(x) for x in case.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn((L, H, D), device="cuda", dtype=torch.float16, generator=gen)
                   for _ in range(3))
        ref = F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in (q[:NQ], k, v)))
        ref = ref[0].transpose(0, 1)                   # [NQ, H, D]
        row: dict = {"case": f"H={H} L={L} head_dim 64 fp16, 16 queries",
                     "gpu": torch.cuda.get_device_name(),
                     "kv_mb": round(2 * L * H * D * 2 / 2**20, 1)}
        for tiles in (1, 2, 4, 8):
            nw = L // 64 // tiles
            blocks = H * nw // 4
            part_o = cp.empty(H * nw * NQ * D, dtype=cp.float32)
            part_ml = cp.empty(H * nw * NQ * 2, dtype=cp.float32)
            out = torch.full((NQ, H, D), float("nan"), device="cuda", dtype=torch.float16)
            args = (cp.asarray(q), cp.asarray(k), cp.asarray(v), part_o, part_ml, cp.int32(H),
                    cp.int32(tiles), cp.float32(1.0 / math.sqrt(D) * math.log2(math.e)))

            margs = (part_o, part_ml, cp.asarray(out), cp.int32(H), cp.int32(nw))
            torch.cuda.synchronize()                   # inputs and the NaN fill (torch's stream)

            def run(args=args, margs=margs, blocks=blocks, heads=H):
                partial((blocks,), (128,), args, stream=stream)
                merge((heads,), (256,), margs, stream=stream)

            run()
            stream.synchronize()
            err = float((out.float() - ref).norm() / ref.norm())
            stream.begin_capture()                     # 20 pairs in one graph: no host gaps
            for _ in range(REPEAT):
                run()
            graph = stream.end_capture()
            us = [round(time_us(lambda g=graph: g.launch(stream), stream, reps=50) / REPEAT, 2)
                  for _ in range(2)]
            stream.begin_capture()                     # the partial kernel alone
            for _ in range(REPEAT):
                partial((blocks,), (128,), args, stream=stream)
            alone = stream.end_capture()
            partial_us = round(time_us(lambda g=alone: g.launch(stream), stream, reps=50) / REPEAT, 2)
            row[f"tiles={tiles}"] = {"blocks": blocks, "us": us, "partial_us": partial_us,
                                     "relerr": round(err, 6),
                                     "nan": bool(torch.isnan(out).any())}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
