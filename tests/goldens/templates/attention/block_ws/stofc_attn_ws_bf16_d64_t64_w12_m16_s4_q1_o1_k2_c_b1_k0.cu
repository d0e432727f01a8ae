// stofc warp-specialised block-wise sparse attention (Hopper, sm_90a), generated.
//
// One thread block = a producer warpgroup and CONSUMERS (1 to 4) consumer warpgroups;
// MIN_BLOCKS of them share an SM (three with one consumer: ws_plan.WS_BLOCKS_PER_SM).
// It owns one work item of stofc.kernels.attention.ws_plan: 64 * CONSUMERS query rows
// (pair row p: mask tile rows C p .. C p + C - 1, one per consumer warpgroup) and a
// range of the pair row's merged walk list. One producer thread resolves each work and
// hands it to the consumers in a shared-memory record beside its Q buffer, streams Q (once), then
// K and V of every listed 64-key tile with the Tensor Memory Accelerator into a
// STAGES-deep ring of 128-byte-swizzled shared-memory panels, each K tile with the
// part-tile bitmaps of every warpgroup (bulk copies), every copy completing an
// mbarrier; the consumers release each slot on an "empty" mbarrier (Q too: where Q is read
// from smem, two Q buffers let the next work's Q load under this work's last steps). The producer gives
// its registers to the consumers (setmaxnreg). A consumer warpgroup keeps its 64 rows
// of Q in registers (head_dim <= 128; above, Q is read from smem), computes S = Q K^T
// with register-A wgmma (four warpgroups: from smem) while the previous tile's O += P V runs (intra-warpgroup
// overlap; with ROWSUM_MMA the same group sums P's rows by a wgmma against ones: at head_dim
// 64 inside the P V wgmma itself, ROWSUM_IN_PV), and
// with PINGPONG the warpgroups take turns (round robin) issuing their
// GEMMs, so one's softmax runs under the others' tensor-core work. A warpgroup skips the
// tiles its own tile row does not hold; full tiles evaluate no mask (a full tile with every
// key in the run, after a step that computed, takes the lean step: no walk entry, no mask
// decision, no bitmap address; ws-variants-lean-h100-2026-11-28); part tiles test their
// bitmaps, which the ws plan stores in fragment order (one 32-bit word per thread and tile:
// ws_plan.fragment_bitmaps); key padding, bias and soft-capping are block_tile.cuh's. With PERIOD > 1
// (a dilated mask split by residue) each residue's rows are a sequence of their own.
// A shared chunk of a split row (a global row walking alone past its band) gives every
// warpgroup that tile row's Q and every CONSUMERS-th entry, without turns; warpgroup 0
// merges the others' partials (left in the chunk's slot, in the rows of the tile rows the
// chunk does not compute) before writing the chunk's and marking those rows empty.
// A whole pair row writes O normalised (staged in shared memory for 16-byte stores where
// the area fits: STAGE_O); a chunk of a split row writes its unnormalised
// O, row max and row sum to its workspace slot, merged by stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_combine.
#include <stofc/block_tile.cuh>
#include <stofc/wgmma.cuh>
#include <stofc/ws.cuh>
#include <stofc/pdl.cuh>

using namespace stofc;

namespace {

typedef __nv_bfloat16 T;

constexpr int D = 64;
constexpr int STAGES = 4;
constexpr bool HAS_BIAS = true;
constexpr bool HAS_KEY_BITS = false;
constexpr bool HAS_SOFTCAP = true;     // logit soft-capping (Gemma 2)
constexpr bool Q_IN_REGS = true;       // else S = Q K^T reads Q from smem
constexpr bool PINGPONG = false;         // the consumers alternate their GEMMs
constexpr int PRODUCER_REGS = 40;
constexpr int CONSUMER_REGS = 232;
constexpr int MAX_CHUNKS = 64;      // chunks of one split row (combine)
constexpr int KSTEP = 2;                // 64-key tiles per softmax step
constexpr int CONSUMERS = 2;        // consumer warpgroups: 64 query rows each
constexpr bool STAGE_O = true;           // O leaves through smem (16-byte stores)
constexpr bool ROWSUM_MMA = true;     // P's row sums by wgmma against ones
// ... inside the P V wgmma (m64n72k16: its ninth n8 block reads a panel of ones that each V
// slot's descriptor reaches by its leading byte offset; head_dim 64), else their own m64n8k16
constexpr bool ROWSUM_IN_PV = true;
// Residue split (stofc/kernels/attention/residue.py): rows of one residue r = q % PERIOD
// meet only keys of that residue, and every residue walks the same mask, so a work is
// (head, batch, residue, item), the walk's rows and keys count residue positions a (real
// row PERIOD a + r), and the tensor maps step PERIOD rows per loaded row. PERIOD 1: none.
constexpr int PERIOD = 1;
// A lean walk (ws_plan.lean_walk): every entry of every work is a full tile of each
// warpgroup (no part tile, no skipped entry, no shared chunk), and the node has no bias and
// no key bits. Then the consumers read no walk entries and evaluate no mask: a work's
// last step, where its tile may cross the run's key length (the walk ascends), cuts the
// keys from kvl on, and nothing else is masked. Head_dim 64, dense rows and BigBird at one
// consumer: +3-4% (ws-variants-lean-cut-h200-2026-11-29). ptxas then waits for the last
// P V inside the rare rescale of O (C7517: lazy rescaling, only where a row max moved).
constexpr bool LEAN_WALK = false && !HAS_BIAS && !HAS_KEY_BITS;
constexpr int ITEM_FIELDS = 5;    // (pair row, begin, end, slot, shared)
// Q buffers: with two (Q read from smem where it fits), the next work's Q loads while this
// work's last steps run, so neither the producer's K/V loads nor a warpgroup done early
// waits at a work boundary for every warpgroup's last S = Q K^T (ws.ws_q_buffers)
constexpr int Q_BUFS = 1;
// Development trace (bench/ws_trace.py; 0 in every product kernel): per block, warpgroup
// and work, clock64 stamps of the work's phases and its waits, in stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_trace
constexpr int TRACE_WORKS = 0;
constexpr bool TRACE = TRACE_WORKS > 0;

constexpr int TILE = 64;                   // mask tile = a warpgroup's rows = keys per step
constexpr int ITN = TILE / 8;
constexpr int NB = TILE / 8;               // n8 blocks of S per tile
constexpr int NS = KSTEP * NB;             // n8 blocks of S per softmax step
constexpr int KC = D / 16;                 // k16 steps of Q K^T
constexpr int ND = D / 8;                  // n8 blocks of O
constexpr int PANELS = D / 64;             // 64-column swizzle panels per row
constexpr int NT = 128 * (CONSUMERS + 1);
constexpr int MIN_BLOCKS = 1;  // blocks resident on one SM (__launch_bounds__)
constexpr int ROWS = TILE * CONSUMERS;     // query rows per block
constexpr int Q_PANEL = ROWS * 128;        // bytes of one Q panel (every warpgroup's rows)
constexpr int Q_WG = TILE * 128;           // bytes of one warpgroup's rows of a Q panel
constexpr int KV_PANEL = TILE * 128;       // bytes of one K (or V) panel
constexpr int KV_BYTES = PANELS * KV_PANEL;
constexpr int BM_BYTES = ITN * ITN * 8;    // one part tile's bitmaps (128 threads x 32 bits)
constexpr int Q_BYTES = PANELS * Q_PANEL;   // one Q buffer
constexpr int OFF_K = Q_BUFS * Q_BYTES;
constexpr int K_PANEL_STRIDE = STAGES * KV_PANEL;   // K: panel-major, the slots of a panel
                                                     // back to back (two tiles = 128 key rows)
constexpr int OFF_V = OFF_K + STAGES * KV_BYTES;
constexpr int OFF_BM = OFF_V + STAGES * KV_BYTES;
constexpr int OFF_BAR = OFF_BM + STAGES * CONSUMERS * BM_BYTES;
// B of the row-sum wgmma (ROWSUM_MMA): 16 keys x 8 columns of ones, K-major, no swizzle; with
// ROWSUM_IN_PV 16 keys x 64 columns (every byte a one: whatever chunk the swizzle picks)
// the work records (one per Q buffer: the producer resolves each work and hands it to the
// consumers with its Q, ws_smem.WORK_RECORD_BYTES), 16-byte aligned after the mbarriers
constexpr int OFF_WORK = OFF_BAR + (4 * STAGES + 2 * Q_BUFS) * 8;
constexpr int WORK_BYTES = 48;
constexpr int OFF_ONES = (OFF_WORK + Q_BUFS * WORK_BYTES + 127) / 128 * 128;
constexpr int ONES_BYTES = 2048;
constexpr int OFF_O = OFF_ONES + ONES_BYTES;                                 // staged O
constexpr int O_WARP = 16 * staged_row_bytes<D>();   // a consumer warp's 16 staged rows
constexpr int SMEM_END = STAGE_O ? OFF_O + CONSUMERS * 4 * O_WARP : OFF_O;
static_assert(SMEM_END + 1024 <= 107776, "the launch's dynamic shared memory (ws_smem_bytes) "
              "holds every region and the 1024 bytes of alignment slack");
constexpr int BAR_FULL_K = 0, BAR_EMPTY_K = STAGES, BAR_FULL_V = 2 * STAGES,
              BAR_EMPTY_V = 3 * STAGES, BAR_Q = 4 * STAGES, BAR_Q_EMPTY = 4 * STAGES + Q_BUFS;
constexpr int SKIP = -2;                   // entry_part: this warpgroup skips the tile
constexpr int FULL = -1;                   // entry_part: a full tile of this warpgroup
constexpr int BAR_MERGE = CONSUMERS + 1;   // named barrier of the consumers (1..C: ping-pong)
static_assert(D % 64 == 0, "head_dim must fill 128-byte swizzle panels");
static_assert(STAGES >= 2, "the ring needs two stages");
static_assert(Q_BUFS == 1 || (Q_BUFS == 2 && !Q_IN_REGS),
              "a second Q buffer only where Q stays in smem (in registers it is freed at once)");
static_assert(Q_IN_REGS || D >= 128 || CONSUMERS == 4,
              "Q leaves the registers for large head_dims and four consumer warpgroups");
static_assert(KSTEP == 1 || KSTEP == 2, "one or two 64-key tiles per softmax step");
static_assert(OFF_WORK % 16 == 0 && WORK_BYTES >= 48, "a work record: three 16-byte words");
static_assert(ONES_BYTES >= 256, "the row-sum operand: 16 keys x 8 columns of T");
static_assert(!ROWSUM_IN_PV || (ROWSUM_MMA && D == 64 && ONES_BYTES >= 16 * 128),
              "row sums in P V: head_dim 64 (one V panel), a 16-key panel of ones");
static_assert(!ROWSUM_IN_PV || (OFF_ONES - OFF_V >= STAGES * KV_BYTES && OFF_ONES - OFF_V < (1 << 18)),
              "the V descriptors' leading byte offset (14 bits of 16 bytes) reaches the ones "
              "from every slot and k-step (desc_at_ones)");
static_assert(KSTEP == 1 || STAGES % 2 == 0, "two-tile steps take slot pairs 2i, 2i+1");
static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <=
                  65536 / (NT * MIN_BLOCKS) / 8 * 8 * NT,
              "setmaxnreg only moves the registers the block got at entry (ptxas: 65536 / "
              "(NT x MIN_BLOCKS), "
              "rounded down to 8, per thread): asking for more hangs every block");
