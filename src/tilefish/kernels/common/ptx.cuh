// PTX wrappers shared by every kernel family. Each says why it exists.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace tf {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream serialization may
// start before the kernel ahead of it in the stream has finished: until grid_dependency_wait() returns it
// may only read memory nothing in flight writes (weights, and inputs written before the kernel ahead
// started); whatever the kernel ahead writes, and everything this one writes (the kernel ahead may still
// read it), comes after. Once it returns, the earlier grids have completed and their writes are visible
// in L2, but not always through the non-coherent path: read what grids that may have been in flight when
// this kernel started wrote (the kernel ahead's output, and what the kernels ahead of it wrote) through L2,
// with ld_cg_* below, cp.async.cg (cp_async16) or TMA; never with ld.global.nc (ld_nc_v4, nor a const
// __restrict__ load the compiler turns into LDG.CONSTANT). On an H200 time-sliced with other processes,
// rms_norm chains reading the kernel ahead's output with ld.global.nc got stale rows in every round, with
// ld.global.cg or .ca in none (scripts/experiments/pdl_chain_stress.py).
// Without that launch attribute, or below sm_90, both are no-ops.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next kernel in the stream (if launched with programmatic serialization) may be scheduled once every
// CTA of this one has called this or exited: its CTAs take SMs as these leave and start their own loads.
__device__ __forceinline__ void launch_dependent_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Ask L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) from global memory, one instruction for the
// whole span (sm_90+; nothing below): a reader that must wait for something else first gets its bytes in
// flight meanwhile.
__device__ __forceinline__ void l2_prefetch_span(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#endif
}

// 16-byte load through the read-only (non-coherent) path, one LDG.E.128.CONSTANT: for data nothing writes
// while the kernel can run (weights; inputs written before the kernel ahead started), since that path is
// not coherent with other grids' writes (grid_dependency_wait).
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Loads through L2 only (cache-global: never from L1): what a kernel launched with programmatic dependent
// launch reads of memory that grids in flight may have written (grid_dependency_wait says why). Volatile, so
// the compiler keeps them after the wait.
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_cg_u32(const void* p) {
    u32 r;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ long long ld_cg_i64(const void* p) {
    long long r;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ unsigned short ld_cg_u16(const void* p) {
    unsigned short r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// Same as ld_nc_v4, with the L2::256B prefetch-size hint: a streaming reader asks DRAM for whole 256 B
// spans, so fewer, larger requests keep the memory pipeline full.
__device__ __forceinline__ uint4 ld_nc_v4_l2_256(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16-byte store with the evict-first (streaming) hint: output that is written once and
// not re-read should not push reusable lines out of L2.
__device__ __forceinline__ void st_cs_v4(void* p, uint4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void st_v4(void* p, uint4 v) {
    *reinterpret_cast<uint4*>(p) = v;
}

// Bit-cast helpers (no conversions): pack two 16-bit values into one 32-bit register.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo = lower address
    return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

}  // namespace tf

namespace tf {

// ---- cp.async (sm_80+): global -> shared without a register round trip, so loads for later
// pipeline stages overlap the math on the current one.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16 bytes, bypassing L1 (.cg: every byte is used once per block). When `valid` is false the
// destination is zero-filled (src-size 0) and nothing is read: that is how rows past m are padded.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid = true) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// ---- ldmatrix: four 8x8 b16 matrices from shared memory, one row address per lane (lanes
// 8i..8i+7 give matrix i's rows); lane l receives row l/4, elements 2(l%4)..+1 of each matrix,
// which is exactly the mma.m16n8k16 A-fragment layout when the four matrices are
// (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem_row)));
}
// The same from a shared-window address (u32): kernels that keep their tile addresses as 32-bit
// offsets need no 64-bit generic pointer per fragment.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_row));
}

// Two 8x8 b16 matrices (lanes 0-7 and 8-15 give the row addresses; lanes 16-31 are ignored but
// must hold valid shared addresses): the B fragment of mma.m16n8k16 when the 8x8 matrices are
// (n 0-7, k 0-7) and (n 0-7, k 8-15) of a k-contiguous ("col") B.
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem_row)));
}

// ---- mma.sync m16n8k16, fp32 accumulate. Fragments (g = lane/4, t = lane%4):
//   A (16x16 row-major): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B (16x8, k-major):   b0 (k 2t..2t+1, n g), b1 (k 2t+8..2t+9, n g)
//   C (16x8):            c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // d = a b (zero accumulator in): starts a fresh partial sum without zeroing registers first.
    static __device__ __forceinline__ void run_c0(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // d = a b (zero accumulator in): starts a fresh partial sum without zeroing registers first.
    static __device__ __forceinline__ void run_c0(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
    }
};

// ---- lop3: one instruction for (a & b) | c, the heart of int4 -> fp16/bf16 conversion: OR-ing a
// nibble into the mantissa of a float whose exponent makes the mantissa's units equal to 1.
template <int LUT> __device__ __forceinline__ u32 lop3(u32 a, u32 b, u32 c) {
    u32 r;
    asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
    return r;
}
constexpr int kLopAndOr = (0xf0 & 0xcc) | 0xaa;  // (a & b) | c
constexpr int kLopSelect = (0xf0 & ~0xaa & 0xff) | (0xcc & 0xaa);  // c ? b : a, bit by bit

// ---- prmt (default mode): byte n of the result is byte s_n & 7 of {b, a} (a = bytes 0-3), or,
// when bit 3 of selector nibble s_n is set, that byte's sign bit replicated into all 8 bits. Only
// the low 16 bits of s are read. A byte-wide table lookup: 8 one-byte entries in a and b, four
// 3-bit indices in s, four lookups an instruction. Not volatile: a pure function the compiler may
// schedule freely.
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// ---- acquire/release on global counters (cross-block reductions).
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_relaxed(int* p, int v) {
    asm volatile("st.relaxed.gpu.global.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}

}  // namespace tf

namespace tf {

// ---- ldmatrix .trans: the same 8x8 b16 matrices, transposed on the way into registers. Why:
// a B operand stored k-major in shared memory (row-major B [K, N]: a "row" is one k, 8 n
// contiguous) is the transpose of what mma's "col" B fragment wants (b0 = k 2t..2t+1 at n g).
// With .trans, lane l receives elements (row 2(l%4), 2(l%4)+1; col l/4) of each matrix, so
// matrices (k 0-7, n 0-7) and (k 8-15, n 0-7), addressed by lanes 0-7 and 8-15 (one k row each),
// arrive as exactly b0, b1 of mma.m16n8k16 -- no register shuffles, no transposed copy of B.
__device__ __forceinline__ void ldmatrix_x2_trans(u32 (&r)[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(smem_row)));
}
// Four transposed matrices: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
// give b0, b1 of two adjacent n8 tiles in one instruction (half the ldmatrix issues of x2).
// stmatrix (sm_90): the inverse of ldmatrix. Four 8x8 b16 matrices, r[i] = (row lane/4, cols
// 2 (lane%4) .. +1) of matrix i; lane 8i + j gives the address of row j of matrix i. .trans stores
// each matrix transposed (row j of smem gets column j of the fragment).
__device__ __forceinline__ void stmatrix_x4(void* smem_row, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(smem_addr(smem_row)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(void* smem_row, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(smem_addr(smem_row)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_row));
}

}  // namespace tf
