// The decode path of the grouped expert op (ops/moe_decode.py): a few tokens, so every slot s = t*K + j is a
// one-row GEMV on its expert e = ids[s]. One launch, no sorting:
//
//   gate_up units   a[s] = act(gate_e x[t] + bg_e, up_e x[t] + bu_e), rounded to T      [S, I]
//   down units      y[t] = sum_j w[t, j] (down_e a[t*K + j] + bd_e), fp32, rounded once  [T, H]
//
// Why: at one token the five-launch path (align, GEMM, activation, GEMM, combine) spends 25-30 us of fixed
// cost on the H100 against 6-17 us of selected experts' bytes, and two launches (one a GEMM) still pay about
// 8 us each of ramp, first-byte latency and fix-up at those sizes. Here the activation is the first GEMM's
// epilogue, the routing weights and the K-slot sum the second's, and the second's weights are already on
// their way to L2 while the first finishes.
//
// Units: a unit is one 64-column strip of one slot's (down: one token's) output over one slice of k16 rows,
// one batch of rows a warp; gate_up's unit holds gate strip c and up strip I/64 + c, so the activation is
// computed where both halves are. Persistent CTAs (2 an SM) take units in a fixed order (every gate_up unit,
// then every down unit; the kernel below says which CTA takes which) and keep the weights of their next
// units on their way into L2. A down unit waits until its slot's activation row is complete (done[s] ==
// I/64, released by the last CTA of each of the slot's strips).
//
// A unit's 8 warps each take RW k16 rows (RW x strips x 512 contiguous bytes, one 16-byte load a lane a strip
// row), issue the loads, their scale rows and x pieces before any math, then dequantize each packed word
// (w4a16/dequant.cuh, group scales multiplied in T like every W4A16 kernel) into the A fragment of
// mma.m16n8k16 (16 output columns x 16 k) and multiply it by x^T: B column 0 is the row (lanes 0..3 read it,
// the other lanes hold zeros), columns 1..7 give unused zeros. At one row the tensor cores have time to
// spare: the job is streaming the weight bytes.
//
// Sums: a unit's warps through shared memory in warp order; a strip's slices (and, for down, a token's K
// slots) through fp32 slots in the workspace and the counter protocol of w4a16/fixup.cuh. The last unit to
// arrive adds the slots in a fixed order (gate_up: slice order; down: slot j, then slice), so results are
// bitwise deterministic, then applies the per-channel scale, bias, and the activation (gate_up) or the
// routing weights (down), and stores.
//
// An id outside [0, E): gate_up's units of that slot end at once (a[s] is never written); down's units of it
// stream nothing and do not wait, but still arrive, and the last arriver leaves the slot out. No memory
// outside the tensors is read for any id value.
//
// The sync words (int32, zero before a launch and left zero after): [0] unused, [1] CTAs finished,
// [2, 2 + S) done per slot, then S x I/64 gate_up strip counters, then T x H/64 down strip counters. Each
// strip counter is reset by its last arriver, the rest by the last CTA to finish.
#include "common/ptx.cuh"
#include "moe/gated.cuh"
#include "w4a16/dequant.cuh"
#include "w4a16/fixup.cuh"