static_assert(CONSUMERS >= 1 && CONSUMERS <= 4, "one to four consumer warpgroups");
static_assert(MIN_BLOCKS == 1 || (CONSUMERS == 1 && !PINGPONG),
              "blocks share an SM only with one consumer warpgroup, which takes no turns");
static_assert(PERIOD == 1 || PERIOD == 2 || PERIOD == 4, "a TMA box spans <= 256 rows: PERIOD 1, 2 or 4");
constexpr int QF = Q_IN_REGS ? KC : 1;     // Q fragments held in registers
constexpr int H1 = KSTEP == 2 ? 1 : 0;     // the second tile of a step (never used if KSTEP 1)

/// TRACE stamps: the SM's cycle counter and the GPU's nanosecond clock (comparable across SMs)
__device__ __forceinline__ unsigned long long trace_clock() { return clock64(); }
__device__ __forceinline__ unsigned long long trace_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/// Issue S of tile HH of a step into sc's n8 blocks HH*NB..: Q from registers (or smem
/// panels at q_wg), K from the slot at sK.
/// The descriptor of smem operand bytes `off` past the one `desc` describes: the start
/// address field counts 16-byte units and shared memory is below 256 KB, so adding to the
/// descriptor never carries out of the field (the uniform datapath does one add, not the
/// masks and shifts of sw128_desc per k-step). The add is on the low word only: the high
/// word (stride byte offset, layout) stays the same register across a GEMM's k-steps
/// instead of being rebuilt by a carry add for each descriptor.
__device__ __forceinline__ u64 desc_at(u64 desc, u32 off) {
    const u32 lo = static_cast<u32>(desc) + (off >> 4);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

/// desc_at for the V descriptors of ROWSUM_IN_PV: the start address moves `off` bytes on and
/// the leading byte offset `off` bytes back, so the ninth n8 block of every k-step of every
/// slot reads the same panel of ones (one add to the low word: start in bits 0-13, the
/// offset in bits 16-29, neither field leaves its range for offsets inside the ring).
__device__ __forceinline__ u64 desc_at_ones(u64 desc, u32 off) {
    const u32 lo = static_cast<u32>(desc) + (off >> 4) - ((off >> 4) << 16);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

/// The V operand `off` bytes past the one `desc` describes (desc_at_ones with ROWSUM_IN_PV)
__device__ __forceinline__ u64 desc_v_at(u64 desc, u32 off) {
    return ROWSUM_IN_PV ? desc_at_ones(desc, off) : desc_at(desc, off);
}

/// One k16 step of O += P V from the V operand at `dv`; with ROWSUM_IN_PV the same wgmma
/// adds P's row sums to `sums` (every column).
template <int N>
__device__ __forceinline__ void pv_k16(float (&acc)[N][4], float (&sums)[1][4], const u32 (&a)[4],
                                       u64 dv) {
    if constexpr (ROWSUM_IN_PV)
        wgmma_rs_tb_sum<T>(acc, sums, a, dv);
    else
        wgmma_rs_tb<T, D>(acc, a, dv);
}

template <int HH>
__device__ __forceinline__ void s_tile(float (&sc)[NS][4], const u32 (&qf)[QF][4], u64 dk,
                                       u64 dq) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const u64 db = desc_at(dk, (kc >> 2) * K_PANEL_STRIDE + (kc & 3) * 32);
        if (Q_IN_REGS)
            wgmma_rs_at<T, HH * NB>(sc, qf[Q_IN_REGS ? kc : 0], db, kc > 0 ? 1 : 0);
        else
            wgmma_ss_at<T, HH * NB>(sc, desc_at(dq, (kc >> 2) * Q_PANEL + (kc & 3) * 32), db,
                                    kc > 0 ? 1 : 0);
    }
}

/// Mask tile HH of a step (n8 blocks HH*NB..): this thread's 32 bits of the part tile in
/// fragment order (~0u: a full tile), the runtime key word and the bias; see block_tile.cuh
/// mask_step_frag.
template <int HH>
__device__ __forceinline__ void mask_tile(float (&sc)[NS][4], u32 frag, bool need_keys,
                                          const StepKeys& keys, const T* br0, const T* br1,
                                          float inv_scale, int t4) {
    mask_step_frag<T, NB, HAS_BIAS, HAS_KEY_BITS, NS, HH * NB, PERIOD>(
        sc, frag, need_keys, keys, br0, br1, inv_scale, t4);
}

/// S of both tiles of a two-tile step as ONE m64n128 GEMM per k-step: their K panels lie
/// back to back (slots 2i, 2i+1 of each panel), so 128 key rows form one B operand.
template <int N>
__device__ __forceinline__ void s_pair(float (&sc)[N][4], const u32 (&qf)[QF][4], u64 dk,
                                       u64 dq) {
    if constexpr (N == 16) {
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            const u64 db = desc_at(dk, (kc >> 2) * K_PANEL_STRIDE + (kc & 3) * 32);
            if (Q_IN_REGS)
                wgmma_rs_n128<T>(sc, qf[Q_IN_REGS ? kc : 0], db, kc > 0 ? 1 : 0);
            else
                wgmma_ss_n128<T>(sc, desc_at(dq, (kc >> 2) * Q_PANEL + (kc & 3) * 32), db,
                                 kc > 0 ? 1 : 0);
        }
    }
}

