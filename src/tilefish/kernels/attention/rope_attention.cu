// One decode step of a Llama-family attention, from the fused q/k/v projection's output to the attention's
// output, in one launch (ops/rope_attention.py): for every sequence b of qkv [B, 1, (H + 2 KV) * D],
//   keys[b, g, L] = rope(k_g), values[b, g, L] = v_g                     (what rope_cache.cu writes, bit for bit)
//   out[b, 0, h]  = softmax(scale * rope(q_h) . keys[b, h / G]^T + mask[b]) values[b, h / G]    (G = H / KV)
// with L = *length as the launch found it, then *length = L + 1; rope(x) of a q / k head RMS-normalized first where
// q_norm / k_norm ([D]) are given (Qwen3; attention/rotary.cuh); cos / sin rows [B or 1, 1, D]; the mask a
// bool (false: masked) or additive row [B or 1, 1, 1, S] (mask_kind 1 / 2). A row with nothing left gives zeros
// (torch's SDPA since 2.5). Math in fp32 but for P, which is rounded to T for its tensor-core product with V (as
// flash attention does); out is rounded once.
//
// Grid (splits, KV, B), 4 warps. CTA s takes positions [s * chunk, s * chunk + chunk) of its (b, kv head) and all
// G query heads, so K and V are read once for the G heads: rope(q) of the G heads are the rows of a 16-row
// mma.m16n8k16 A operand (rows past G are zeros). Tiles of 64 positions go through a 2-stage cp.async ring; warp
// w takes positions 16 w .. 16 w + 15 of a tile: S = Q K^T (K as mma's "col" B, ldmatrix from the row-major
// tile), an online softmax per row in registers, O += P V (P from S's accumulators, V through ldmatrix.trans).
// Rows of 16-byte chunks are XOR-swizzled (chunk c of row r at c ^ (r & 7)) so ldmatrix reads no bank twice.
// After the loop the 4 warps' (max, sum, O) merge through shared memory. With splits > 1 the splits' partials
// are combined in split order (bitwise deterministic, and the same bits either way):
// - cluster_combine (sm_90+, the splits of a (b, kv head) launched as one cluster): each CTA keeps its partial in
//   its shared memory and, after a cluster barrier, writes its share of the outputs from every split's partial
//   through distributed shared memory; no workspace, counter or L2 round trip;
// - otherwise each CTA stores its partial (fp32, to L2) and the last of the (b, kv head)'s CTAs to arrive on its
//   counter combines them (the W4A16 counter protocol of w4a16/fixup.cuh) and writes out.
//
// The new position L: the CTA whose range holds it writes rope(k) and v to the caches (L < S only: positions
// past the cache are not written, rope_cache's rule) and into its own tile before the products, so the tile
// copy's stale row never counts. The length: every CTA reads L, then arrives on counters[0]; the last writes
// L + 1 and puts the counter back to zero. counters[1 + b * KV + g] are the split combines' counters.
//
// Programmatic dependent launch: qkv, the length and the counters are touched only after
// grid_dependency_wait, and the next kernel (the o projection) is let in right after it: DRAM then streams o's
// weights (its skinny plan puts a small weight wholly in flight before its own wait) while this kernel, which
// reads little, computes (docs/e2e.md). With early_kv the first two
// tiles' copies and the first tile's mask are issued before the wait, which is what the launch gains from
// starting early: that needs the cache rows below L, the mask and cos / sin written by kernels that cannot still
// be running (the op's caller states it; see ops/rope_attention.py).
#include "attention/rotary.cuh"
#include "common/cluster.cuh"
#include "w4a16/fixup.cuh"
#include "w4a16/timeline.cuh"

using namespace tf;