namespace moed {
using namespace tf;
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kGateUpRows = 4;  // RW of a gate_up unit: 2 strips x 4 k16 rows x 512 B in flight a warp
constexpr int kDownRows = 8;    // RW of a down unit: 1 strip x 8 rows
constexpr int kPrefetchUnits = 3;  // a CTA's units whose weights are on their way to L2 (<= ~25 MB in all)

// x pieces: read-only inputs through the non-coherent path; rows written earlier in the same launch (the
// activation) through L2 (ld.cg), since the read-only path may hold stale lines.
template <bool COHERENT>
__device__ __forceinline__ u32 load_pair(const void* p) {
    if constexpr (COHERENT) return __ldcg(reinterpret_cast<const unsigned int*>(p));
    else return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Every strip's accumulators of one unit, summed over the unit's k16 rows [row_begin, row_end) by this
// warp's batches. strips[p]: the packed strip index p of expert e's weight (n columns, k rows);
// row_begin is a multiple of RW.
template <typename T, int GROUP, bool ASYM, int NS, int RW, bool COHERENT_X>
__device__ __forceinline__ void stream_unit(const uint4* __restrict__ w, const T* __restrict__ scales,
                                            const T* __restrict__ zeros, const T* xrow, int n,
                                            int k, const int (&strips)[NS], int row_begin, int row_end,
                                            float (&acc)[NS][4][4]) {
    using DQ = WeightDecoder<T>;
    using V2 = Vec2<T>;
    // Scale rows a batch spans: the batch's rows are RW aligned, so with GROUP >= 16 RW one group.
    constexpr int SG = GROUP == 0 ? 0 : (16 * RW > GROUP ? 16 * RW / GROUP : 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2;
    const int KR = k / 16, groups = GROUP ? k / GROUP : 1;
    const typename DQ::Zero zsym = DQ::zero(8.f);
    for (int rb = row_begin + warp * RW; rb < row_end; rb += kWarps * RW) {
        uint4 wv[RW][NS];
        u32 xb[RW][2];
        uint4 sv[NS][SG > 0 ? SG : 1], zv[NS][SG > 0 ? SG : 1];
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            const int r = rb + i;
            const bool ok = r < row_end;
#pragma unroll
            for (int p = 0; p < NS; ++p)
                wv[i][p] = ok ? ld_nc_v4(w + ((size_t)strips[p] * KR + r) * 32 + lane) : make_uint4(0, 0, 0, 0);
            xb[i][0] = xb[i][1] = 0u;
            if (ok && lane < 4) {
                xb[i][0] = load_pair<COHERENT_X>(xrow + 16 * r + 2 * lane);
                xb[i][1] = load_pair<COHERENT_X>(xrow + 16 * r + 8 + 2 * lane);
            }
        }
        if constexpr (SG > 0) {
#pragma unroll
            for (int p = 0; p < NS; ++p)
#pragma unroll
                for (int q = 0; q < SG; ++q) {
                    // a batch row past the weight's last reads the last group's row (in bounds, unused)
                    const int grp = min((16 * rb) / GROUP + q, groups - 1);
                    sv[p][q] = ld_nc_v4(scales + (size_t)grp * n + strips[p] * 64 + g * 8);
                    if constexpr (ASYM) zv[p][q] = ld_nc_v4(zeros + (size_t)grp * n + strips[p] * 64 + g * 8);
                }
        }
        if constexpr (ASYM && GROUP == 0) {  // per-channel zero points: row 0, reread per batch (an L1 hit)
#pragma unroll
            for (int p = 0; p < NS; ++p) zv[p][0] = ld_nc_v4(zeros + strips[p] * 64 + g * 8);
        }
        (void)sv;
        (void)zv;
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            if (rb + i >= row_end) break;
#pragma unroll
            for (int p = 0; p < NS; ++p) {
                typename V2::type sc2[8];
                typename DQ::Zero zs[8];
                const int q = SG > 1 ? (16 * i) / GROUP : 0;
                if constexpr (SG > 0) {
                    const T* sp = reinterpret_cast<const T*>(&sv[p][q]);
#pragma unroll
                    for (int c = 0; c < 8; ++c) sc2[c] = V2::dup(sp[c]);
                }
                if constexpr (ASYM) {
                    const T* zp = reinterpret_cast<const T*>(&zv[p][q]);
#pragma unroll
                    for (int c = 0; c < 8; ++c) zs[c] = DQ::zero(to_float(zp[c]));
                }
                const u32 words[4] = {wv[i][p].x, wv[i][p].y, wv[i][p].z, wv[i][p].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 frag[4];
                    DQ::run(words[j], ASYM ? zs[2 * j] : zsym, ASYM ? zs[2 * j + 1] : zsym, frag);
                    if constexpr (GROUP > 0) {
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            typename V2::type v = *reinterpret_cast<typename V2::type*>(&frag[c]);
                            v = __hmul2(v, sc2[2 * j + (c >> 1)]);
                            frag[c] = *reinterpret_cast<u32*>(&v);
                        }
                    }
                    const u32 wa[4] = {frag[0], frag[2], frag[1], frag[3]};  // rows g, g+8 x k lo, hi
                    Mma<T>::run(acc[p][j], wa, xb[i][0], xb[i][1]);
                }
            }
        }
    }
}