/// A position in the K/V ring: its slot and the phase parity of that slot's mbarriers.
struct Ring {
    int slot;
    u32 par;
};

/// The position k <= STAGES tiles after r (compare and subtract: no division by STAGES).
__device__ __forceinline__ Ring ring_at(Ring r, int k) {
    if (k == 0) return r;                  // slot < STAGES always: nothing to wrap
    r.slot += k;
    if (r.slot >= STAGES) {
        r.slot -= STAGES;
        r.par ^= 1u;
    }
    return r;
}

}  // namespace

// TRACE: [TRACE_BLOCKS][CONSUMERS + 1][TRACE_WORKS][8] records, then [TRACE_BLOCKS][8] block
// headers (bench/ws_trace.py reads both); one word where tracing is off
constexpr int TRACE_BLOCKS = 160;
constexpr int TRACE_HEAD = TRACE_BLOCKS * (CONSUMERS + 1) * TRACE_WORKS * 8;
extern "C" __device__ unsigned long long stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_trace[TRACE ? TRACE_HEAD + TRACE_BLOCKS * 8 : 1];
// TRACE, per step: [TRACE_BLOCKS][CONSUMERS][TRACE_WORKS][TRACE_STEPS][2] cycles from the
// work's first step (tc1) to the start of the step's K wait and to its end (before any turn)
constexpr int TRACE_STEPS = 32;
extern "C" __device__ unsigned stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_steps[
    TRACE ? TRACE_BLOCKS * CONSUMERS * TRACE_WORKS * TRACE_STEPS * 2 : 1];

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0(const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
                  const __grid_constant__ TmaDesc tma_v,
                  T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
                  const int* __restrict__ entry_key, const int* __restrict__ entry_part,
                  const u64* __restrict__ bitmaps, const int* __restrict__ items,
                  const int* __restrict__ item_order, int items_head_stride,
                  int order_head_stride,
                  const int* __restrict__ kv_len, const u64* __restrict__ key_bits,
                  int key_words,
                  const T* __restrict__ bias, long long bias_sb, long long bias_sh,
                  long long bias_sq,
                  float* __restrict__ part_o, float* __restrict__ part_ml, int slots,
                  int B, int H, int L, float scale, int kv_group, float softcap,
                  int n_work) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;       // swizzle panels: 1024-byte aligned
    unsigned char* base_ptr = smem_raw + (base - raw);
    const u32 sQ = base;
    auto bar = [&](int i) { return base + OFF_BAR + 8u * static_cast<u32>(i); };

    // Work w -> (head, batch, item): heads of one batch are neighbours, items longest first.
    // The grid is persistent (at most MIN_BLOCKS blocks an SM) and deals the works, longest first,
    // in snaking waves (ws_work_index: a plain deal gave block 0 the longest work of every
    // wave, causal rows 19% above the mean at B=1, L=8192). Producer and consumers walk the
    // same sequence, so the ring continues across works and the next work's loads overlap
    // this one's last steps and its epilogue.
    auto work_index = [&](int k) {
        return ws_work_index(k, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
    };
    // sh: 0, or 1 + w0 for a shared chunk (ws_plan.py): every warpgroup computes tile row
    // C prow + w0 and takes every CONSUMERS-th entry; warpgroups w > 0 leave their partials
    // in the slot's rows of tile row (w0 + w) % CONSUMERS, which warpgroup 0 merges
    struct Work {
        int h, b, r, vb, lr, prow, begin, n, slot, kvl, sh, wk;
    };
    static_assert(sizeof(Work) == 48, "a work record is three 16-byte words");
    // work w: head w % H, then (batch, residue) as one index vb = batch * PERIOD + residue,
    // then the item; lr: the residue's rows, kvl: its keys (PERIOD 1: L and the key length)
    auto work_at = [&](int wk) {
        Work x;
        x.wk = wk;
        int idx = wk;
        x.h = idx % H; idx /= H;
        x.vb = idx % (B * PERIOD); idx /= B * PERIOD;
        x.b = x.vb / PERIOD;
        x.r = x.vb - x.b * PERIOD;
        x.lr = (L - x.r + PERIOD - 1) / PERIOD;
        const int* it = items + x.h * items_head_stride +
                        ITEM_FIELDS * item_order[x.h * order_head_stride + idx];
        x.prow = it[0];
        x.begin = it[1];
        int end = it[2];
        x.slot = it[3];
        x.sh = it[4];                                            // 0, or 1 + w0
        const int kvl = min(kv_len[x.b], L);
        x.kvl = kvl > x.r ? (kvl - x.r + PERIOD - 1) / PERIOD : 0;
        if (x.prow < 0 || x.prow * ROWS >= x.lr) x.prow = -1;   // padding, or rows past this run
        end = trim_walk(entry_key, x.begin, end, x.kvl, TILE);   // tiles past the keys
        x.n = max(end - x.begin, 0);
        return x;
    };
    // The producer resolves every work (above: dependent global loads; the consumers
    // waited 1.0-1.2k cycles a work for them, ws-trace-h100-2026-11-28-before-records) and
    // hands it over in Q buffer qb's record,
    // which the buffer's BAR_Q phase publishes (the arrive releases the stores; the
    // consumers' wait acquires them) and its BAR_Q_EMPTY phase frees; prow -1: no more work
    auto put_work = [&](int qbuf, const Work& x) {
        const int* v = reinterpret_cast<const int*>(&x);
        const u32 at = base + OFF_WORK + qbuf * WORK_BYTES;
#pragma unroll
        for (int i = 0; i < 3; ++i)
            asm volatile("st.shared.v4.b32 [%0], { %1, %2, %3, %4 };\n"
                         :: "r"(at + 16 * i), "r"(v[4 * i]), "r"(v[4 * i + 1]), "r"(v[4 * i + 2]),
                            "r"(v[4 * i + 3]) : "memory");
    };
    auto get_work = [&](int qbuf) {
        Work x;
        int* v = reinterpret_cast<int*>(&x);
        const u32 at = base + OFF_WORK + qbuf * WORK_BYTES;
#pragma unroll
        for (int i = 0; i < 3; ++i)
            asm volatile("ld.shared.v4.b32 { %0, %1, %2, %3 }, [%4];\n"
                         : "=r"(v[4 * i]), "=r"(v[4 * i + 1]), "=r"(v[4 * i + 2]), "=r"(v[4 * i + 3])
                         : "r"(at + 16 * i) : "memory");
        return x;
    };

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar(BAR_FULL_K + s), 1);
            mbar_init(bar(BAR_FULL_V + s), 1);
            mbar_init(bar(BAR_EMPTY_K + s), 4 * CONSUMERS);  // one arrival per consumer warp
            mbar_init(bar(BAR_EMPTY_V + s), 4 * CONSUMERS);  // (bitmap reads; wgmma reads)
        }
