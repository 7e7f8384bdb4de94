// NF4 dequantization, bitsandbytes-compatible (see docs/nf4.md for the format).
//
// out[i] = NF4[code_i] * absmax[i >> log2_blocksize], computed in fp32 and rounded once to
// OutT. With double quantization absmax[b] = code2[absmax_q[b]] * absmax2[b >> 8] + offset,
// each product and sum rounded to fp32 separately (no FMA), exactly as bitsandbytes does.
//
// Work unit: one 16-byte vector of codes = 32 elements. blocksize >= 32, so a vector never
// straddles two absmax blocks: the absmax is decoded once per vector (with TRANSPOSE the
// decoded scale travels to the lanes that store the vector's words by a warp shuffle). A grid-stride loop over
// vectors, grid sized from the SM count on the host; the < 32 leftover elements go through a
// scalar tail. No run-time division: block indices are shifts.
//
// Variants (template parameters), kept so the benchmark can show which choice wins:
//   LUT       0: the 16 NF4 values in shared memory (16 banks, so any lookup pattern is
//                conflict-free); 1: in a register of each lane, fetched with a warp shuffle;
//                2: a 256-entry float2 table in shared memory indexed by the whole byte.
//   TRANSPOSE 0: each lane writes the 64..128 contiguous output bytes of its own vector;
//             1: the warp's 512 code bytes are re-dealt through shared memory so that
//                every 16-byte store instruction of the warp covers one contiguous span.
//   ILP       vectors loaded per lane before the first is decoded (bytes in flight).
//   STREAM    evict-first stores for the output.
//   PREFETCH  the L2::256B hint on code loads (DRAM fetches whole 256 B spans).
// Limits: it is a pure streaming kernel; the ceiling is DRAM bandwidth (2.5 B per element
// for 16-bit output), so everything here is about keeping enough bytes in flight.
#include "common/ptx.cuh"

using namespace tf;

__constant__ float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Nf4Args {
    const unsigned char* codes;    // packed nibbles, 16-byte aligned, high nibble first
    void* out;                     // OutT[numel], 16-byte aligned
    const float* absmax;           // single level: fp32[nblocks]
    const unsigned char* absmax_q; // double quant: uint8[nblocks]
    const float* code2;            // double quant: fp32[256]
    const float* absmax2;          // double quant: fp32[ceil(nblocks / 256)]
    const float* offset;           // double quant: fp32[1]
    long long numel;
    int log2_blocksize;
};

template <typename OutT> struct OutTraits;
template <> struct OutTraits<__nv_bfloat16> {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ u32 pack(float a, float b) { return pack_bf16x2(a, b); }
    static __device__ __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};
template <> struct OutTraits<__half> {
    static constexpr int kBytes = 2;
    static __device__ __forceinline__ u32 pack(float a, float b) { return pack_f16x2(a, b); }
    static __device__ __forceinline__ __half one(float a) { return __float2half_rn(a); }
};
template <> struct OutTraits<float> {
    static constexpr int kBytes = 4;
    static __device__ __forceinline__ float one(float a) { return a; }
};

template <bool DQ>
__device__ __forceinline__ float block_absmax(const Nf4Args& a, long long block, const float* s_code2,
                                              float offset) {
    if constexpr (DQ) {
        // __fmul_rn/__fadd_rn: forbid FMA contraction so the rounding matches bitsandbytes.
        return __fadd_rn(__fmul_rn(s_code2[__ldg(a.absmax_q + block)], __ldg(a.absmax2 + (block >> 8))), offset);
    } else {
        return __ldg(a.absmax + block);
    }
}

template <int LUT>
struct Lookup {
    const float* s_lut16;   // LUT 0
    const float2* s_lut256; // LUT 2
    float lane_value;       // LUT 1: NF4[lane & 15]

    // Values of the two nibbles of `byte`: .x the high nibble (earlier element), .y the low one.
    __device__ __forceinline__ float2 pair(u32 byte) const {
        if constexpr (LUT == 0) {
            return make_float2(s_lut16[byte >> 4], s_lut16[byte & 15]);
        } else if constexpr (LUT == 1) {
            return make_float2(__shfl_sync(0xffffffffu, lane_value, byte >> 4),
                               __shfl_sync(0xffffffffu, lane_value, byte & 15));
        } else {
            return s_lut256[byte];
        }
    }
};

// Decode one 4-byte word of codes (8 elements) scaled by `scale`; store them if `live`.
// Every lane decodes (dead lanes decode zeros) so warp shuffles (LUT 1) stay converged.
template <typename OutT, int LUT, bool STREAM>
__device__ __forceinline__ void decode_store_word(u32 w, float scale, const Lookup<LUT>& lut, OutT* dst, bool live) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 p = lut.pair((w >> (8 * k)) & 0xffu);
        v[2 * k] = __fmul_rn(p.x, scale);
        v[2 * k + 1] = __fmul_rn(p.y, scale);
    }
    if (!live) return;
    if constexpr (sizeof(OutT) == 2) {
        uint4 o = make_uint4(OutTraits<OutT>::pack(v[0], v[1]), OutTraits<OutT>::pack(v[2], v[3]),
                             OutTraits<OutT>::pack(v[4], v[5]), OutTraits<OutT>::pack(v[6], v[7]));
        if constexpr (STREAM) st_cs_v4(dst, o); else st_v4(dst, o);
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 o = make_uint4(__float_as_uint(v[4 * h]), __float_as_uint(v[4 * h + 1]),
                                 __float_as_uint(v[4 * h + 2]), __float_as_uint(v[4 * h + 3]));
            if constexpr (STREAM) st_cs_v4(dst + 4 * h, o); else st_v4(dst + 4 * h, o);
        }
    }
}