// The unit's sum of its warps, column c = tid of the NS x 64 (tid < NS x 64), in warp order. red holds
// kWarps x NS x 64 floats. Column 16 j + 8 h + g of strip p is accumulator (j, 2h) of lane 4g.
template <int NS>
__device__ __forceinline__ float sum_warps(const float (&acc)[NS][4][4], float* red) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2;
    if ((lane & 3) == 0) {
#pragma unroll
        for (int p = 0; p < NS; ++p)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                red[(warp * NS + p) * 64 + 16 * j + g] = acc[p][j][0];
                red[(warp * NS + p) * 64 + 16 * j + 8 + g] = acc[p][j][2];
            }
    }
    __syncthreads();
    float v = 0.f;
    if (threadIdx.x < NS * 64) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += red[w * NS * 64 + threadIdx.x];
    }
    return v;
}

template <typename Id>
__device__ __forceinline__ bool valid_expert(Id e, int experts) { return e >= 0 && e < (Id)experts; }

// The L2 prefetch of `bytes` contiguous bytes by the CTA's threads (one 128-byte line each in turn).
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes) {
    for (int off = threadIdx.x * 128; off < bytes; off += kThreads * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(p) + off));
}

__device__ __forceinline__ void release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One projection's weight: stacked packed words, scales, zero points (or null), bias (or null).
template <typename T>
struct Stacked {
    const uint4* w;
    const T* scales;
    const T* zeros;
    const T* bias;
};

// The launch's shapes and unit counts (gate_up units are 0 .. gu_units - 1, down units after them).
struct Shape {
    int tokens, topk, experts, hidden, inter;
    int slots, gu_strips, d_strips, gu_slices, d_slices, gu_units, d_units;
    __device__ Shape(int t, int k, int e, int h, int i, int gu_rows, int d_rows)
        : tokens(t), topk(k), experts(e), hidden(h), inter(i), slots(t * k), gu_strips(i / 64), d_strips(h / 64),
          gu_slices((h / 16 + gu_rows - 1) / gu_rows), d_slices((i / 16 + d_rows - 1) / d_rows),
          gu_units(slots * gu_strips * gu_slices), d_units(t * d_strips * k * d_slices) {}
};



// gate_up unit u (slot-major: slot s, strip c, slice q) -> a[s, 64 c ..] once its last slice is in.
template <typename T, int GROUP, bool ASYM, int ACT, typename Id>
__device__ __forceinline__ void gate_up_unit(int u, const Shape& sh, const T* x, const Id* ids, const Stacked<T>& g,
                                             T* act, float* ws, int* done, int* counters, float* red, int& s_last) {
    const int q = u % sh.gu_slices, strip = u / sh.gu_slices, c = strip % sh.gu_strips, s = strip / sh.gu_strips;
    const Id e = ids[s];
    if (!valid_expert(e, sh.experts)) return;  // the slot adds nothing: a[s] is never read
    const int n = 2 * sh.inter, k = sh.hidden, groups = GROUP ? k / GROUP : 1, tid = threadIdx.x;
    const T* se = g.scales + (size_t)e * groups * n;
    const int strips[2] = {c, sh.gu_strips + c};
    float acc[2][4][4] = {};
    const int r0 = q * kWarps * kGateUpRows, r1 = min(k / 16, r0 + kWarps * kGateUpRows);
    stream_unit<T, GROUP, ASYM, 2, kGateUpRows, false>(g.w + (size_t)e * (n / 64) * (k / 16) * 32, se,
                                                       ASYM ? g.zeros + (size_t)e * groups * n : nullptr,
                                                       x + (size_t)(s / sh.topk) * k, n, k, strips, r0, r1, acc);
    float v = sum_warps<2>(acc, red);
    if (sh.gu_slices > 1) {
        float* slot = ws + (size_t)strip * sh.gu_slices * 128;
        if (tid < 128) __stcg(slot + q * 128 + tid, v);
        if (!fixup_arrive_cta(counters + strip, sh.gu_slices, tid == 0, s_last, [] { __syncthreads(); })) return;
        if (tid < 128) {
            v = __ldcg(slot + tid);
            for (int i = 1; i < sh.gu_slices; ++i) v += __ldcg(slot + i * 128 + tid);
        }
        if (tid == 0) fixup_reset(counters + strip);
    }
    __syncthreads();  // red's reads are done: it takes the sums
    if (tid < 128) {
        const int col = (tid < 64 ? 0 : sh.inter - 64) + c * 64 + tid;  // gate column c*64 + tid, then its up column
        if constexpr (GROUP == 0) v *= to_float(se[col]);
        if (g.bias != nullptr) v += to_float(g.bias[(size_t)e * n + col]);
        red[tid] = v;
    }
    __syncthreads();
    if (tid < 64) act[(size_t)s * sh.inter + c * 64 + tid] = Vec2<T>::one(gated<ACT>(red[tid], red[64 + tid]));
    __syncthreads();  // every store of the strip before the release that publishes it
    if (tid == 0) release_add(done + s, 1);
}