#pragma unroll
        for (int qb = 0; qb < Q_BUFS; ++qb) {
            mbar_init(bar(BAR_Q + qb), 1);
            mbar_init(bar(BAR_Q_EMPTY + qb), 4 * CONSUMERS);   // one arrival per consumer warp
        }
        mbar_fence_init();
    }
    if (ROWSUM_MMA) {                                      // the ones the row-sum wgmma reads
        const u32 one2 = DTypeTraits<T>::pack(1.0f, 1.0f);
        for (int i = threadIdx.x; i < ONES_BYTES / 4; i += NT)
            asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(base + OFF_ONES + 4u * i), "r"(one2)
                         : "memory");
        fence_proxy_async_smem();                          // visible to wgmma (async proxy)
    }
    __syncthreads();
    // programmatic dependent launch (pdl.cuh): nothing global is read or written above this
    // line (kv_len and key_bits come from KeyPrep, q/k/v from the GEMM before, o may reuse
    // memory the previous kernel reads); the combine may launch as these blocks run
    pdl_wait();
    pdl_launch_dependents();
    // TRACE: record k of warpgroup wgi (0: the producer) of this block, and its header
    const bool tracing = TRACE && blockIdx.x < TRACE_BLOCKS;
    auto trace_rec = [&](int wgi, int k) {
        return stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_trace +
               ((static_cast<long long>(blockIdx.x) * (CONSUMERS + 1) + wgi) * TRACE_WORKS + k) * 8;
    };
    unsigned long long* const trace_head = stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_trace + TRACE_HEAD + 8 * blockIdx.x;
    if (tracing && threadIdx.x == 0) {
        u32 smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        trace_head[0] = smid;
        trace_head[1] = trace_ns();
        trace_head[3] = trace_clock();
    }

    // warp-uniform in the compiler's eyes (a shuffle from lane 0): wgmma issued under
    // conditions on it stays in a non-divergent path and is not serialised
    const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
    if (wg == 0) {
        // ================================================================ producer
        regs_release<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        tma_prefetch(&tma_q);
        tma_prefetch(&tma_k);
        tma_prefetch(&tma_v);
        int ring = 0, q_use = 0;                   // tiles loaded so far, records so far
        for (int k = 0, wk = work_index(0); wk < n_work; wk = work_index(++k)) {
            const unsigned long long tr0 = TRACE ? trace_clock() : 0ull;
            unsigned long long tr_wait = 0ull;        // cycles waiting for free slots
            const Work x = work_at(wk);
            if (x.prow < 0) continue;                 // padding, or rows past this run: no one's
            const int hkv = x.h / kv_group;
            // buffer qb's previous work (q_use - Q_BUFS) must be released first
            const int qb = q_use % Q_BUFS;
            if (q_use >= Q_BUFS) mbar_wait(bar(BAR_Q_EMPTY + qb), ((q_use - Q_BUFS) / Q_BUFS) & 1);
            const unsigned long long tr1 = TRACE ? trace_clock() : 0ull;
            ++q_use;
            put_work(qb, x);
            if (x.n == 0) {                           // no tile left: the record alone
                mbar_arrive(bar(BAR_Q + qb));
                continue;
            }
            mbar_arrive_expect_tx(bar(BAR_Q + qb), Q_BYTES);
#pragma unroll
            for (int w = 0; w < CONSUMERS; ++w)
#pragma unroll
                for (int pn = 0; pn < PANELS; ++pn)
                    tma_load_4d(sQ + qb * Q_BYTES + pn * Q_PANEL + w * Q_WG, &tma_q, bar(BAR_Q + qb), pn * 64,
                                x.h, PERIOD * (x.prow * ROWS + (x.sh ? x.sh - 1 : w) * TILE) + x.r,
                                x.b);
            // V of entry begin + i (its key: the K load's, already in a register)
            auto load_v = [&](int i, int key) {
                const int g = ring + i;
                const int s = g % STAGES, use = g / STAGES;
                if constexpr (TRACE) {
                    const unsigned long long t = trace_clock();
                    if (use > 0) mbar_wait(bar(BAR_EMPTY_V + s), (use - 1) & 1);
                    tr_wait += trace_clock() - t;
                } else {
                    if (use > 0) mbar_wait(bar(BAR_EMPTY_V + s), (use - 1) & 1);
                }
                mbar_arrive_expect_tx(bar(BAR_FULL_V + s), KV_BYTES);
#pragma unroll
                for (int pn = 0; pn < PANELS; ++pn)
                    tma_load_4d(base + OFF_V + s * KV_BYTES + pn * KV_PANEL, &tma_v,
                                bar(BAR_FULL_V + s), pn * 64, hkv, PERIOD * key + x.r, x.b);
            };
            const int n_load = (x.n + KSTEP - 1) / KSTEP * KSTEP;   // whole steps (pad: a real tile)
            // The walk entries are read one tile ahead, before the wait for a free slot:
            // a freed slot's refill then waits only for the TMA, not for a global load first.
            int key = 0, part[CONSUMERS];
            // (a shared chunk: entry i is warpgroup i % CONSUMERS's, with tile row w0's bitmaps)
            auto read_entry = [&](int i, int& k, int (&p)[CONSUMERS]) {
                const int j = x.begin + i;
                k = entry_key[j];
                if (x.sh) {
                    const int mine = entry_part[CONSUMERS * j + x.sh - 1];
#pragma unroll
                    for (int w = 0; w < CONSUMERS; ++w) p[w] = i % CONSUMERS == w ? mine : SKIP;
                } else {
#pragma unroll
                    for (int w = 0; w < CONSUMERS; ++w) p[w] = entry_part[CONSUMERS * j + w];
                }
            };
            if (n_load > 0) read_entry(0, key, part);
            int prev_key = 0;
            for (int i = 0; i < n_load; ++i) {
                int next_key = 0, next_part[CONSUMERS];
                if (i + 1 < n_load) read_entry(i + 1, next_key, next_part);
                const int g = ring + i;
                const int s = g % STAGES, use = g / STAGES;
                if constexpr (TRACE) {
                    const unsigned long long t = trace_clock();
                    if (use > 0) mbar_wait(bar(BAR_EMPTY_K + s), (use - 1) & 1);
                    tr_wait += trace_clock() - t;
                } else {
                    if (use > 0) mbar_wait(bar(BAR_EMPTY_K + s), (use - 1) & 1);
                }
                u32 bytes = KV_BYTES;
#pragma unroll
                for (int w = 0; w < CONSUMERS; ++w) bytes += part[w] >= 0 ? BM_BYTES : 0;
                const u32 full = bar(BAR_FULL_K + s);
                mbar_arrive_expect_tx(full, bytes);
#pragma unroll
                for (int pn = 0; pn < PANELS; ++pn)
                    tma_load_4d(base + OFF_K + pn * K_PANEL_STRIDE + s * KV_PANEL, &tma_k, full, pn * 64,
                                hkv, PERIOD * key + x.r, x.b);
                const u32 sbm = base + OFF_BM + s * CONSUMERS * BM_BYTES;
#pragma unroll
                for (int w = 0; w < CONSUMERS; ++w)
                    if (part[w] >= 0)
                        bulk_load(sbm + w * BM_BYTES, bitmaps + static_cast<long long>(part[w]) * ITN * ITN,
                                  BM_BYTES, full);
                if (i > 0) load_v(i - 1, prev_key);    // K of this tile before V of the last one
                prev_key = key;
                key = next_key;
#pragma unroll
                for (int w = 0; w < CONSUMERS; ++w) part[w] = next_part[w];
            }
            if (n_load > 0) load_v(n_load - 1, prev_key);
            ring += n_load;
            if (tracing && k < TRACE_WORKS) {
                unsigned long long* r = trace_rec(0, k);
                r[0] = wk; r[1] = tr0; r[2] = tr1; r[3] = trace_clock(); r[4] = tr_wait;
                r[5] = n_load;
            }
        }
        {                                             // the end: a record with prow -1
            const int qb = q_use % Q_BUFS;
            if (q_use >= Q_BUFS) mbar_wait(bar(BAR_Q_EMPTY + qb), ((q_use - Q_BUFS) / Q_BUFS) & 1);
            Work end{};
            end.prow = -1;
            put_work(qb, end);
            mbar_arrive(bar(BAR_Q + qb));
        }
        return;
    }

    // ==================================================================== consumers
    regs_acquire<CONSUMER_REGS>();
    const int w = wg - 1;                          // this warpgroup's tile row: 2p + w
    const int tid = threadIdx.x & 127;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int bar_mine = 1 + w, bar_other = 1 + (w + 1) % CONSUMERS;   // ping-pong turns

    const float sl = scale * STOFC_LOG2E;            // scores -> log2 units
    const float inv_scale = 1.0f / scale;            // bias in raw score units
    const float cap = softcap / scale;               // soft-capping in raw score units
    const float inv_cap = scale / softcap;
    const u32 q_wg = sQ + w * Q_WG;                  // this warpgroup's 64 rows of each Q panel
    const u32 o_stage = base + OFF_O + (w * 4 + warp) * O_WARP;   // this warp's staged O rows
    // 16-byte stores need every row of O 16-byte aligned (always so for the runtime's and
    // the ORT op's contiguous outputs; another layout takes the 4-byte stores)
    const bool o_vec = ((reinterpret_cast<unsigned long long>(o) |
                         static_cast<unsigned long long>(o_sb | o_ss | o_sh) * sizeof(T)) & 15ull) == 0;

    // the current work's values (set at each work; the step lambdas below read them)
    int q_use = 0;                                 // work records consumed so far
    int qb = 0;                                    // the current work's Q buffer
    Ring cur{0, 0u};                               // the ring position of the next step
    int begin = 0, n = 0, kvl = 0, residue = 0, shared = 0;
    const u64* kbits = key_bits;
    const T* br0 = nullptr;
    const T* br1 = nullptr;
    u32 qf[Q_IN_REGS ? KC : 1][4];
    float acc[ND][4];
    float lacc[1][4];                              // ROWSUM_MMA: P's row sums (every column)
    float row_m[2], row_l[2];
    u32 pf_prev[NS / 2][4];
    float alpha_prev[2];
    bool rescale_prev = false;                     // some row of this warp moved its max
    bool prev_any = false;
    Ring prev_i0 = cur;                            // the previous step's ring position

    // every warp releases the Q buffer once its lanes are done with it
    auto release_q = [&]() {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar(BAR_Q_EMPTY + qb));
    };
    // slot / phase parity of tile hh of the step at ring position p (no division: STAGES
    // need not be a power of two)
    auto slot_of = [&](Ring p, int hh) { return ring_at(p, hh).slot; };
    const u64 desc_k0 = sw128_desc(base + OFF_K, 16, 1024);          // K slot 0 panel 0, K-major
    // V slot 0, N-major; with ROWSUM_IN_PV its "next panel" is the ones (desc_at_ones)
    const u64 desc_v0 = sw128_desc(base + OFF_V, ROWSUM_IN_PV ? OFF_ONES - OFF_V : KV_PANEL, 1024);
    const u64 desc_q0 = sw128_desc(q_wg, 16, 1024);                  // Q buffer 0 (from smem)
    u64 desc_q = desc_q0;                                            // the current work's Q
    // ones (ROWSUM_MMA): the two 8 x 16-byte core matrices of a k16 step 128 bytes apart
    const u64 desc_ones = plain_desc(base + OFF_ONES, 128, 128);
    auto parity_of = [&](Ring p, int hh) { return ring_at(p, hh).par; };
    // A K slot also holds the step's bitmaps, read by every thread in mask_tile: each warp
    // releases it once all its lanes are past their reads.
    auto release_k = [&](Ring i0) {
        __syncwarp();
#pragma unroll
        for (int hh = 0; hh < KSTEP; ++hh)
            if (lane == 0) mbar_arrive(bar(BAR_EMPTY_K + slot_of(i0, hh)));
    };
    // A V slot is released only once it is full (also when this warpgroup skipped the
    // step): otherwise a warpgroup walking skipped tiles could arrive for a later use of
    // the slot before the other one released this use (seen without the ping-pong).
    // Every warp waits and arrives for itself (the slot counts 8 arrivals): with one
    // arrival per warpgroup, the producer could refill the slot once the leader arrived,
    // and a warp still behind (a bias load) then waited on the refill's phase parity, which
    // reads as "not yet", for ever (seen with a bias). A leader-only wait avoided that but
    // made the release divergent, which cost 10-17% on dense tiles (H100, 2026-11-25).
    auto release_v = [&](Ring i0) {
#pragma unroll
        for (int hh = 0; hh < KSTEP; ++hh) {
            mbar_wait(bar(BAR_FULL_V + slot_of(i0, hh)), parity_of(i0, hh));
            if (lane == 0) mbar_arrive(bar(BAR_EMPTY_V + slot_of(i0, hh)));
        }
    };
    // Every step issues its GEMMs and retires them inside ONE branch (ptxas otherwise
    // cannot prove the accumulators retired and serialises every wgmma). The pins order
    // register updates (rescale) before each wgmma.fence. S of tile hh fills the n8
    // blocks hh*NB.. of sc (the start value is ignored: the first k-step overwrites).
    auto issue_s = [&](float (&sc)[NS][4], Ring i0) {
        wgmma_pin(sc);
        wgmma_fence();
        if (KSTEP == 2)                            // slots 2i, 2i+1: one 128-row B operand
            s_pair(sc, qf, desc_at(desc_k0, slot_of(i0, 0) * KV_PANEL), desc_q);
        else
            s_tile<0>(sc, qf, desc_at(desc_k0, slot_of(i0, 0) * KV_PANEL), desc_q);
        wgmma_commit();
    };
    // O = alpha * O + P V of the previous step: V N-major (transposed), P from registers
    auto issue_pv = [&](Ring i0) {
#pragma unroll
        for (int hh = 0; hh < KSTEP; ++hh)
            mbar_wait(bar(BAR_FULL_V + slot_of(i0, hh)), parity_of(i0, hh));
        if (rescale_prev) {                                    // warp-uniform (a vote)
            rescale_rows<ND>(acc, alpha_prev);
            if (ROWSUM_MMA) rescale_rows<1>(lacc, alpha_prev);
        }
        wgmma_pin(acc);
        if (ROWSUM_MMA) wgmma_pin(lacc);
        wgmma_keep(pf_prev);
        wgmma_fence();
#pragma unroll
        for (int hh = 0; hh < KSTEP; ++hh) {
            const u64 dv = desc_v_at(desc_v0, slot_of(i0, hh) * KV_BYTES);
#pragma unroll
            for (int kk = 0; kk < NB / 2; ++kk)
                pv_k16(acc, lacc, pf_prev[hh * (NB / 2) + kk], desc_v_at(dv, kk * 16 * 128));
        }
        if (ROWSUM_MMA && !ROWSUM_IN_PV) {
#pragma unroll
            for (int kk = 0; kk < NS / 2; ++kk) wgmma_rs_n8<T>(lacc, pf_prev[kk], desc_ones);
        }
        wgmma_commit();
    };
    // the online-softmax step on masked (or full) scores: P in place, as floats, and the
    // rescale alpha; true where a row's max moved
    auto exp_step = [&](float (&sc)[NS][4], float (&alpha)[2]) -> bool {
        if (ROWSUM_MMA) {
            float unused_l[2] = {0.0f, 0.0f};      // the sums come from the row-sum wgmma
            return softmax_exp_lazy<NS>(sc, row_m, unused_l, sl, alpha);
        }
        return softmax_exp_lazy<NS>(sc, row_m, row_l, sl, alpha);
    };
    // masks (a tile this warpgroup skips: every score -inf), then the online-softmax step
    auto softmax = [&](float (&sc)[NS][4], Ring i0, const int (&key)[KSTEP],
                       const int (&part)[KSTEP], float (&alpha)[2]) -> bool {
        if (HAS_SOFTCAP) soft_cap_step<NS>(sc, cap, inv_cap);
#pragma unroll
        for (int hh = 0; hh < KSTEP; ++hh) {
            if (part[hh] == SKIP) {
#pragma unroll
                for (int nn = 0; nn < NB; ++nn)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sc[hh * NB + nn][e] = STOFC_NEG_INF;
                continue;
            }
            const u64 kword = residue_key_word<HAS_KEY_BITS, PERIOD>(key[hh], kvl, kbits,
                                                                     key_words, residue);
            const bool need_keys = kword != ~0ull;
            if (part[hh] >= 0 || need_keys || HAS_BIAS) {
                // a part tile's bitmaps are in fragment order: word tid is this thread's
                const u32 frag = part[hh] >= 0
                    ? reinterpret_cast<const u32*>(base_ptr + OFF_BM +
                                                   (slot_of(i0, hh) * CONSUMERS + w) * BM_BYTES)[tid]
                    : ~0u;
                const StepKeys keys{key[hh], nullptr, kvl, kbits, kword};
                if (hh == 0)
                    mask_tile<0>(sc, frag, need_keys, keys, br0, br1, inv_scale, t4);
                else
                    mask_tile<H1>(sc, frag, need_keys, keys, br0, br1, inv_scale, t4);
            }
        }
        return exp_step(sc, alpha);
    };
    // P becomes the next P V's A fragments only once the last P V retired (FA3's order:
    // defining a wgmma's input registers while another is in flight serialises them)
    auto keep_probs = [&](const float (&sc)[NS][4], const float (&alpha)[2], bool moved) {
        pack_probs<T, NS>(sc, pf_prev);
        alpha_prev[0] = alpha[0];
        alpha_prev[1] = alpha[1];
        rescale_prev = __any_sync(0xffffffffu, moved);
    };
    // entry i of the work's walk: its key and this warpgroup's part (SKIP past the walk)
    auto entry_at = [&](int i, int& key, int& part) {
        const int j = begin + min(i, max(n - 1, 0));
        key = entry_key[j];
        const bool mine = i < n && (shared == 0 || i % CONSUMERS == w);
        part = mine ? entry_part[CONSUMERS * j + (shared ? shared - 1 : w)] : SKIP;
    };
    // The entries come in batches of 32. Lane l holds entry e0 + l of the current batch,
    // so a step takes its KSTEP entries by shuffles (uniform values) instead of dependent
    // loads and their address arithmetic; the next batch loads half a batch before it is
    // needed. `lean` has bit l set where entry e0 + l is a full tile of this warpgroup whose
    // keys all lie in the run, with no bias (two-tile steps: bit l where entries l and l + 1
    // both are): after a step that computed, such a step takes the lean path (no entries,
    // no mask decision, no bitmap address).
    int batch_key = 0, batch_part = SKIP, next_key = 0, next_part = SKIP;
    u32 lean = 0u;
    // the batch of step t's entries KSTEP t, ... (the steps of a work come as t = 0, 1, ...)
    auto advance_batch = [&](int t) {
        const int e = t * KSTEP;
        if ((e & 31) == 0) {
            if (e == 0) {
                entry_at(lane, batch_key, batch_part);
            } else {
                batch_key = next_key;
                batch_part = next_part;
            }
            const bool full = !HAS_BIAS && batch_part == FULL &&
                residue_key_word<HAS_KEY_BITS, PERIOD>(batch_key, kvl, kbits, key_words,
                                                       residue) == ~0ull;
            lean = __ballot_sync(0xffffffffu, full);
            if (KSTEP == 2) lean &= lean >> 1;
        }
        if ((e & 31) == 16) entry_at(e + 16 + lane, next_key, next_part);
    };
    // S of step i0 and P V of the last one in flight, the softmax under the P V GEMM;
    // `scores(sc, alpha)` masks and exponentiates S and says whether a row's max moved
    auto overlapped = [&](Ring i0, bool pp, auto&& scores) {
        float sc[NS][4];
        issue_s(sc, i0);
        issue_pv(prev_i0);
        if (pp) named_bar_arrive(bar_other, 256);
        wgmma_wait<1>();
        wgmma_pin(sc);
        float alpha[2];
        const bool moved = scores(sc, alpha);      // reads the bitmaps: then
        release_k(i0);                             // release the K slots
        wgmma_wait<0>();                           // P V done: its P may be overwritten now
        wgmma_pin(acc);
        if (ROWSUM_MMA) wgmma_pin(lacc);
        wgmma_keep(pf_prev);
        release_v(prev_i0);
        keep_probs(sc, alpha, moved);
    };

    // TRACE: step t of work k waited for its K from tw to tt (cycles on from the work's tc1)
    auto trace_step = [&](int k, int t, unsigned long long t0, unsigned long long tw,
                          unsigned long long tt) {
        if (tracing && tid == 0 && k < TRACE_WORKS && t < TRACE_STEPS) {
            unsigned* r = stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_steps +
                          (((static_cast<long long>(blockIdx.x) * CONSUMERS + w) * TRACE_WORKS + k) *
                           TRACE_STEPS + t) * 2;
            r[0] = static_cast<unsigned>(tw - t0);
            r[1] = static_cast<unsigned>(tt - t0);
        }
    };
    if (PINGPONG && w == 0) named_bar_arrive(bar_mine, 256);   // warpgroup 0 issues first
    for (int k = 0;; ++k) {
        const unsigned long long tc0 = TRACE ? trace_clock() : 0ull;
        unsigned long long tc_kwait = 0ull, tc_turn = 0ull;   // cycles waiting for K, for turns
        int tc_steps = 0;                                     // steps that computed
        // the next work, as the producer resolved it, with its Q (put_work)
        qb = q_use % Q_BUFS;
        mbar_wait(bar(BAR_Q + qb), (q_use / Q_BUFS) & 1);
        const Work x = get_work(qb);
        if (x.prow < 0) break;                     // the producer's end record
        // An item with no tile left (keys past the run: a long package's split global row
        // run short) loads no Q and walks nothing; it only writes its empty result.
        const bool empty = x.n == 0;
        begin = x.begin;
        n = x.n;
        kvl = x.kvl;
        residue = x.r;
        shared = x.sh;
        const int qrow = x.sh ? x.sh - 1 : w;      // the pair row's tile row this warpgroup computes
        kbits = key_bits + (HAS_KEY_BITS ? x.b * key_words : 0);
        const int rq0 = x.prow * ROWS + qrow * TILE + warp * 16 + g;   // this thread's query rows
        if (HAS_BIAS) {            // real row PERIOD qr + r; its keys PERIOD c + r (mask_step)
            auto bias_row = [&](int qr) {
                return bias + x.b * bias_sb + x.h * bias_sh +
                       min(max(PERIOD * qr + x.r, 0), L - 1) * bias_sq + x.r;
            };
            br0 = bias_row(rq0);
            br1 = bias_row(rq0 + 8);
        }
        desc_q = desc_at(desc_q0, qb * Q_BYTES);
        if (empty) release_q();                    // a record without Q: read, done with it
        if (Q_IN_REGS && !empty) {
#pragma unroll
            for (int kc = 0; kc < (Q_IN_REGS ? KC : 1); ++kc) {
                const int row = w * TILE + warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int chunk = (kc & 3) * 2 + (lane >> 4);
                ldmatrix_x4(qf[kc], sQ + qb * Q_BYTES + (kc >> 2) * Q_PANEL + sw128_offset(row, chunk));
            }
            release_q();                           // Q lives in registers now
        }
        const unsigned long long tc1 = TRACE ? trace_clock() : 0ull;
#pragma unroll
        for (int nn = 0; nn < ND; ++nn)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[nn][e] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) lacc[0][e] = 0.0f;
        row_m[0] = row_m[1] = STOFC_NEG_INF;
        row_l[0] = row_l[1] = 0.0f;
        alpha_prev[0] = alpha_prev[1] = 1.0f;
        rescale_prev = false;
        prev_any = false;

        const int steps = (n + KSTEP - 1) / KSTEP;
        // a lean walk's last step: its entries (padding past the walk: SKIP), loaded here,
        // long before the step reads them, and whether its tiles hold only keys of the run
        int last_key[KSTEP], last_part[KSTEP];
        bool last_inside = false;
        if constexpr (LEAN_WALK) {
            last_inside = steps > 0;
#pragma unroll
            for (int hh = 0; hh < KSTEP; ++hh) {
                const int i = (steps - 1) * KSTEP + hh;
                last_key[hh] = steps > 0 ? entry_key[begin + min(i, n - 1)] : 0;
                last_part[hh] = i < n ? FULL : SKIP;
                last_inside = last_inside && i < n &&
                    residue_key_word<HAS_KEY_BITS, PERIOD>(last_key[hh], kvl, kbits, key_words,
                                                           residue) == ~0ull;
            }
        }
        // a shared chunk's warpgroups do not take turns: each computes every C-th entry, and
        // turns would wait each one's GEMMs on the previous one's softmax
        const bool pp = PINGPONG && x.sh == 0;
        for (int t = 0; t < steps; ++t) {
            const Ring i0 = cur;
            if (!LEAN_WALK) advance_batch(t);
            const int e = (t * KSTEP) & 31;        // step t's first entry in the batch
            // a lean walk's step: full tiles, every key in the run (the last one: if so);
            // else (its last step) the run's keys end inside it: keys from kvl on are cut
            const bool inside = LEAN_WALK && (t + 1 < steps || last_inside);
            const bool cut = LEAN_WALK && !inside;
            // a lean step's scores (a full tile, every key in the run, no bias: soft-capping
            // only), or a lean walk's step with its cut
            auto softmax_lean = [&](float (&sc)[NS][4], float (&alpha)[2]) -> bool {
                if (HAS_SOFTCAP) soft_cap_step<NS>(sc, cap, inv_cap);
                if (cut) {
    #pragma unroll
                    for (int hh = 0; hh < KSTEP; ++hh) {
                        const int valid = last_part[hh] == SKIP ? 0 : kvl - last_key[hh];
    #pragma unroll
                        for (int nn = 0; nn < NB; ++nn)
    #pragma unroll
                            for (int e2 = 0; e2 < 4; ++e2)
                                if (nn * 8 + 2 * t4 + (e2 & 1) >= valid)
                                    sc[hh * NB + nn][e2] = STOFC_NEG_INF;
                    }
                }
                return exp_step(sc, alpha);
            };
            if (prev_any && (LEAN_WALK || ((lean >> e) & 1u))) {
                const unsigned long long tw = TRACE ? trace_clock() : 0ull;
    #pragma unroll
                for (int hh = 0; hh < KSTEP; ++hh)
                    mbar_wait(bar(BAR_FULL_K + slot_of(i0, hh)), parity_of(i0, hh));
                const unsigned long long tt = TRACE ? trace_clock() : 0ull;
                if (pp) named_bar_sync(bar_mine, 256);
                if constexpr (TRACE) {
                    tc_kwait += tt - tw;
                    tc_turn += trace_clock() - tt;
                    ++tc_steps;
                    trace_step(k, t, tc1, tw, tt);
                }
                overlapped(i0, pp, softmax_lean);
                prev_i0 = i0;
                cur = ring_at(cur, KSTEP);
                continue;
            }
            int key[KSTEP], part[KSTEP];
    #pragma unroll
            for (int hh = 0; hh < KSTEP; ++hh) {
                key[hh] = LEAN_WALK ? last_key[hh] : __shfl_sync(0xffffffffu, batch_key, e + hh);
                part[hh] = LEAN_WALK ? (inside ? FULL : last_part[hh])
                                     : __shfl_sync(0xffffffffu, batch_part, e + hh);
            }
            bool any = false;
            const unsigned long long tw = TRACE ? trace_clock() : 0ull;
    #pragma unroll
            for (int hh = 0; hh < KSTEP; ++hh) {
                mbar_wait(bar(BAR_FULL_K + slot_of(i0, hh)), parity_of(i0, hh));
                any = any || part[hh] != SKIP;
            }
            const unsigned long long tt = TRACE ? trace_clock() : 0ull;
            if (pp) named_bar_sync(bar_mine, 256);
            if constexpr (TRACE) {
                tc_kwait += tt - tw;
                tc_turn += trace_clock() - tt;
                tc_steps += any ? 1 : 0;
                trace_step(k, t, tc1, tw, tt);
            }
            if (any && prev_any) {
                overlapped(i0, pp, [&](float (&sc)[NS][4], float (&alpha)[2]) {
                    return softmax(sc, i0, key, part, alpha);
                });
            } else if (any) {
                float sc[NS][4];
                issue_s(sc, i0);
                if (pp) named_bar_arrive(bar_other, 256);
                wgmma_wait<0>();
                wgmma_pin(sc);
                if (t > 0) release_v(prev_i0);
                float alpha[2];
                const bool moved = LEAN_WALK ? softmax_lean(sc, alpha)   // (a work's first step)
                                             : softmax(sc, i0, key, part, alpha);
                release_k(i0);
                keep_probs(sc, alpha, moved);
            } else if (prev_any) {
                issue_pv(prev_i0);
                if (pp) named_bar_arrive(bar_other, 256);
                wgmma_wait<0>();
                wgmma_pin(acc);
                if (ROWSUM_MMA) wgmma_pin(lacc);
                wgmma_keep(pf_prev);
                release_k(i0);
                release_v(prev_i0);
            } else {
                if (pp) named_bar_arrive(bar_other, 256);
                release_k(i0);
                if (t > 0) release_v(prev_i0);
            }
            prev_any = any;
            prev_i0 = i0;
            cur = ring_at(cur, KSTEP);
        }
        if (steps > 0) {                               // the last step's O += P V
            if (prev_any) {
                issue_pv(prev_i0);
                wgmma_wait<0>();
                wgmma_pin(acc);
                if (ROWSUM_MMA) wgmma_pin(lacc);
            }
            release_v(prev_i0);
        }
        const unsigned long long tc2 = TRACE ? trace_clock() : 0ull;

        if (!Q_IN_REGS && !empty) release_q();     // the last S = Q K^T has retired
        if (ROWSUM_MMA) {          // every lane holds its rows' whole sums: one per quad, as
            row_l[0] = t4 == 0 ? lacc[0][0] : 0.0f;  // the softmax's quad-partial sums are
            row_l[1] = t4 == 0 ? lacc[0][2] : 0.0f;
        }
        // ---- epilogue: a whole row writes O; a chunk writes its partial result
        if (x.slot < 0) {
            T* ob = o + x.b * o_sb + x.h * o_sh + x.r * o_ss;     // residue rows: PERIOD apart
            if (STAGE_O && o_vec)
                store_rows_staged<T, ND>(acc, row_l, rq0 - g, ob, PERIOD * o_ss, x.lr, lane, o_stage);
            else
                store_rows<T, ND>(acc, row_l, rq0, rq0 + 8, ob, PERIOD * o_ss, x.lr, t4);
        } else {
        const long long head_ws = (static_cast<long long>(x.vb) * H + x.h) * slots;
        const int lr0 = qrow * TILE + warp * 16 + g;   // rows inside the block
        float l0 = quad_sum(row_l[0]), l1 = quad_sum(row_l[1]);
        // a shared chunk's slot: tile row qrow's rows take the merged result, those of
        // tile row (qrow + k) % CONSUMERS (k > 0) warpgroup k's partial until the merge
        auto scratch_row = [&](int k) { return ((qrow + k) % CONSUMERS) * TILE + warp * 16 + g; };
        if (x.sh) {
            // a shared chunk: warpgroups w > 0 leave (O, m, l) in the slot's rows of another
            // tile row; after the barrier (global writes of this block are then visible to
            // its threads) warpgroup 0 merges them into its own by log-sum-exp
            if (w > 0) {
                const int sr = scratch_row(w);
                float* po = part_o + (head_ws + x.slot) * ROWS * D;
    #pragma unroll
                for (int nn = 0; nn < ND; ++nn) {
                    const int col = nn * 8 + 2 * t4;
                    *reinterpret_cast<float2*>(po + sr * D + col) = make_float2(acc[nn][0], acc[nn][1]);
                    *reinterpret_cast<float2*>(po + (sr + 8) * D + col) = make_float2(acc[nn][2], acc[nn][3]);
                }
                if (t4 == 0) {
                    float* pml = part_ml + (head_ws + x.slot) * ROWS * 2;
                    *reinterpret_cast<float2*>(pml + 2 * sr) = make_float2(row_m[0], l0);
                    *reinterpret_cast<float2*>(pml + 2 * (sr + 8)) = make_float2(row_m[1], l1);
                }
            }
            named_bar_sync(BAR_MERGE, 128 * CONSUMERS);
            if (w == 0) {
                const float* po = part_o + (head_ws + x.slot) * ROWS * D;
                float* pml = part_ml + (head_ws + x.slot) * ROWS * 2;
                for (int k = 1; k < CONSUMERS; ++k) {
                    const int sr = scratch_row(k);
                    const float2 a = *reinterpret_cast<const float2*>(pml + 2 * sr);
                    const float2 b = *reinterpret_cast<const float2*>(pml + 2 * (sr + 8));
                    const float n0 = fmaxf(row_m[0], a.x), n1 = fmaxf(row_m[1], b.x);
                    // a row without keys on one side keeps the other's (no -inf - -inf)
                    const float c0 = row_m[0] == STOFC_NEG_INF ? 0.0f : exp2f(row_m[0] - n0);
                    const float c1 = row_m[1] == STOFC_NEG_INF ? 0.0f : exp2f(row_m[1] - n1);
                    const float d0 = a.x == STOFC_NEG_INF ? 0.0f : exp2f(a.x - n0);
                    const float d1 = b.x == STOFC_NEG_INF ? 0.0f : exp2f(b.x - n1);
    #pragma unroll
                    for (int nn = 0; nn < ND; ++nn) {
                        const int col = nn * 8 + 2 * t4;
                        const float2 u = *reinterpret_cast<const float2*>(po + sr * D + col);
                        const float2 v = *reinterpret_cast<const float2*>(po + (sr + 8) * D + col);
                        acc[nn][0] = fmaf(acc[nn][0], c0, u.x * d0);
                        acc[nn][1] = fmaf(acc[nn][1], c0, u.y * d0);
                        acc[nn][2] = fmaf(acc[nn][2], c1, v.x * d1);
                        acc[nn][3] = fmaf(acc[nn][3], c1, v.y * d1);
                    }
                    l0 = fmaf(l0, c0, a.y * d0);
                    l1 = fmaf(l1, c1, b.y * d1);
                    row_m[0] = n0;
                    row_m[1] = n1;
                }
                // the other tile rows' rows are empty now (the combine skips them): each quad
                // clears the rows it read, once all its lanes have read them
                __syncwarp();
                if (t4 == 0)
                    for (int k = 1; k < CONSUMERS; ++k) {
                        const int sr = scratch_row(k);
                        *reinterpret_cast<float2*>(pml + 2 * sr) = make_float2(STOFC_NEG_INF, 0.0f);
                        *reinterpret_cast<float2*>(pml + 2 * (sr + 8)) = make_float2(STOFC_NEG_INF, 0.0f);
                    }
            }
        }
        if (x.sh == 0 || w == 0) {
        const long long ws = head_ws + x.slot;
        float* po = part_o + ws * ROWS * D;
        if (!empty) {                                  // an empty chunk's weight is 0: never read
    #pragma unroll
            for (int nn = 0; nn < ND; ++nn) {
                const int col = nn * 8 + 2 * t4;
                *reinterpret_cast<float2*>(po + lr0 * D + col) = make_float2(acc[nn][0], acc[nn][1]);
                *reinterpret_cast<float2*>(po + (lr0 + 8) * D + col) = make_float2(acc[nn][2], acc[nn][3]);
            }
        }
        if (t4 == 0) {
            float* pml = part_ml + ws * ROWS * 2;
            *reinterpret_cast<float2*>(pml + 2 * lr0) = make_float2(row_m[0], l0);
            *reinterpret_cast<float2*>(pml + 2 * (lr0 + 8)) = make_float2(row_m[1], l1);
        }
        }
        }

        if (tracing && tid == 0 && k < TRACE_WORKS) {
            unsigned long long* r = trace_rec(1 + w, k);
            r[0] = x.wk; r[1] = tc0; r[2] = tc1; r[3] = tc2; r[4] = trace_clock();
            r[5] = tc_kwait; r[6] = tc_turn; r[7] = (static_cast<unsigned long long>(steps) << 32) | tc_steps;
        }
        ++q_use;
    }
    if (PINGPONG && w == 0) named_bar_sync(bar_mine, 256);    // consume the last arrival
    if (tracing && tid == 0) {
        atomicMax(trace_head + 2, trace_ns());
        atomicMax(trace_head + 4, trace_clock());
    }
}

