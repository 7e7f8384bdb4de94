// The decode path of the grouped expert op (ops/moe_kernels.py): a few tokens, so every slot s = t*K + j is
// a one-row GEMV on its expert e = ids[s]. Two launches and no sorting:
//
//   moe_decode_gate_up   a[s] = act(gate_e x[t] + bg_e, up_e x[t] + bu_e), rounded to T      [S, I]
//   moe_decode_down      y[t] = sum_j w[t, j] (down_e a[t*K + j] + bd_e), fp32, rounded once  [T, H]
//
// Why: at one token the five-launch path (align, GEMM, activation, GEMM, combine) spends 25-30 us of fixed
// cost on the H100 against 6-17 us of selected experts' bytes; here the activation is the first GEMM's
// epilogue, the routing weights and the K-slot sum the second's, and nothing waits for a sort.
//
// Work: a unit is one 64-column strip of one slot's (down: one token's) output over a slice of k16 rows;
// gate_up's unit holds gate strip c and up strip I/64 + c, so the activation is computed where both halves
// are. A CTA takes one unit. Its 8 warps take batches of RW k16 rows in turn and issue a batch's 16-byte
// weight loads (a strip's k16 row is 512 contiguous bytes, one load a lane), its scale rows and its x pieces
// before any math, so every warp keeps RW x strips x 512 B in flight. Each packed word is dequantized
// (w4a16/dequant.cuh, group scales multiplied in T like every W4A16 kernel) into the A fragment of
// mma.m16n8k16 (16 output columns x 16 k) and multiplied by x^T: B column 0 is the row (lanes 0..3 read it
// from global memory, the other lanes hold zeros), columns 1..7 give unused zeros. At one row the tensor
// cores have time to spare: the job is streaming the weight bytes.
//
// A unit's warps are summed through shared memory in warp order; a strip's slices through fp32 slots in the
// workspace and the counter protocol of w4a16/fixup.cuh: the last CTA to arrive adds the slots in a fixed
// order (gate_up: slice order; down: slot j, then slice), so results are bitwise deterministic, then
// applies the per-channel scale, bias, and the activation (gate_up) or the routing weights (down), stores,
// and resets the counter (counters are zero before a launch and left zero after).
//
// An id outside [0, E): gate_up's units of that slot exit at once (all of them alike: no counter is
// touched, a[s] is not written); down's units of it stream nothing but still arrive, and the last arriver
// leaves the slot out. No memory outside the tensors is read for any id value.
#include "common/ptx.cuh"
#include "moe/gated.cuh"
#include "w4a16/dequant.cuh"
#include "w4a16/fixup.cuh"

