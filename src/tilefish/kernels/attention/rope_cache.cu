// The rotary embedding and KV-cache write of a Llama-family attention step (ops/rope_cache.py), straight from
// the fused q/k/v projection's output, in one launch. For every token (b, j) of qkv [B, T, (H + 2 KV) * D]:
//   q_out[b, j, h]       = rope(q_h)   (h < H; q_out is [B, T, H, D], the layout transformers' query has)
//   keys[b, g, L + j]    = rope(k_g),   values[b, g, L + j] = v_g   (g < KV; the caches are [B, KV, S, D])
// with L = *length as the launch found it, and *length = L + T once every CTA has read it: transformers'
// StaticLayer.update (index_copy_ at arange(T) + cumulative_length, then cumulative_length += T).
// rope(x) pairs element i < D/2 with i + D/2, rounded as transformers' eager rotary rounds (attention/rotary.cuh).
// q_norm / k_norm (optional, [D]; the HEAD_NORM build, the other ignores them): each q / k head is RMS-normalized
// first, as Qwen3's attention does (rotary.cuh's head norm; a unit reads its head's other chunks, from L2).
// cos / sin: [B or 1, T, D] rows (strides in elements; the batch stride 0 for a shared row).
//
// Work units: 8 pairs of one rotated head (16 bytes of each half), or 8 elements of one v head; thread t of
// the grid takes units t, t + stride, ... Positions L + j >= S are not written (the op's documented rule).
// The length: thread 0 of each CTA reads L before it arrives on `arrivals` (atom.acq_rel, the W4A16 counter
// protocol of w4a16/fixup.cuh); the last CTA to arrive writes L + T and puts `arrivals` back to zero, so no CTA
// can read a length another has moved. Under programmatic dependent launch everything comes after
// grid_dependency_wait: the launch only gets its CTAs resident while the q/k/v GEMM ahead finishes.
// Limits (the op checks them): D % 16 == 0, 16-byte aligned rows.
#include "attention/rotary.cuh"

using namespace tf;

template <typename T, bool HEAD_NORM>
__global__ void __launch_bounds__(256)
rope_cache(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ q_out,
           T* __restrict__ keys, T* __restrict__ values, long long* __restrict__ length, int* __restrict__ arrivals,
           int batch, int tokens, int heads, int kv_heads, int dim, int slots, long long cs_batch, long long cs_token,
           const T* __restrict__ q_norm, const T* __restrict__ k_norm, float norm_eps) {
    __shared__ long long base_shared;
    launch_dependent_grids();
    grid_dependency_wait();
    if (threadIdx.x == 0) base_shared = ld_cg_i64(length);  // the kernel ahead may have moved it
    __syncthreads();
    const long long base = base_shared;
    const int half_chunks = dim >> 4, chunks = dim >> 3, width = (heads + 2 * kv_heads) * dim;
    const int rotated = (heads + kv_heads) * half_chunks, per_token = rotated + kv_heads * chunks;
    const long long units = (long long)batch * tokens * per_token;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += (long long)gridDim.x * blockDim.x) {
        const long long token = u / per_token;
        const int r = (int)(u - token * per_token);
        const int b = (int)(token / tokens), j = (int)(token - (long long)b * tokens);
        const T* row = qkv + token * width;
        const long long slot = base + j;
        if (r < rotated) {
            const int head = r / half_chunks, i = (r - head * half_chunks) * 8;
            T* dst;
            if (head < heads) {
                dst = q_out + (token * heads + head) * dim;
            } else {
                if (slot >= slots) continue;
                dst = keys + (((long long)b * kv_heads + head - heads) * slots + slot) * dim;
            }
            const T* src = row + head * dim;
            const T* c = cos + b * cs_batch + j * cs_token;
            const T* s = sin + b * cs_batch + j * cs_token;
            const T* norm = head < heads ? q_norm : k_norm;
            uint4 lo, hi;
            rotary::load_chunk<T>(src, i, dim, lo, hi);
            if (HEAD_NORM && norm != nullptr) rotary::norm_chunk_reading_head<T>(lo, hi, src, norm, i, dim, norm_eps);
            rotary::rotate_at<T>(lo, hi, c, s, i, dim);
            st_v4(dst + i, lo);
            st_v4(dst + i + dim / 2, hi);
        } else {
            if (slot >= slots) continue;
            const int rv = r - rotated, g = rv / chunks, i = (rv - g * chunks) * 8;
            st_v4(values + (((long long)b * kv_heads + g) * slots + slot) * dim + i,
                  ld_cg_v4(row + (heads + kv_heads + g) * dim + i));
        }
    }
    if (threadIdx.x == 0 && atomic_add_acq_rel(arrivals, 1) == (int)gridDim.x - 1) {
        *length = base + tokens;
        store_relaxed(arrivals, 0);
    }
}