// down unit u (token t, strip c, slot j, slice q) -> y[t, 64 c ..] once the token's last part is in.
template <typename T, int GROUP, bool ASYM, typename Id>
__device__ __forceinline__ void down_unit(int u, const Shape& sh, const Id* ids, const float* weights,
                                          const Stacked<T>& d, const T* act, T* y, float* ws, const int* done,
                                          int* counters, float* red, int& s_last) {
    const int q = u % sh.d_slices, part = u / sh.d_slices, j = part % sh.topk, strip = part / sh.topk;
    const int c = strip % sh.d_strips, t = strip / sh.d_strips, s = t * sh.topk + j, tid = threadIdx.x;
    const int n = sh.hidden, k = sh.inter, groups = GROUP ? k / GROUP : 1, parts = sh.topk * sh.d_slices;
    const size_t per_expert_w = (size_t)(n / 64) * (k / 16) * 32, per_expert_s = (size_t)groups * n;
    const Id e = ids[s];
    float acc[1][4][4] = {};
    if (valid_expert(e, sh.experts)) {
        const int strips[1] = {c};
        const int r0 = q * kWarps * kDownRows, r1 = min(k / 16, r0 + kWarps * kDownRows);
        const uint4* we = d.w + (size_t)e * per_expert_w;
        if (tid == 0) {
            while (load_acquire(done + s) < sh.gu_strips) __nanosleep(32);
        }
        __syncthreads();  // the acquire, passed on to every thread before they read a[s]
        stream_unit<T, GROUP, ASYM, 1, kDownRows, true>(we, d.scales + (size_t)e * per_expert_s,
                                                        ASYM ? d.zeros + (size_t)e * per_expert_s : nullptr,
                                                        act + (size_t)s * k, n, k, strips, r0, r1, acc);
    }
    float v = sum_warps<1>(acc, red);
    float* slot = ws + (size_t)strip * parts * 64;
    if (parts > 1) {
        if (tid < 64) __stcg(slot + (j * sh.d_slices + q) * 64 + tid, v);
        if (!fixup_arrive_cta(counters + strip, parts, tid == 0, s_last, [] { __syncthreads(); })) return;
    }
    if (tid < 64) {
        const int col = c * 64 + tid;
        float sum = 0.f;
        for (int jj = 0; jj < sh.topk; ++jj) {
            const Id ej = ids[(size_t)t * sh.topk + jj];
            if (!valid_expert(ej, sh.experts)) continue;
            float p = 0.f;
            if (parts > 1) {
                for (int i = 0; i < sh.d_slices; ++i) p += __ldcg(slot + (jj * sh.d_slices + i) * 64 + tid);
            } else {
                p = v;
            }
            if constexpr (GROUP == 0) p *= to_float(d.scales[(size_t)ej * per_expert_s + col]);
            if (d.bias != nullptr) p += to_float(d.bias[(size_t)ej * n + col]);
            sum += weights[(size_t)t * sh.topk + jj] * p;
        }
        y[(size_t)t * n + col] = Vec2<T>::one(sum);
    }
    if (parts > 1 && tid == 0) fixup_reset(counters + strip);
}