// Merge the chunks of every split pair row: O = sum_c 2^(m_c - M) O_c / sum_c 2^(m_c - M) l_c
// (M = max_c m_c, log2 units); a row whose chunks saw no allowed key writes 0. A block
// merges CROWS rows of one split pair row (grid: H * B * PERIOD * split rows * COMBINE_GROUPS),
// a thread four columns of one row: every thread reads its row's (m, l) itself, so there
// is no shared memory and no barrier, and the chunks' loads are independent.
constexpr int COMBINE_GROUPS = 16;   // blocks per split pair row
constexpr int CROWS = ROWS / COMBINE_GROUPS;            // rows merged by one block
constexpr int C4 = D / 4;                               // float4 pieces of a row
constexpr int COMBINE_BATCH = 8;                        // chunks loaded at once
static_assert(ROWS % COMBINE_GROUPS == 0, "a combine block merges whole rows");

extern "C" __global__ void __launch_bounds__(256)
stofc_attn_ws_bf16_d64_t64_w12_m16_s4_q1_o1_k2_c_b1_k0_combine(T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
                          const int* __restrict__ combine, int combine_head_stride,
                          const float* __restrict__ part_o, const float* __restrict__ part_ml,
                          int slots, int B, int H, int L) {
    pdl_wait();                                    // the main kernel's partials (pdl.cuh)
    int idx = blockIdx.x;
    const int g = idx % COMBINE_GROUPS; idx /= COMBINE_GROUPS;
    const int h = idx % H; idx /= H;
    const int vb = idx % (B * PERIOD); idx /= B * PERIOD;   // batch * PERIOD + residue
    const int b = vb / PERIOD, r = vb - b * PERIOD;
    const int lr = (L - r + PERIOD - 1) / PERIOD;          // the residue's rows
    const int* c3 = combine + h * combine_head_stride + 3 * idx;
    const int prow = c3[0], first = c3[1], chunks = min(c3[2], MAX_CHUNKS);
    if (prow < 0 || prow * ROWS + g * CROWS >= lr) return;
    const long long ws0 = (static_cast<long long>(vb) * H + h) * slots + first;
    typedef DTypeTraits<T> DT;
    T* ob = o + b * o_sb + h * o_sh + r * o_ss;
    const long long row_step = PERIOD * o_ss;
    for (int i = threadIdx.x; i < CROWS * C4; i += blockDim.x) {
        const int r = g * CROWS + i / C4, col = 4 * (i % C4);
        const int qr = prow * ROWS + r;
        if (qr >= lr) continue;
        const float* ml = part_ml + (ws0 * ROWS + r) * 2;     // chunk c: ml[c * ROWS * 2]
        const float* po = part_o + (ws0 * ROWS + r) * D + col;
        // COMBINE_BATCH chunks' (m, l) are loaded at once, then the O of those that saw a
        // key, and merged online (the running sums rescaled to the batch's max): two memory
        // round trips per batch, not one per chunk as loads under a per-chunk branch made.
        // An empty chunk (m = -inf) wrote no O: its memory is not read and nothing is summed.
        float mx = STOFC_NEG_INF, total = 0.0f;
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int c0 = 0; c0 < chunks; c0 += COMBINE_BATCH) {
            float2 mlv[COMBINE_BATCH];
            float4 xv[COMBINE_BATCH];
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j)
                mlv[j] = c0 + j < chunks
                    ? *reinterpret_cast<const float2*>(ml + static_cast<long long>(c0 + j) * ROWS * 2)
                    : make_float2(STOFC_NEG_INF, 0.0f);
            float mb = mx;
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) mb = fmaxf(mb, mlv[j].x);
            if (mb == STOFC_NEG_INF) continue;             // no allowed key so far
            // every lane loads (a chunk without O reads the batch's first chunk again, cached),
            // so the loads issue together; the empty chunk's value is dropped after the load
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) {
                const bool has_o = mlv[j].x != STOFC_NEG_INF;
                const float4 x = *reinterpret_cast<const float4*>(
                    po + static_cast<long long>(has_o ? c0 + j : c0) * ROWS * D);
                xv[j] = has_o ? x : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            const float s = exp2f(mx - mb);                // 0 while mx is -inf
            total *= s;
            sum.x *= s; sum.y *= s; sum.z *= s; sum.w *= s;
#pragma unroll
            for (int j = 0; j < COMBINE_BATCH; ++j) {
                const float e = exp2f(mlv[j].x - mb);      // 0 for an empty chunk
                total = fmaf(e, mlv[j].y, total);
                sum.x = fmaf(e, xv[j].x, sum.x);
                sum.y = fmaf(e, xv[j].y, sum.y);
                sum.z = fmaf(e, xv[j].z, sum.z);
                sum.w = fmaf(e, xv[j].w, sum.w);
            }
            mx = mb;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        u32* out = reinterpret_cast<u32*>(ob + qr * row_step + col);
        out[0] = DT::pack(sum.x * inv, sum.y * inv);
        out[1] = DT::pack(sum.z * inv, sum.w * inv);
    }
}