template <typename OutT, bool DQ, int LUT, int TRANSPOSE, int ILP, bool STREAM, bool PREFETCH = false>
__global__ void __launch_bounds__(kThreads)
nf4_dequantize(const unsigned char* codes_ptr, void* out_ptr, const float* absmax, const unsigned char* absmax_q,
               const float* code2, const float* absmax2, const float* offset_ptr, long long numel,
               int log2_blocksize) {
    const Nf4Args a{codes_ptr, out_ptr, absmax, absmax_q, code2, absmax2, offset_ptr, numel, log2_blocksize};
    __shared__ float s_code2[DQ ? 256 : 1];
    __shared__ float s_lut16[16];
    __shared__ float2 s_lut256[LUT == 2 ? 256 : 1];
    __shared__ uint4 s_stage[TRANSPOSE ? kWarps * 32 * ILP : 1];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    if constexpr (DQ) s_code2[tid] = a.code2[tid];  // kThreads == 256
    if (tid < 16) s_lut16[tid] = kNF4[tid];
    if constexpr (LUT == 2) s_lut256[tid] = make_float2(kNF4[tid >> 4], kNF4[tid & 15]);
    __syncthreads();

    Lookup<LUT> lut{s_lut16, s_lut256, kNF4[lane & 15]};
    const float offset = DQ ? __ldg(a.offset) : 0.f;
    OutT* out = reinterpret_cast<OutT*>(a.out);
    const uint4* codes = reinterpret_cast<const uint4*>(a.codes);

    const long long n_vec = a.numel >> 5;  // full 32-element vectors
    const int vec_shift = a.log2_blocksize - 5;  // vectors per absmax block = 1 << vec_shift
    // The loop runs in whole-warp steps so that warp shuffles (LUT 1) and the warp's staging
    // buffer (TRANSPOSE) always see all 32 lanes; lanes past the end are predicated off.
    const long long warp_stride = (long long)gridDim.x * kWarps * 32 * ILP;
    for (long long base = ((long long)blockIdx.x * kWarps + warp) * 32 * ILP; base < n_vec; base += warp_stride) {
        uint4 c[ILP];
#pragma unroll
        for (int u = 0; u < ILP; ++u) {
            long long v = base + u * 32 + lane;
            c[u] = v < n_vec ? (PREFETCH ? ld_nc_v4_l2_256(codes + v) : ld_nc_v4(codes + v)) : make_uint4(0, 0, 0, 0);
        }
        if constexpr (TRANSPOSE == 0) {
#pragma unroll
            for (int u = 0; u < ILP; ++u) {
                long long v = base + u * 32 + lane;
                bool live = v < n_vec;
                float scale = live ? block_absmax<DQ>(a, v >> vec_shift, s_code2, offset) : 0.f;
                OutT* dst = out + v * 32;
                decode_store_word<OutT, LUT, STREAM>(c[u].x, scale, lut, dst, live);
                decode_store_word<OutT, LUT, STREAM>(c[u].y, scale, lut, dst + 8, live);
                decode_store_word<OutT, LUT, STREAM>(c[u].z, scale, lut, dst + 16, live);
                decode_store_word<OutT, LUT, STREAM>(c[u].w, scale, lut, dst + 24, live);
            }
        } else {
            // Re-deal: word (i*32 + lane) of the warp's span goes to lane `lane` in step i,
            // so each 16-byte store instruction of the warp writes one contiguous 512 B run.
            uint4* stage = s_stage + warp * 32 * ILP;
            float own_scale[ILP];  // absmax of the lane's own vector, decoded once
#pragma unroll
            for (int u = 0; u < ILP; ++u) {
                stage[u * 32 + lane] = c[u];
                long long v = base + u * 32 + lane;
                own_scale[u] = v < n_vec ? block_absmax<DQ>(a, v >> vec_shift, s_code2, offset) : 0.f;
            }
            __syncwarp();
            const u32* words = reinterpret_cast<const u32*>(stage);
#pragma unroll
            for (int i = 0; i < 4 * ILP; ++i) {
                int word = i * 32 + lane;          // word index within the warp's span
                long long v = base + (word >> 2);  // its vector: loaded by lane (word >> 2) % 32 in unroll i / 4
                float scale = __shfl_sync(0xffffffffu, own_scale[i >> 2], ((i & 3) << 3) | (lane >> 2));
                decode_store_word<OutT, LUT, STREAM>(words[word], scale, lut,
                                                     out + base * 32 + (long long)word * 8, v < n_vec);
            }
            __syncwarp();
        }
    }

    // Scalar tail: the last numel % 32 elements (their codes are not a whole 16-byte vector).
    long long tail0 = n_vec << 5;
    if (blockIdx.x == gridDim.x - 1) {
        for (long long i = tail0 + tid; i < a.numel; i += kThreads) {
            u32 byte = a.codes[i >> 1];
            u32 code = (i & 1) ? (byte & 15u) : (byte >> 4);
            float scale = block_absmax<DQ>(a, i >> a.log2_blocksize, s_code2, offset);
            out[i] = OutTraits<OutT>::one(__fmul_rn(kNF4[code], scale));
        }
    }
}