namespace {

constexpr int THREADS = 128, WARPS = 4, TILE = 64, ROWS = 16;
constexpr int MAX_CLUSTER = 16;  // splits a cluster combine takes (sm_90's non-portable limit; ops/rope_attention.py)
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A relaxed atomic add: no ordering, so the thread goes on without waiting for the round trip (an acq_rel one
// holds the thread's later memory operations until it returns).
__device__ __forceinline__ int atomic_add_relaxed(int* p, int v) {
    int old;
    asm volatile("atom.add.relaxed.gpu.global.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// Element offset of chunk c (8 elements) of row r in a swizzled [rows][D] tile.
template <int D> __device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

}  // namespace

// HEAD_NORM: a build that applies q_norm / k_norm where given (Qwen3); the other ignores them, so the Llama family's
// step runs no code of it.
// Three CTAs an SM: registers up to 170 (left to itself, ptxas held D = 64 to 128 and spilled).
// Dynamic shared memory (ops/rope_attention.py smem_bytes): the ring, 2 stages x (K, V) x TILE x D x 2 bytes,
// whose space the warps' merge reuses after the loop; then Q (ROWS x D x 2 bytes); then the new k and v rows.
template <typename T, int D, bool HEAD_NORM>
__global__ void __launch_bounds__(THREADS, 3)
rope_attention(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin,
               T* __restrict__ keys, T* __restrict__ values, long long* __restrict__ length, int* __restrict__ counters,
               const void* __restrict__ mask, int mask_kind, long long mask_sb, T* __restrict__ out,
               float* __restrict__ partials, int heads, int kv_heads, int slots, int chunk, long long cs_batch,
               float scale_log2, int early_kv, int cluster_combine, const T* __restrict__ q_norm,
               const T* __restrict__ k_norm, float norm_eps) {
    static_assert(D == 64 || D == 128, "head dim 64 or 128");
    constexpr int CH = D / 8;                        // 16-byte chunks a row
    constexpr int NB = D / 8;                        // n8 blocks of O
    constexpr int TILE_ELEMS = TILE * D;
    // After the loop the ring holds the warps' merge ([WARPS][ROWS][D] O, per-warp and per-head max / sum /
    // weights) and the cluster combine's [ROWS][D] O of this CTA.
    static_assert((WARPS * ROWS * D + 3 * WARPS * ROWS + 2 * ROWS + ROWS * D) * 4 <= 4 * TILE_ELEMS * 2,
                  "the merge and the cluster combine fit the ring");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* ring = reinterpret_cast<T*>(smem_raw);                           // [2][2][TILE][D]: (stage, K / V)
    T* q_s = ring + 4 * TILE_ELEMS;                                     // [ROWS][D], swizzled
    T* fresh = q_s + ROWS * D;                                          // [2][D]: the new k, v rows
    __shared__ long long length_s;
    __shared__ int last_s;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
    const int split = blockIdx.x, splits = gridDim.x, kvh = blockIdx.y, b = blockIdx.z;
#ifdef TF_TIMELINE  // scripts/experiments/timeline_rope_attention.py: 16 stamps a CTA ahead of the partials
    const int cta_id = (b * gridDim.y + kvh) * gridDim.x + split;
    TF_TIMELINE_AT(reinterpret_cast<long long*>(partials) + cta_id * 16);
    partials += (size_t)gridDim.x * gridDim.y * gridDim.z * 32;
#endif
    TF_STAMP_IF(tid == 0, 0);
    TF_SMID_IF(tid == 0, 7);
    const int groups = heads / kv_heads;
    const int p0 = split * chunk, p1 = min(slots, p0 + chunk);
    const int tiles = (p1 - p0 + TILE - 1) / TILE;
    const size_t cache_row0 = ((size_t)b * kv_heads + kvh) * slots;
    const T* kb = keys + cache_row0 * D;
    const T* vb = values + cache_row0 * D;

    // Tile t's K and V rows into stage t % 2: 2 x TILE x CH chunks over the CTA; rows past p1 zero-filled.
    auto issue = [&](int t) {
        if (t < tiles) {
            T* ks = ring + (t & 1) * 2 * TILE_ELEMS;
            T* vs = ks + TILE_ELEMS;
            for (int e = tid; e < TILE * CH; e += THREADS) {
                const int r = e / CH, c = e % CH, p = p0 + t * TILE + r;
                const bool ok = p < p1;
                const size_t at = (size_t)(ok ? p : p0) * D + c * 8;
                cp_async16(ks + swz<D>(r, c), kb + at, ok);
                cp_async16(vs + swz<D>(r, c), vb + at, ok);
            }
        }
        cp_async_commit();  // one group a tile index, empty past the last tile
    };
    // The additive bias (log2 units; -inf where masked or past p1) of this lane's 8 scores of tile t.
    const unsigned char* mask_b = mask_kind == 1 ? static_cast<const unsigned char*>(mask) + b * mask_sb : nullptr;
    const unsigned short* mask_a = mask_kind == 2 ? static_cast<const unsigned short*>(mask) + b * mask_sb : nullptr;
    auto mask_bias = [&](int t, float (&bias)[2][4]) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int p = p0 + t * TILE + warp * 16 + n * 8 + 2 * (lane & 3) + (e & 1);
                float v = p < p1 ? 0.f : neg_inf();
                if (p < p1 && mask_b != nullptr && mask_b[p] == 0) v = neg_inf();
                if (p < p1 && mask_a != nullptr) v = rotary::unpack2<T>(static_cast<u32>(mask_a[p])).x * LOG2E;
                bias[n][e] = v;
            }
    };
    float next_bias[2][4];
    if (early_kv) {
        issue(0);
        issue(1);
        mask_bias(0, next_bias);
    }
    grid_dependency_wait();
    launch_dependent_grids();  // o may take SMs and stream its weights from here on (see the header)
    TF_STAMP_IF(tid == 0, 1);
    if (!early_kv) {
        issue(0);
        issue(1);
        mask_bias(0, next_bias);
    }
    if (tid == 0) length_s = ld_cg_i64(length);  // the kernel ahead may have moved it

    // rope(q) of the G heads into rows 0..G-1 of q_s, zeros below; the owner of position L rotates k, copies v.
    const T* row = qkv + (size_t)b * (heads + 2 * kv_heads) * D;
    const T* c_row = cos + b * cs_batch;
    const T* s_row = sin + b * cs_batch;
    constexpr int HALF = D / 16;  // 8-pair chunks of a rotated head: a head's chunks are HALF consecutive lanes
    static_assert(ROWS * HALF % 32 == 0 && 32 % HALF == 0, "whole warps take the q loop (the head norm's shuffles)");
    for (int e = tid; e < ROWS * HALF; e += THREADS) {
        const int g = e / HALF, i = (e % HALF) * 8;
        uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
        if (g < groups) rotary::load_chunk<T>(row + (size_t)(kvh * groups + g) * D, i, D, lo, hi);
        if (HEAD_NORM && q_norm != nullptr)
            rotary::norm_chunk_in_lanes<T>(lo, hi, q_norm, i, D, norm_eps, 0xffffffffu, HALF);
        if (g < groups) rotary::rotate_at<T>(lo, hi, c_row, s_row, i, D);
        else lo = hi = make_uint4(0, 0, 0, 0);  // the padding rows stay zeros whatever the norm made of them
        *reinterpret_cast<uint4*>(q_s + swz<D>(g, i / 8)) = lo;
        *reinterpret_cast<uint4*>(q_s + swz<D>(g, (i + D / 2) / 8)) = hi;
    }
    __syncthreads();  // length_s, q_s
    TF_STAMP_IF(tid == 0, 2);
    const long long L = length_s;
    const bool owner = L >= p0 && L < p1;  // L < slots: p1 <= slots
    if (owner) {
        T* kr = keys + (cache_row0 + L) * D;
        T* vr = values + (cache_row0 + L) * D;
        for (int e = tid; e < HALF; e += THREADS) {  // lanes 0 .. HALF - 1 of warp 0
            const T* k_row = row + (size_t)(heads + kvh) * D;
            uint4 lo, hi;
            rotary::load_chunk<T>(k_row, e * 8, D, lo, hi);
            if (HEAD_NORM && k_norm != nullptr)
                rotary::norm_chunk_in_lanes<T>(lo, hi, k_norm, e * 8, D, norm_eps, (1u << HALF) - 1, HALF);
            rotary::rotate_at<T>(lo, hi, c_row, s_row, e * 8, D);
            st_v4(kr + e * 8, lo);
            st_v4(kr + e * 8 + D / 2, hi);
            *reinterpret_cast<uint4*>(fresh + e * 8) = lo;
            *reinterpret_cast<uint4*>(fresh + e * 8 + D / 2) = hi;
        }
        for (int e = tid; e < CH; e += THREADS) {
            const uint4 v = ld_cg_v4(row + (size_t)(heads + kv_heads + kvh) * D + e * 8);
            st_v4(vr + e * 8, v);
            *reinterpret_cast<uint4*>(fresh + D + e * 8) = v;
        }
    }
    // Arrive on the length's counter now and look at the answer only on the way out: the last CTA to arrive
    // writes L + 1. Relaxed, so warp 0 does not wait for the round trip before its products (acq_rel did, and
    // cost the CTA ~2 us): the one ordering needed, every CTA's read of L before that write, holds because each
    // CTA arrives only after its read returned and was used (length_s, owner), and the write needs every arrival.
    const int arrived = tid == 0 ? atomic_add_relaxed(counters, 1) : 0;
    auto finish_length = [&] {
        if (tid == 0 && arrived == (int)(gridDim.x * gridDim.y * gridDim.z) - 1) {
            *length = L + 1;
            store_relaxed(counters, 0);
        }
    };

    // Q as A fragments, kept for the whole loop (every warp multiplies the same 16 rows).
    u32 qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int j = lane / 8, r = (j & 1) * 8 + (lane & 7), c = kk * 2 + (j >> 1);
        ldmatrix_x4(qa[kk], q_s + swz<D>(r, c));
    }

