// RMSNorm of Llama-family decoders (ops/norm.py), in the order of transformers' LlamaRMSNorm: with T the
// 16-bit type and every sum and product in fp32,
//   h = x, or round_T(x + residual) (written to sum_out: the decoder's next residual)
//   y = round_T(h * rsqrt(sum(h^2) / cols + eps)),   out = round_T(weight * y)
//
// One CTA a row. A row is cols / 8 16-byte chunks; thread t holds chunks t, t + blockDim, ... (VPT of them,
// each warp's loads coalesced) in registers, so the row is read once. The sum of squares: warp shuffles,
// then one shared-memory exchange whose partials every warp sums for itself (the same bits in every warp,
// and no second barrier). The weight goes to shared memory (cols x 2 bytes of dynamic smem) by cp.async, not
// to registers: 1024 threads allow 64 registers a thread, and VPT 4 chunks of x, residual and weight held at
// once spilled. Limits: cols % 8 == 0 and cols <= 8 x VPT x blockDim (<= 32768 at VPT 4 and 1024 threads);
// the op picks VPT and blockDim.
//
// Programmatic dependent launch (sm_90+): the next kernel may be scheduled at once (a GEMM's CTAs take SMs
// and start on their weights as these leave); the weight's copy starts before grid_dependency_wait (nothing
// in flight writes it), x and residual are read (through L2: ld_cg_v4), and everything is written, after it.
#include "common/ptx.cuh"
#include "w4a16/dequant.cuh"  // Vec2 / Dequant: 16-bit pairs <-> float2 and u32

using namespace tf;

template <typename T> __device__ __forceinline__ float2 unpack2(u32 v) {
    return Vec2<T>::to_float2(Dequant<T>::as_h2(v));
}
template <typename T> __device__ __forceinline__ u32 pack2(float a, float b) {  // each rounded once to T
    return Dequant<T>::as_u32(Vec2<T>::make(a, b));
}

// Butterfly sum: every lane ends with the same bits (each step adds the same two values in every lane).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// x, residual, sum_out, out: [rows, cols]; weight: [cols]. residual == nullptr: no add, sum_out unused.
template <typename T, int VPT>
__global__ void __launch_bounds__(1024)
rms_norm(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ weight,
         T* __restrict__ sum_out, T* __restrict__ out, int cols, float eps) {
    extern __shared__ uint4 w_smem[];  // chunk c of the weight at c: each thread reads back only its own copies
    __shared__ float warp_sums[32];
    launch_dependent_grids();
    const int chunks = cols >> 3, lane = threadIdx.x & 31;
    const size_t base = (size_t)blockIdx.x * cols;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) cp_async16(&w_smem[c], weight + 8 * c);
    }
    cp_async_commit();
    grid_dependency_wait();
    uint4 h[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) h[i] = ld_cg_v4(x + base + 8 * c);
    }
    if (residual != nullptr) {  // h = round_T(x + residual), stored at once (the next residual)
        uint4 r[VPT];
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < chunks) r[i] = ld_cg_v4(residual + base + 8 * c);
        }
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c >= chunks) continue;
            u32 s[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 a = unpack2<T>(word(h[i], k)), b = unpack2<T>(word(r[i], k));
                s[k] = pack2<T>(a.x + b.x, a.y + b.y);
            }
            h[i] = make_uint4(s[0], s[1], s[2], s[3]);
            st_v4(sum_out + base + 8 * c, h[i]);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        if (threadIdx.x + i * blockDim.x >= chunks) continue;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = unpack2<T>(word(h[i], k));
            ss = fmaf(f.x, f.x, ss);
            ss = fmaf(f.y, f.y, ss);
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = warp_sum(lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.f);
    const float inv = rsqrtf(ss / (float)cols + eps);
    cp_async_wait<0>();  // this thread's weight chunks have landed (and only those are read: no barrier)
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c >= chunks) continue;
        const uint4 w = w_smem[c];
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = unpack2<T>(word(h[i], k)), g = unpack2<T>(word(w, k));
            const float2 y = unpack2<T>(pack2<T>(f.x * inv, f.y * inv));  // y.to(T), as LlamaRMSNorm rounds it
            o[k] = pack2<T>(g.x * y.x, g.y * y.y);
        }
        st_v4(out + base + 8 * c, make_uint4(o[0], o[1], o[2], o[3]));
    }
}