// The weight bytes of unit u, prefetched into L2 (a unit's rows of a strip are contiguous: gate_up two ranges,
// down one). An id outside [0, E) prefetches nothing.
template <typename Id>
__device__ __forceinline__ void prefetch_unit(int u, const Shape& sh, const Id* ids, const uint4* gu_w,
                                              const uint4* d_w) {
    if (u < sh.gu_units) {
        const int q = u % sh.gu_slices, strip = u / sh.gu_slices, c = strip % sh.gu_strips, s = strip / sh.gu_strips;
        const Id e = ids[s];
        if (!valid_expert(e, sh.experts)) return;
        const int kr = sh.hidden / 16, r0 = q * kWarps * kGateUpRows, r1 = min(kr, r0 + kWarps * kGateUpRows);
        const uint4* we = gu_w + (size_t)e * (2 * sh.inter / 64) * kr * 32;
        prefetch_l2(we + ((size_t)c * kr + r0) * 32, (r1 - r0) * 512);
        prefetch_l2(we + ((size_t)(sh.gu_strips + c) * kr + r0) * 32, (r1 - r0) * 512);
    } else {
        u -= sh.gu_units;
        const int q = u % sh.d_slices, part = u / sh.d_slices, j = part % sh.topk, strip = part / sh.topk;
        const int c = strip % sh.d_strips, t = strip / sh.d_strips;
        const Id e = ids[t * sh.topk + j];
        if (!valid_expert(e, sh.experts)) return;
        const int kr = sh.inter / 16, r0 = q * kWarps * kDownRows, r1 = min(kr, r0 + kWarps * kDownRows);
        prefetch_l2(d_w + ((size_t)e * sh.d_strips * kr + (size_t)c * kr + r0) * 32, (r1 - r0) * 512);
    }
}

}  // namespace moed

// One launch of persistent CTAs (grid G = min(units, 2 per SM)): CTA b takes units b, b + G, b + 2G, ... (every
// gate_up unit comes before every down unit), and keeps the weights of its next kPrefetchUnits units on their
// way into L2, so DRAM streams while a unit's chain of dependent steps (its reduction, fix-up and epilogue)
// runs. No deadlock: a CTA waits only in a down unit, for gate_up units, which never wait, of CTAs that are
// resident or will be (G never exceeds what the GPU holds at once).
// gu_ws: S x I/64 x gate_up slices x 128 floats (slices > 1), d_ws: T x H/64 x K x down slices x 64 floats
// (K x slices > 1); sync: the header's words.
template <typename T, int GU_GROUP, bool GU_ASYM, int D_GROUP, bool D_ASYM, int ACT, typename Id>
__global__ void __launch_bounds__(moed::kThreads, 2)
moe_decode(const T* __restrict__ x, const Id* __restrict__ ids, const float* __restrict__ weights,
           const uint4* gu_w, const T* gu_scales, const T* gu_zeros, const T* gu_bias,
           const uint4* d_w, const T* d_scales, const T* d_zeros, const T* d_bias,
           T* act, T* __restrict__ y, float* gu_ws, float* d_ws, int* sync,
           int tokens, int topk, int experts, int hidden, int inter) {
    using namespace moed;
    static_assert(kDecoderHasZeros || (!GU_ASYM && !D_ASYM), "table codebooks have no zero points");
    __shared__ float red[kWarps * 2 * 64];
    __shared__ int s_last;
    const Shape sh(tokens, topk, experts, hidden, inter, kWarps * kGateUpRows, kWarps * kDownRows);
    const Stacked<T> g{gu_w, gu_scales, gu_zeros, gu_bias}, d{d_w, d_scales, d_zeros, d_bias};
    int* finished = sync + 1;
    int* done = sync + 2;
    int* gu_counters = done + sh.slots;
    int* d_counters = gu_counters + sh.slots * sh.gu_strips;
    const int units = sh.gu_units + sh.d_units, stride = gridDim.x;

    for (int i = 0; i < kPrefetchUnits; ++i) {
        const int u = blockIdx.x + i * stride;
        if (u < units) prefetch_unit(u, sh, ids, gu_w, d_w);
    }
    for (int u = blockIdx.x; u < units; u += stride) {
        const int ahead = u + kPrefetchUnits * stride;
        if (ahead < units) prefetch_unit(ahead, sh, ids, gu_w, d_w);
        if (u < sh.gu_units)
            gate_up_unit<T, GU_GROUP, GU_ASYM, ACT, Id>(u, sh, x, ids, g, act, gu_ws, done, gu_counters, red, s_last);
        else
            down_unit<T, D_GROUP, D_ASYM, Id>(u - sh.gu_units, sh, ids, weights, d, act, y, d_ws, done, d_counters,
                                              red, s_last);
        __syncthreads();  // the unit's shared memory is free again
    }
    // The last CTA out resets the done words (the strip counters reset themselves).
    if (threadIdx.x == 0 && atomic_add_acq_rel(finished, 1) == (int)gridDim.x - 1) {
        for (int i = 0; i < sh.slots; ++i) store_relaxed(done + i, 0);
        store_relaxed(finished, 0);
    }
}