    float o[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};  // rows lane/4 and lane/4 + 8

    for (int t = 0; t < tiles; ++t) {
        float bias[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) bias[n][e] = next_bias[n][e];
        if (t + 1 < tiles) mask_bias(t + 1, next_bias);  // in flight while this tile computes
        cp_async_wait<1>();
        __syncthreads();  // tile t landed for every thread's copies
        TF_STAMP_IF(tid == 0 && t < 2, 8 + t);
        const T* ks = ring + (t & 1) * 2 * TILE_ELEMS;
        const T* vs = ks + TILE_ELEMS;
        const int base = p0 + t * TILE;
        if (owner && L >= base && L < base + TILE) {  // CTA-uniform: the new row over the copied one
            T* kt = const_cast<T*>(ks);
            T* vt = const_cast<T*>(vs);
            const int r = (int)(L - base);
            for (int c = tid; c < 2 * CH; c += THREADS) {
                T* dst = c < CH ? kt : vt;
                const int cc = c % CH;
                *reinterpret_cast<uint4*>(dst + swz<D>(r, cc)) = *reinterpret_cast<const uint4*>(fresh + (c / CH) * D + cc * 8);
            }
            __syncthreads();
        }
        // S = Q K^T for this warp's 16 positions (two n8 blocks).
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 kf[4];
            const int j = lane / 8, r = warp * 16 + (j >> 1) * 8 + (lane & 7), c = kk * 2 + (j & 1);
            ldmatrix_x4(kf, ks + swz<D>(r, c));
            Mma<T>::run(s[0], qa[kk], kf[0], kf[1]);
            Mma<T>::run(s[1], qa[kk], kf[2], kf[3]);
        }
        // Scale, mask, online softmax (log2 domain).
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = s[n][e] * scale_log2 + bias[n][e];  // -inf stays -inf: scores are finite
                s[n][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(m_run[h], mx[h]);
            alpha[h] = m_new == neg_inf() ? 1.f : exp2f(m_run[h] - m_new);
            m_run[h] = m_new;
        }
        u32 pa[4];
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            float pv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float m = m_run[e >> 1];
                pv[e] = m == neg_inf() ? 0.f : exp2f(s[n][e] - m);
            }
            // P rounded to T: the sums use the rounded values too, so the weights sum to what multiplies V.
            const float2 lo = rotary::round2<T>(pv[0], pv[1]), hi = rotary::round2<T>(pv[2], pv[3]);
            rs[0] += lo.x + lo.y;
            rs[1] += hi.x + hi.y;
            pa[n * 2] = rotary::pack2<T>(lo.x, lo.y);      // A: (row g, k 2t..) of block n -> a0 / a2
            pa[n * 2 + 1] = rotary::pack2<T>(hi.x, hi.y);  // (row g + 8, ...) -> a1 / a3
        }
        const u32 pfrag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
        for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + rs[h];
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        // O += P V: V's rows (positions) are the k of the product, so its B fragments come transposed.
#pragma unroll
        for (int n = 0; n < NB; n += 2) {
            u32 vf[4];
            const int j = lane / 8, r = warp * 16 + (j & 1) * 8 + (lane & 7), c = n + (j >> 1);
            ldmatrix_x4_trans(vf, vs + swz<D>(r, c));
            Mma<T>::run(o[n], pfrag, vf[0], vf[1]);
            Mma<T>::run(o[n + 1], pfrag, vf[2], vf[3]);
        }
        __syncthreads();  // every warp is done with stage t & 1
        TF_STAMP_IF(tid == 0 && t < 2, 10 + t);
        issue(t + 2);
    }
    cp_async_wait<0>();
    __syncthreads();
    TF_STAMP_IF(tid == 0, 3);

    // Merge the 4 warps (their rows' max, sum and O) through shared memory, over the ring.
    float* o_s = reinterpret_cast<float*>(smem_raw);  // [WARPS][ROWS][D]
    float* m_s = o_s + WARPS * ROWS * D;              // [WARPS][ROWS]
    float* l_s = m_s + WARPS * ROWS;                  // [WARPS][ROWS]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    }
    const int g0 = lane / 4;
    // Only the G query heads' rows are merged (rows past G are the A operand's zero padding).
    if ((lane & 3) == 0 && g0 < groups) {
        m_s[warp * ROWS + g0] = m_run[0];
        l_s[warp * ROWS + g0] = l_run[0];
    }
    if ((lane & 3) == 0 && g0 + 8 < groups) {
        m_s[warp * ROWS + g0 + 8] = m_run[1];
        l_s[warp * ROWS + g0 + 8] = l_run[1];
    }
    if (g0 < groups) {
#pragma unroll
        for (int n = 0; n < NB; ++n)
            *reinterpret_cast<float2*>(o_s + (warp * ROWS + g0) * D + n * 8 + 2 * (lane & 3)) = make_float2(o[n][0], o[n][1]);
    }
    if (g0 + 8 < groups) {
#pragma unroll
        for (int n = 0; n < NB; ++n)
            *reinterpret_cast<float2*>(o_s + (warp * ROWS + g0 + 8) * D + n * 8 + 2 * (lane & 3)) = make_float2(o[n][2], o[n][3]);
    }
    __syncthreads();

    // This CTA's max and sum of each head, and each warp's weight 2^(m_w - max) (0 for a warp with nothing).
    float* hm_s = l_s + WARPS * ROWS;  // [ROWS]
    float* hl_s = hm_s + ROWS;         // [ROWS]
    float* hw_s = hl_s + ROWS;         // [WARPS][ROWS]
    if (tid < groups) {
        float m = neg_inf(), l = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, m_s[w * ROWS + tid]);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = m_s[w * ROWS + tid], ww = mw == neg_inf() ? 0.f : exp2f(mw - m);
            hw_s[w * ROWS + tid] = ww;
            l += l_s[w * ROWS + tid] * ww;
        }
        hm_s[tid] = m;
        hl_s[tid] = l;
    }
    __syncthreads();
    TF_STAMP_IF(tid == 0, 4);
    auto cta_value = [&](int g, int d) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v = __fmaf_rn(o_s[(w * ROWS + g) * D + d], hw_s[w * ROWS + g], v);
        return v;
    };
    T* out_b = out + ((size_t)b * heads + kvh * groups) * D;  // [B, 1, H, D]: head kvh * G + g
    if (splits == 1) {
        for (int e = tid; e < groups * D; e += THREADS) {
            const int g = e / D;
            out_b[e] = Vec2<T>::one(hl_s[g] > 0.f ? cta_value(g, e % D) / hl_s[g] : 0.f);
        }
        finish_length();
        TF_STAMP_IF(tid == 0, 6);
        return;
    }
    if (cluster_combine) {  // rank = split: the cluster spans gridDim.x
        float* po = hw_s + WARPS * ROWS;  // [G][D] this CTA's O, relative to its maxima hm_s (after the merge area)
        for (int e = tid; e < groups * D; e += THREADS) po[e] = cta_value(e / D, e % D);
        // The length after the barriers: the barrier's release would otherwise wait for that store to reach L2.
        cluster_sync();  // every split's po, hm_s and hl_s, visible to the cluster
        TF_STAMP_IF(tid == 0, 5);
        const u32 po_a = smem_addr(po), hm_a = smem_addr(hm_s), hl_a = smem_addr(hl_s);
        // One DSMEM round trip an output: every split's max, sum and O of it, all in flight at once.
        for (int e = split * THREADS + tid; e < groups * D; e += splits * THREADS) {
            const int g = e / D;
            float mq[MAX_CLUSTER], lq[MAX_CLUSTER], pv[MAX_CLUSTER];
#pragma unroll
            for (int q = 0; q < MAX_CLUSTER; ++q)
                if (q < splits) {
                    mq[q] = ld_shared_cluster_f32(mapa_shared(hm_a + 4 * g, q));
                    lq[q] = ld_shared_cluster_f32(mapa_shared(hl_a + 4 * g, q));
                    pv[q] = ld_shared_cluster_f32(mapa_shared(po_a + 4 * e, q));
                }
            float m = neg_inf(), l = 0.f, v = 0.f;
#pragma unroll
            for (int q = 0; q < MAX_CLUSTER; ++q)
                if (q < splits) m = fmaxf(m, mq[q]);
#pragma unroll
            for (int q = 0; q < MAX_CLUSTER; ++q)
                if (q < splits) {
                    const float wq = mq[q] == neg_inf() ? 0.f : exp2f(mq[q] - m);
                    l = __fmaf_rn(lq[q], wq, l);
                    v = __fmaf_rn(pv[q], wq, v);
                }
            out_b[e] = Vec2<T>::one(v * (l > 0.f ? 1.f / l : 0.f));
        }
        cluster_sync();  // no CTA leaves while a peer may still read its shared memory
        finish_length();
        TF_STAMP_IF(tid == 0, 6);
        return;
    }
    // Partial of split s: [G][D] O, then [G] max, then [G] sum (fp32, st.cg: read back from L2 by the last CTA).
    const int per = groups * (D + 2);
    float* part = partials + ((size_t)(b * kv_heads + kvh) * splits) * per;
    float* mine = part + (size_t)split * per;
    for (int e = tid; e < groups * D; e += THREADS) __stcg(mine + e, cta_value(e / D, e % D));
    if (tid < groups) {
        __stcg(mine + groups * D + tid, hm_s[tid]);
        __stcg(mine + groups * D + groups + tid, hl_s[tid]);
    }
    int* counter = counters + 1 + b * kv_heads + kvh;
    finish_length();
    const bool last = fixup_arrive_cta(counter, splits, tid == 0, last_s, [] { __syncthreads(); });
    TF_STAMP_IF(tid == 0, 5);
    if (!last) return;
    // The last CTA: every split's max and sum at once (one load a thread), the weights 2^(m_q - max) per head,
    // then each output a sum over the splits in split order, its loads independent of each other.
    float* w_q = reinterpret_cast<float*>(smem_raw);  // [splits][G]: maxima, then weights (over the merge area)
    float* l_q = w_q + splits * groups;               // [splits][G]
    float* inv_s = l_q + splits * groups;             // [G]
    for (int e = tid; e < splits * groups; e += THREADS) {
        const float* pq = part + (size_t)(e / groups) * per + groups * D + e % groups;
        w_q[e] = __ldcg(pq);
        l_q[e] = __ldcg(pq + groups);
    }
    __syncthreads();
    if (tid < groups) {
        float m = neg_inf(), l = 0.f;
        for (int q = 0; q < splits; ++q) m = fmaxf(m, w_q[q * groups + tid]);
        for (int q = 0; q < splits; ++q) {
            const float mq = w_q[q * groups + tid], wq = mq == neg_inf() ? 0.f : exp2f(mq - m);
            w_q[q * groups + tid] = wq;
            l = __fmaf_rn(l_q[q * groups + tid], wq, l);
        }
        inv_s[tid] = l > 0.f ? 1.f / l : 0.f;
    }
    __syncthreads();
    for (int e = tid; e < groups * D; e += THREADS) {
        const int g = e / D;
        float v = 0.f;
#pragma unroll 8
        for (int q = 0; q < splits; ++q) v = __fmaf_rn(__ldcg(part + (size_t)q * per + e), w_q[q * groups + g], v);
        out_b[e] = Vec2<T>::one(v * inv_s[g]);
    }
    if (tid == 0) fixup_reset(counter);
    TF_STAMP_IF(tid == 0, 6);
}