namespace moed {
using namespace tf;
constexpr int kWarps = 8, kThreads = kWarps * 32;

// Every strip's accumulators of one unit, summed over the unit's k16 rows [row_begin, row_end) by this
// warp's batches. strips[p]: the packed strip index p of expert e's weight (n columns, k rows);
// row_begin is a multiple of RW. X_THROUGH_L2: xrow was written by the kernel ahead of a programmatic launch,
// so it is read through L2 (grid_dependency_wait in common/ptx.cuh); without it (gate_up, launched without
// programmatic serialization, whose x is complete before it starts) the compiler schedules plain loads, which
// keeps the 32-group zero-point builds clear of spills.
template <typename T, int GROUP, bool ASYM, int NS, int RW, bool X_THROUGH_L2>
__device__ __forceinline__ void stream_unit(const uint4* __restrict__ w, const T* __restrict__ scales,
                                            const T* __restrict__ zeros, const T* __restrict__ xrow, int n,
                                            int k, const int (&strips)[NS], int row_begin, int row_end,
                                            float (&acc)[NS][4][4]) {
    using DQ = WeightDecoder<T>;
    using V2 = Vec2<T>;
    // Scale rows a batch spans: the batch's rows are RW aligned, so with GROUP >= 16 RW one group.
    constexpr int SG = GROUP == 0 ? 0 : (16 * RW > GROUP ? 16 * RW / GROUP : 1);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2;
    const int KR = k / 16, groups = GROUP ? k / GROUP : 1;
    const typename DQ::Zero zsym = DQ::zero(8.f);
    typename DQ::Zero zs_channel[NS][8];
    if constexpr (ASYM && GROUP == 0) {
#pragma unroll
        for (int p = 0; p < NS; ++p) {
            const uint4 zv = ld_nc_v4(zeros + strips[p] * 64 + g * 8);
            const T* zp = reinterpret_cast<const T*>(&zv);
#pragma unroll
            for (int i = 0; i < 8; ++i) zs_channel[p][i] = DQ::zero(to_float(zp[i]));
        }
    }
    (void)zs_channel;
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
                if constexpr (X_THROUGH_L2) {
                    xb[i][0] = ld_cg_u32(xrow + 16 * r + 2 * lane);
                    xb[i][1] = ld_cg_u32(xrow + 16 * r + 8 + 2 * lane);
                } else {
                    xb[i][0] = *reinterpret_cast<const u32*>(xrow + 16 * r + 2 * lane);
                    xb[i][1] = *reinterpret_cast<const u32*>(xrow + 16 * r + 8 + 2 * lane);
                }
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
        (void)sv;
        (void)zv;
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            if (rb + i >= row_end) break;
#pragma unroll
            for (int p = 0; p < NS; ++p) {
                typename V2::type sc2[8];
                typename DQ::Zero zs[8];
                if constexpr (SG > 0) {
                    const int q = SG > 1 ? (16 * i) / GROUP : 0;
                    const T* sp = reinterpret_cast<const T*>(&sv[p][q]);
#pragma unroll
                    for (int c = 0; c < 8; ++c) sc2[c] = V2::dup(sp[c]);
                    if constexpr (ASYM) {
                        const T* zp = reinterpret_cast<const T*>(&zv[p][q]);
#pragma unroll
                        for (int c = 0; c < 8; ++c) zs[c] = DQ::zero(to_float(zp[c]));
                    }
                }
                if constexpr (ASYM && GROUP == 0) {
#pragma unroll
                    for (int c = 0; c < 8; ++c) zs[c] = zs_channel[p][c];
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

__device__ __forceinline__ float weight_of(float w) { return w; }
template <typename R>
__device__ __forceinline__ float weight_of(R w) { return to_float(w); }

}  // namespace moed

// Grid (S slots, I / 64 strips, slices). ws: S x I/64 x slices x 128 floats (slices > 1); counters: S x I/64.
template <typename T, int GROUP, bool ASYM, int ACT, typename Id, int RW>
__global__ void __launch_bounds__(moed::kThreads, 2)
moe_decode_gate_up(const T* __restrict__ x, const Id* __restrict__ ids, const uint4* __restrict__ w,
                   const T* __restrict__ scales, const T* __restrict__ zeros, const T* __restrict__ bias,
                   T* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters, int topk, int experts,
                   int hidden, int inter, int rows_per_slice) {
    using namespace moed;
    static_assert(kDecoderHasZeros || !ASYM, "table codebooks have no zero points");
    __shared__ float red[kWarps * 2 * 64];
    __shared__ int s_last;
    const int s = blockIdx.x, c = blockIdx.y, q = blockIdx.z, slices = gridDim.z, strips_i = inter / 64;
    const Id e = ids[s];
    if (!valid_expert(e, experts)) return;  // the slot adds nothing: a[s] is never read
    const int n = 2 * inter, groups = GROUP ? hidden / GROUP : 1;
    const uint4* we = w + (size_t)e * (n / 64) * (hidden / 16) * 32;
    const T* se = scales + (size_t)e * groups * n;
    const T* ze = ASYM ? zeros + (size_t)e * groups * n : nullptr;
    const int strips[2] = {c, strips_i + c};
    float acc[2][4][4] = {};
    const int r0 = q * rows_per_slice, r1 = min(hidden / 16, r0 + rows_per_slice);
    stream_unit<T, GROUP, ASYM, 2, RW, false>(we, se, ze, x + (size_t)(s / topk) * hidden, n, hidden, strips, r0, r1, acc);
    launch_dependent_grids();  // the down kernel's CTAs may start their weight prefetch as these finish
    float v = sum_warps<2>(acc, red);

    const int tid = threadIdx.x, unit = s * strips_i + c;
    if (slices > 1) {
        float* slot = ws + (size_t)unit * slices * 128;
        if (tid < 128) __stcg(slot + q * 128 + tid, v);
        if (!fixup_arrive_cta(counters + unit, slices, tid == 0, s_last, [] { __syncthreads(); })) return;
        if (tid < 128) {
            v = __ldcg(slot + tid);
            for (int i = 1; i < slices; ++i) v += __ldcg(slot + i * 128 + tid);
        }
        if (tid == 0) fixup_reset(counters + unit);
    }
    __syncthreads();  // red's reads are done: it takes the sums
    if (tid < 128) {
        const int col = (tid < 64 ? 0 : inter - 64) + c * 64 + tid;  // gate column c*64 + tid, then its up column
        if constexpr (GROUP == 0) v *= to_float(se[col]);
        if (bias != nullptr) v += to_float(bias[(size_t)e * n + col]);
        red[tid] = v;
    }
    __syncthreads();
    if (tid < 64) out[(size_t)s * inter + c * 64 + tid] = Vec2<T>::one(gated<ACT>(red[tid], red[64 + tid]));
}

// Grid (T tokens, H / 64 strips, K x slices: slot j's slice q at j * slices + q). ws: T x H/64 x K x slices x
// 64 floats (K x slices > 1); counters: T x H/64. weights: [T, K] of R, fp32 or T (a router's output dtype is
// usually the activations': read as it is, no conversion launch before this one).
template <typename T, int GROUP, bool ASYM, typename Id, int RW, typename R>
__global__ void __launch_bounds__(moed::kThreads, 2)
moe_decode_down(const T* __restrict__ a, const Id* __restrict__ ids, const R* __restrict__ weights,
                const uint4* __restrict__ w, const T* __restrict__ scales, const T* __restrict__ zeros,
                const T* __restrict__ bias, T* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                int topk, int experts, int hidden, int inter, int rows_per_slice, int slices) {
    using namespace moed;
    static_assert(kDecoderHasZeros || !ASYM, "table codebooks have no zero points");
    __shared__ float red[kWarps * 64];
    __shared__ int s_last;
    const int t = blockIdx.x, c = blockIdx.y, j = blockIdx.z / slices, q = blockIdx.z % slices;
    const int parts = topk * slices, groups = GROUP ? inter / GROUP : 1, tid = threadIdx.x;
    const size_t per_expert_w = (size_t)(hidden / 64) * (inter / 16) * 32, per_expert_s = (size_t)groups * hidden;
    const Id e = ids[(size_t)t * topk + j];  // an input of the op: written before the gate_up kernel started
    const int r0 = q * rows_per_slice, r1 = min(inter / 16, r0 + rows_per_slice);
    // Launched with programmatic serialization after gate_up: this CTA's weight rows (one contiguous span of
    // the strip) head for L2 while gate_up finishes; a, the workspace, the counters and y wait for it.
    if (tid == 0 && valid_expert(e, experts) && r1 > r0)
        l2_prefetch_span(w + (size_t)e * per_expert_w + ((size_t)c * (inter / 16) + r0) * 32, (r1 - r0) * 512u);
    grid_dependency_wait();
    float acc[1][4][4] = {};
    if (valid_expert(e, experts)) {
        const int strips[1] = {c};
        stream_unit<T, GROUP, ASYM, 1, RW, true>(w + (size_t)e * per_expert_w, scales + (size_t)e * per_expert_s,
                                           ASYM ? zeros + (size_t)e * per_expert_s : nullptr,
                                           a + ((size_t)t * topk + j) * inter, hidden, inter, strips, r0, r1, acc);
    }
    float v = sum_warps<1>(acc, red);

    // The sum over parts: one part is this CTA's own; else the last arriver reads every part's slot.
    const int unit = t * (hidden / 64) + c, col = c * 64 + tid;
    float* slot = ws + (size_t)unit * parts * 64;
    if (parts > 1) {
        if (tid < 64) __stcg(slot + blockIdx.z * 64 + tid, v);
        if (!fixup_arrive_cta(counters + unit, parts, tid == 0, s_last, [] { __syncthreads(); })) return;
    }
    if (tid >= 64) return;
    float sum = 0.f;
    for (int jj = 0; jj < topk; ++jj) {
        const Id ej = ids[(size_t)t * topk + jj];
        if (!valid_expert(ej, experts)) continue;
        float part = 0.f;
        if (parts > 1) {
            for (int i = 0; i < slices; ++i) part += __ldcg(slot + (jj * slices + i) * 64 + tid);
        } else {
            part = v;
        }
        if constexpr (GROUP == 0) part *= to_float(scales[(size_t)ej * per_expert_s + col]);
        if (bias != nullptr) part += to_float(bias[(size_t)ej * hidden + col]);
        sum += moed::weight_of(weights[(size_t)t * topk + jj]) * part;
    }
    y[(size_t)t * hidden + col] = Vec2<T>::one(sum);
    if (parts > 1 && tid == 0) fixup_reset(counters + unit);
}
