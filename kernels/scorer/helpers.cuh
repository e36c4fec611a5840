// FlashMemory scorer kernels: projections, chunk scoring on the tensor cores,
// ensemble, and an exact global top-k (score descending, ties to the lower id).
//
// Compiled by NVRTC per scorer shape: FM_SCORERS, FM_HEADS and FM_HEAD_DIM are
// given with -D, so every loop bound is a compile-time constant. The source is
// kernels/common.cuh, then this directory's files in dependency order (as
// src/kernels.rs concatenates them):
//
//   helpers.cuh         shape and dtype constants, conversions, histogram helpers
//   project.cu          fm_project_*
//   score_mma.cu        fm_score (mma.sync, any sm_80+), the ScoreBatch layout
//   score_wgmma.cu      fm_score_wg_bf16 (Hopper wgmma, bf16 keys) and
//                       fm_score_wg (f32 keys, fp8 by conversion), the wgmma
//                       and pipeline helpers
//   score_wgmma_fp8.cu  fm_score_wg_fp8 (Hopper wgmma, fp8 keys as f16 registers)
//   bounds.cu           fm_bounds_score
//   topk.cu             fm_select, fm_order
//
//   fm_project_*   q = Wq h, w = Ww h for every scorer (and every sequence of a
//                  batch, 8 per block); q is written in bf16 for the MMA.
//   fm_score_*     per chunk: s_i = sum_h w[i,h] * relu(scale * (q[i,h] . key)),
//                  ensemble (max or mean) -> a sortable 32-bit key per chunk,
//                  and a histogram of the keys' top FM_HIST_BITS bits.
//   fm_bounds_score  the training-free (Quest-style) scorer, same outputs.
//   fm_select      one pass over the keys: candidates above (certain) and in
//                  (ties) the threshold bin of the 12-bit histogram, appended
//                  to two lists; block 0 publishes how many of each.
//   fm_order       ranks the candidates by counting over many blocks and
//                  writes each winner's id at its rank in descending 64-bit
//                  key order (score key << 32 | ~id), -1 padded; leaves the
//                  histogram and counters zeroed for the next call (no memset
//                  on replay).


#ifndef FM_SCORERS
#define FM_SCORERS 3
#endif
#ifndef FM_HEADS
#define FM_HEADS 64
#endif
#ifndef FM_HEAD_DIM
#define FM_HEAD_DIM 128
#endif

#define FM_QROWS (FM_SCORERS * FM_HEADS)
#define FM_HIST_BITS 12
#define FM_HIST (1u << FM_HIST_BITS)

// Key dtypes (FM_KEYS_* in the C header).
#define FM_KEYS_F32 0u
#define FM_KEYS_BF16 1u
#define FM_KEYS_FP8_E4M3 2u

// Error codes recorded on the device (first error wins).
#define FM_ERR_HIDDEN 1u    // non-finite hidden state: info = scorer, position, sequence
#define FM_ERR_SCORE 2u     // non-finite score (non-finite key, or overflow): info = chunk, sequence
#define FM_ERR_BOUNDS 3u    // bounds of a chunk with min > max or non-finite: info = chunk

// ------------------------------------------------------------------ helpers

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

// fp8 e4m3 (OCP): bias 7, no infinities, S.1111.111 is NaN. Exact in bf16.
__device__ __forceinline__ u16 fp8_to_bf16(u8 v) {
    const u32 s = (v >> 7) & 1u, e = (v >> 3) & 0xfu, m = v & 7u;
    if (e == 0xfu && m == 7u) return (u16)((s << 15) | 0x7fc0u);  // NaN
    if (e == 0) {
        if (m == 0) return (u16)(s << 15);
        // subnormal: m * 2^-9 = 1.f * 2^(p - 9) with p the top set bit of m
        u32 p = 31 - __clz(m);
        u32 frac = (m << (3 - p)) & 7u;  // bits below the leading one, as 3 bits
        u32 be = p - 9 + 127;
        return (u16)((s << 15) | (be << 7) | (frac << 4));
    }
    return (u16)((s << 15) | ((e - 7 + 127) << 7) | (m << 4));
}

// Two fp8 e4m3 (low byte first) -> two bf16 (low half first), exactly: e4m3
// values are representable in f16 and in bf16. Hardware conversion on Ada and
// Hopper; the bit-level decode elsewhere.
__device__ __forceinline__ u32 fp8x2_to_bf16x2(u32 two) {
#if __CUDA_ARCH__ >= 890
    u32 h2;
    const unsigned short in = (unsigned short)two;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
#else
    return (u32)fp8_to_bf16(two & 0xff) | ((u32)fp8_to_bf16((two >> 8) & 0xff) << 16);
#endif
}

