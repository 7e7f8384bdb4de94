// Attention of one new token against a KV cache (ops/decode_attention.py), grouped-query heads read once:
//   out[b, h] = softmax(scale * q[b, h] . K[b, h / G]^T + mask[b]) V[b, h / G]      (G = heads / kv heads)
// in fp32, rounded once to T at the end. Positions a bool mask marks false (or an additive mask makes -inf)
// take no weight; a row with no position left gives zeros (as torch's SDPA since 2.5).
//
// Grid (C, kv heads, batch), clusters of C CTAs along x (sm_90; C = 1 below). CTA `rank` of a cluster takes
// positions [rank * chunk, rank * chunk + chunk) of its (batch, kv head) and every query head of that kv
// head, so K and V are read from DRAM once for the G heads.
//
// Layout: LPR = D / 8 lanes share a row (16 bytes each), so the CTA covers RPP = THREADS / LPR rows at once;
// thread (r, c) takes rows r, r + RPP, ... of every tile of TILE rows and columns 8c..8c+7, for K and V alike.
// It copies exactly those 16-byte pieces into shared memory (cp.async, STAGES tiles in flight) and is their
// only reader, so the loop needs no CTA barrier. Scores: 8-element dot products summed over the row's lanes
// by shuffles (every lane ends with the sum); each row group keeps its own online softmax (max m, sum l,
// unnormalized acc of its 8 columns), rescaled once per RB rows. After the loop the row groups are merged
// through shared memory into the CTA's (m, l, acc[D]) per head; the cluster barrier publishes them and CTA r
// combines the D / C columns r * D / C.. of every head from all C CTAs (distributed shared memory).
//
// Programmatic dependent launch (sm_90+): everything here (q, the cache the kernel ahead wrote, the mask) is
// read after grid_dependency_wait; the next kernel (the o projection's GEMM) may be scheduled once this one
// has read the cache, and start on its weights during the merges.
#include "common/ptx.cuh"

using namespace tf;

namespace {

constexpr int THREADS = 256, TILE = 64, STAGES = 3, RB = 2;
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float inf_f() { return __int_as_float(0x7f800000); }

}  // namespace

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 8 elements of a 16-byte vector as floats
template <typename T> __device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_f<T>(e[i]);
}

namespace {

// Cluster helpers (sm_90, any variant): the barrier every thread of every CTA passes, and a float read from
// CTA `rank`'s shared memory at the offset of local `p`.
__device__ __forceinline__ void cluster_barrier() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ float ld_cluster_f32(const float* p, u32 rank) {
#if __CUDA_ARCH__ >= 900
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));  // after the cluster barrier
    return v;
#else
    return *p;
#endif
}

}  // namespace

