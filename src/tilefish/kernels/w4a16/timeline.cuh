// Per-CTA %globaltimer stamps for scripts/experiments/timeline_w4a16_*.py, which build a kernel with
// -D TF_TIMELINE. In every other build these macros are empty statements and their arguments are
// never evaluated, so production code carries no trace of them.
//   TF_TIMELINE_AT(base)   this CTA's stamp array (long long*), once, before any stamp
//   TF_STAMP_IF(cond, i)   stamp the time into entry i where cond holds
//   TF_SMID_IF(cond, i)    store the SM id into entry i where cond holds
#pragma once

#ifdef TF_TIMELINE
namespace tf {
__device__ __forceinline__ void timeline_stamp(long long* p) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *p = t;
}
__device__ __forceinline__ void timeline_smid(long long* p) {
    int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    *p = sm;
}
}  // namespace tf
#define TF_TIMELINE_AT(base) long long* const tf_timeline_ = (base)
#define TF_STAMP_IF(cond, i) do { if (cond) ::tf::timeline_stamp(tf_timeline_ + (i)); } while (0)
#define TF_SMID_IF(cond, i) do { if (cond) ::tf::timeline_smid(tf_timeline_ + (i)); } while (0)
#else
#define TF_TIMELINE_AT(base) static_cast<void>(0)
#define TF_STAMP_IF(cond, i) static_cast<void>(0)
#define TF_SMID_IF(cond, i) static_cast<void>(0)
#endif