// Eight f32 at p (16-byte aligned) rounded to eight bf16 (16 bytes).
__device__ __forceinline__ uint4 f32x8_to_bf16x8(const float* p) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    return make_uint4((u32)f32_to_bf16(a.x) | ((u32)f32_to_bf16(a.y) << 16),
                      (u32)f32_to_bf16(a.z) | ((u32)f32_to_bf16(a.w) << 16),
                      (u32)f32_to_bf16(b.x) | ((u32)f32_to_bf16(b.y) << 16),
                      (u32)f32_to_bf16(b.z) | ((u32)f32_to_bf16(b.w) << 16));
}

// A chunk scale the fp8 fast paths take out of the head sums: positive and
// finite (relu(scale * x) = scale * relu(x), so the scale multiplies each
// scorer's sum once).
__device__ __forceinline__ bool positive_finite(float scale) { return scale > 0.f && scale <= 3.40282347e38f; }
// The factors (before the relu, after a scorer's head sum) a chunk scale
// splits into for accumulators normalised by a power of two (the fp8
// wgmma kernels: |q . key| far from the float range's ends): (sign,
// |scale|) for a finite nonzero scale, as relu(scale * x) = |scale| *
// relu(sign * x), so that a head's scale * dot product, which can lie
// above the float range where the weighted score does not, is never
// formed; else (scale, 1): zero, and non-finite scales (an error).
__device__ __forceinline__ float2 scale_split(float scale) {
    const bool finite_nonzero = scale != 0.f && fabsf(scale) <= 3.40282347e38f;
    return finite_nonzero ? make_float2(copysignf(1.f, scale), fabsf(scale)) : make_float2(scale, 1.f);
}
// The same for raw accumulators (fm_score, fm_score_wg's converted keys:
// q . key as it is, any size): a scale above 1 in magnitude goes after the
// head sum as scale_split's magnitude, any other before the relu, so that
// the scale never takes an intermediate past the float range where the
// score is in it (a sum before a scale below 1 could be): (sign * min(|s|,
// 1), max(|s|, 1)). Callers check the scale finite themselves (NaN gives
// (1, 1) here).
__device__ __forceinline__ float2 scale_split_raw(float scale) {
    const float a = fabsf(scale);
    return make_float2(copysignf(fminf(a, 1.f), scale), fmaxf(a, 1.f));
}

// si * scale * 2^E for a positive finite scale and E within +-300 (the
// off-path rescaling of the fp8 wgmma kernels): with scale = m * 2^k (m in
// [0.5, 1), exact, from the float's bits; a subnormal scale normalised by
// 2^24 first), scalbn(si * m, k + E). Neither scale * 2^E nor si * scale is
// formed: either can leave the float range (or lose bits below it) where
// the result does not. Rounded once where si * m and the result are normal
// floats; below that, within the subnormal step of each. (frexpf does the
// same split and spilled fm_score_wg_fp8q's 4-scorer build, s34; the exact
// double product spilled fm_score_wg_fp8's, s35.)
__device__ __forceinline__ float scaled_sum(float si, float scale, int E) {
    const bool sub = scale < 1.17549435e-38f;
    const u32 b = __float_as_uint(sub ? scale * 16777216.f : scale);
    const int k = (int)((b >> 23) & 0xffu) - 126 - (sub ? 24 : 0);
    const float m = __uint_as_float((b & 0x807fffffu) | (126u << 23));
    return scalbnf(si * m, k + E);
}

// Monotone map of a float to u32: a < b  <=>  key(a) < key(b) (NaN excluded).
// -0 maps to +0's key: the two zeros are equal scores, which rank by chunk
// id (the reference's order, src/scorer/topk.rs), not by sign.
__device__ __forceinline__ u32 sort_key(float f) {
    const u32 b = __float_as_uint(f), x = b == 0x80000000u ? 0u : b;
    return (x & 0x80000000u) ? ~x : (x | 0x80000000u);
}

// hist[bin] += 1 for every lane with `valid`, one shared-memory atomic per
// distinct bin in the warp: scores often share a few bins, and same-address
// atomics serialise. Every lane of the warp must call it.
__device__ __forceinline__ void hist_add(u32* hist, u32 bin, bool valid) {
    const u32 key = valid ? bin : 0xFFFFFFFFu;
    const u32 peers = __match_any_sync(KVS_FULL_MASK, key);
    if (valid && (threadIdx.x & 31u) == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], (u32)__popc(peers));
}