// q: [batch, heads, D] at strides (q_sb, q_sh, 1); k / v: [batch, kv heads, S, D] at strides (sb, sh, ss, 1);
// mask: mask_kind 0 none, 1 bool (bytes, false = masked), 2 additive T; [batch, S] at strides (m_sb, 1)
// (m_sb 0: one row for every batch); out: [batch, heads, D] contiguous. groups = heads / kv heads <= GMAX.
// scale_log2 = softmax scale x log2(e). Dynamic shared memory: smem_bytes(D, GMAX) in ops/decode_attention.py.
template <typename T, int D, int GMAX>
__global__ void __launch_bounds__(THREADS, GMAX <= 4 ? 2 : 1)  // two CTAs an SM where registers allow
decode_attention(const T* __restrict__ q, long long q_sb, long long q_sh,
                 const T* __restrict__ k, long long k_sb, long long k_sh, long long k_ss,
                 const T* __restrict__ v, long long v_sb, long long v_sh, long long v_ss,
                 const void* __restrict__ mask, int mask_kind, long long m_sb,
                 T* __restrict__ out, int S, int groups, float scale_log2) {
    constexpr int LPR = D / 8;            // lanes a row
    constexpr int RPP = THREADS / LPR;    // rows the CTA covers at once (row groups)
    constexpr int ROWS = TILE / RPP;      // rows a thread takes in a tile
    static_assert(D == 64 || D == 128, "head dim 64 or 128");
    static_assert(TILE % RPP == 0 && ROWS % RB == 0, "tile geometry");
    constexpr int STAGE_BYTES = STAGES * 2 * TILE * D * (int)sizeof(T);
    constexpr int MERGE_BYTES = RPP * GMAX * (D + 2) * 4;   // the row groups' (acc, m, l), after the loop
    constexpr int REGION = STAGE_BYTES > MERGE_BYTES ? STAGE_BYTES : MERGE_BYTES;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* kv_s = reinterpret_cast<T*>(smem_raw);                                  // [STAGES][2][TILE][D]
    float* acc_s = reinterpret_cast<float*>(smem_raw + REGION);                // [GMAX][D]: the CTA's sums
    float* m_s = acc_s + GMAX * D;                                             // [GMAX] max (log2 units)
    float* l_s = m_s + GMAX;                                                   // [GMAX] sum

    const int tid = threadIdx.x;
    const int C = gridDim.x, rank = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int chunk = (S + C - 1) / C;
    const int start = min(S, rank * chunk), end = min(S, start + chunk);
    const int tiles = (end - start + TILE - 1) / TILE;
    const T* kb = k + b * k_sb + kvh * k_sh + (tid % LPR) * 8;
    const T* vb = v + b * v_sb + kvh * v_sh + (tid % LPR) * 8;
    const int row0 = tid / LPR, c8 = tid % LPR;

    auto piece = [&](int t, int i, int which) {  // this thread's 16 bytes of row i of tile t, K (0) or V (1)
        return kv_s + (((t % STAGES) * 2 + which) * TILE + row0 + i * RPP) * D + c8 * 8;
    };
    auto issue = [&](int t) {  // one commit group a tile index, empty past the last tile
        if (t < tiles) {
            const int base = start + t * TILE;
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                const int p = base + row0 + i * RPP;
                const bool ok = p < end;
                const long long pc = ok ? p : start;  // any valid address when zero-filled
                cp_async16(piece(t, i, 0), kb + pc * k_ss, ok);
                cp_async16(piece(t, i, 1), vb + pc * v_ss, ok);
            }
        }
        cp_async_commit();
    };
    // the raw mask words of tile t's rows (converted where used, so the loads stay in flight meanwhile)
    auto load_mask = [&](int t, unsigned (&m)[ROWS]) {
        const int base = start + t * TILE;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int p = base + row0 + i * RPP;
            m[i] = 0u;
            if (p < end) {
                if (mask_kind == 1) m[i] = static_cast<const unsigned char*>(mask)[b * m_sb + p];
                else if (mask_kind == 2) m[i] = reinterpret_cast<const unsigned short*>(mask)[b * m_sb + p];
            }
        }
    };

    grid_dependency_wait();
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) issue(t);
    float qf[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (g < groups) {
            unpack8<T>(*reinterpret_cast<const uint4*>(q + b * q_sb + (kvh * groups + g) * q_sh + c8 * 8), qf[g]);
#pragma unroll
            for (int e = 0; e < 8; ++e) qf[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qf[g][e] = 0.f;
        }
    }
    unsigned mcur[ROWS], mnext[ROWS];
    if (tiles > 0) load_mask(0, mcur);
    float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        m[g] = -inf_f();
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }

    for (int t = 0; t < tiles; ++t) {
        const int base = start + t * TILE;
        issue(t + STAGES - 1);  // into the stage this thread finished reading last iteration
        if (t + 1 < tiles) load_mask(t + 1, mnext);
        cp_async_wait<STAGES - 1>();  // tile t's pieces (this thread's own copies) have landed
#pragma unroll
        for (int i0 = 0; i0 < ROWS; i0 += RB) {
            if (base + i0 * RPP >= end) break;  // every row of the batch, in every thread, past the range
            float s[RB][GMAX];
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                const int i = i0 + r;
                float kf[8];
                unpack8<T>(*reinterpret_cast<const uint4*>(piece(t, i, 0)), kf);
#pragma unroll
                for (int g = 0; g < GMAX; ++g) {
                    float d = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                    s[r][g] = d;
                }
            }
#pragma unroll
            for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
                for (int r = 0; r < RB; ++r)
#pragma unroll
                    for (int g = 0; g < GMAX; ++g) s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], o);
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                const int i = i0 + r;
                float add = 0.f;
                if (base + row0 + i * RPP >= end) add = -inf_f();
                else if (mask_kind == 1) add = (mcur[i] & 0xffu) ? 0.f : -inf_f();
                else if (mask_kind == 2) {
                    const unsigned short raw = static_cast<unsigned short>(mcur[i]);
                    add = to_f<T>(*reinterpret_cast<const T*>(&raw)) * LOG2E;
                }