// The global histogram of a sequence: FM_HIST fine bins (top FM_HIST_BITS
// bits of the score key), then FM_COARSE coarse bins (the top
// FM_COARSE_BITS bits) so the selection finds its threshold reading 128
// words instead of 4096.
#define FM_COARSE_BITS 6
#define FM_COARSE (1u << FM_COARSE_BITS)
#define FM_HIST_WORDS (FM_HIST + FM_COARSE)
#define FM_FINE_PER_COARSE (FM_HIST / FM_COARSE)
static_assert(FM_COARSE == 64 && FM_FINE_PER_COARSE == 64, "threshold_bin reads 64 + 64 bins");

// Adds a block's shared histogram (16-byte aligned) into the global one, fine
// and coarse bins in one pass: each warp reads 128 consecutive fine bins (one
// 16-byte load per lane), adds the non-zero ones, and sums each half warp's
// 64 bins (one coarse bin) with four shuffles. Call after a barrier; every
// thread of the block (whole warps).
__device__ __forceinline__ void flush_hist(const u32* sh_hist, u32* hist) {
    static_assert(FM_FINE_PER_COARSE == 64 && FM_HIST % 128 == 0, "a half warp's 16 x 4 bins are one coarse bin");
    const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    for (u32 i = (threadIdx.x >> 5) * 128 + lane * 4; i < FM_HIST; i += warps * 128) {
        const uint4 v = *(const uint4*)(sh_hist + i);
        if (v.x) atomicAdd(&hist[i], v.x);
        if (v.y) atomicAdd(&hist[i + 1], v.y);
        if (v.z) atomicAdd(&hist[i + 2], v.z);
        if (v.w) atomicAdd(&hist[i + 3], v.w);
        u32 c = (v.x + v.y) + (v.z + v.w);
#pragma unroll
        for (u32 off = 8; off > 0; off >>= 1) c += __shfl_xor_sync(KVS_FULL_MASK, c, off);
        if ((lane & 15u) == 0 && c) atomicAdd(&hist[FM_HIST + i / FM_FINE_PER_COARSE], c);
    }
}

// Development timeline of one call across its kernels (KVSWAP_FM_DEFINES=
// -DFM_CTRACE, alone: FM_TRACE's per-phase atomics delay the scoring
// kernel's end; the default build has none of it): %globaltimer stamps taken by
// thread 0 of every block, the earliest or latest of each kind kept in fm_ct;
// the last fm_order block to leave prints them for every 97th call (ns from
// the first scoring block's start) and resets them. CT_EXIT stamps when the
// block leaves by any return.
#ifdef FM_CTRACE
// Slots: 0 score entry min, 1 max; 2 score loop start max; 3 score exit
// max; 4 select past its wait min; 5 select exit max; 6 order past its wait
// min; 7 order exit max; 8 score exit min; 9 score loop end max (thread 0:
// warpgroup 0's loop); 10 select past its wait max; 11 select threshold
// found max; 12 select filed max; 13 order past its wait max; 14 order
// candidates loaded max; 15 select exit min. (globaltimer ticks are 256 ns
// apart on the H200.)
#define CT_SLOTS 16
#define CT_IS_MIN(i) ((i) == 0 || (i) == 4 || (i) == 6 || (i) == 8 || (i) == 15)
__device__ unsigned long long fm_ct[CT_SLOTS] = {~0ull, 0, 0, 0, ~0ull, 0, ~0ull, 0, ~0ull, 0, 0, 0, 0, 0, 0, ~0ull};
__device__ u32 fm_ct_done, fm_ct_calls;
__device__ __forceinline__ unsigned long long ct_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define CT_MIN(i) \
    if (threadIdx.x == 0) atomicMin(&fm_ct[i], ct_now())
#define CT_MAX(i) \
    if (threadIdx.x == 0) atomicMax(&fm_ct[i], ct_now())
struct CtExit {
    u32 at;
    __device__ ~CtExit() {
        if (CT_IS_MIN(at)) {
            CT_MIN(at);
        } else {
            CT_MAX(at);
        }
    }
};
#define CT_EXIT(i) CtExit ct_exit_##i{i}
#else
#define CT_MIN(i)
#define CT_MAX(i)
#define CT_EXIT(i)
#endif