#pragma unroll
                for (int g = 0; g < GMAX; ++g) s[r][g] += add;
            }
            float vf[RB][8];
#pragma unroll
            for (int r = 0; r < RB; ++r) unpack8<T>(*reinterpret_cast<const uint4*>(piece(t, i0 + r, 1)), vf[r]);
#pragma unroll
            for (int g = 0; g < GMAX; ++g) {
                float mx = m[g];
#pragma unroll
                for (int r = 0; r < RB; ++r) mx = fmaxf(mx, s[r][g]);
                if (mx == -inf_f()) continue;  // nothing unmasked yet
                const float alpha = exp2f(m[g] - mx);  // 0 while m was -inf
                l[g] *= alpha;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
#pragma unroll
                for (int r = 0; r < RB; ++r) {
                    const float p = exp2f(s[r][g] - mx);
                    l[g] += p;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[r][e], acc[g][e]);
                }
                m[g] = mx;
            }
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i) mcur[i] = mnext[i];
    }
    cp_async_wait<0>();  // the empty groups; no copy may still land in the stages reused below
    // The cache is read: the next kernel may start on its weights during the merges (not earlier, where its
    // loads would compete with this stream of K / V).
    launch_dependent_grids();
    __syncthreads();

    // merge the row groups (in order) into the CTA's sums, in the stages' shared memory
    float* red_acc = reinterpret_cast<float*>(kv_s);   // [RPP][GMAX][D]
    float* red_m = red_acc + RPP * GMAX * D;          // [RPP][GMAX]
    float* red_l = red_m + RPP * GMAX;                // [RPP][GMAX]
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
        for (int e = 0; e < 8; ++e) red_acc[(row0 * GMAX + g) * D + c8 * 8 + e] = acc[g][e];
        if (c8 == 0) { red_m[row0 * GMAX + g] = m[g]; red_l[row0 * GMAX + g] = l[g]; }
    }
    __syncthreads();
    for (int idx = tid; idx < groups * D; idx += THREADS) {
        const int g = idx / D, c = idx % D;
        float mx = -inf_f();
        for (int r = 0; r < RPP; ++r) mx = fmaxf(mx, red_m[r * GMAX + g]);
        float sl = 0.f, sa = 0.f;
        if (mx != -inf_f()) {
            for (int r = 0; r < RPP; ++r) {
                const float w = exp2f(red_m[r * GMAX + g] - mx);
                sl = fmaf(w, red_l[r * GMAX + g], sl);
                sa = fmaf(w, red_acc[(r * GMAX + g) * D + c], sa);
            }
        }
        acc_s[g * D + c] = sa;
        if (c == 0) { m_s[g] = mx; l_s[g] = sl; }
    }
    if (C > 1) cluster_barrier(); else __syncthreads();

    // combine: this CTA writes columns [rank * D / C, (rank + 1) * D / C) of every head
    const int cols = D / C;
    T* ob = out + ((long long)b * gridDim.y * groups + kvh * groups) * D;
    for (int idx = tid; idx < groups * cols; idx += THREADS) {
        const int g = idx / cols, c = rank * cols + idx % cols;
        float mr[8], lr[8], ar[8];  // every CTA's (m, l, acc) first: the remote loads all in flight at once
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            if (r < C) {
                mr[r] = C > 1 ? ld_cluster_f32(m_s + g, r) : m_s[g];
                lr[r] = C > 1 ? ld_cluster_f32(l_s + g, r) : l_s[g];
                ar[r] = C > 1 ? ld_cluster_f32(acc_s + g * D + c, r) : acc_s[g * D + c];
            }
        }
        float mx = -inf_f();
#pragma unroll
        for (int r = 0; r < 8; ++r) if (r < C) mx = fmaxf(mx, mr[r]);
        float sl = 0.f, o = 0.f;
        if (mx != -inf_f()) {
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                if (r < C) {
                    const float w = exp2f(mr[r] - mx);
                    sl = fmaf(w, lr[r], sl);
                    o = fmaf(w, ar[r], o);
                }
            }
        }
        ob[g * D + c] = from_f<T>(sl > 0.f ? o / sl : 0.f);
    }
    if (C > 1) cluster_barrier();  // peers read this CTA's shared memory until here
}
