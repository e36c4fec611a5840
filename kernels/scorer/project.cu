// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

// ------------------------------------------------------------ projections

// One sequence's inputs and outputs of the projection.
struct ProjSeq {
    const float* hidden;  // [FM_SCORERS][hidden]
    u16* q;               // [FM_QROWS][FM_HEAD_DIM] bf16
    float* w;             // [FM_QROWS]
};

#define FM_MAX_BATCH 64
#define FM_PROJ_ROWS 16    // warps per b8 block (each owning FM_PROJ_RPW8 weight rows)
// Warps per b1 block (one weight row each). Small blocks: the SMs run out of
// rows together, so fewer idle while the last blocks finish and the scoring
// kernel's blocks (a whole SM each) land sooner. H200, bf16 weights, 262,144
// chunks, full: 16 warps 85.3 us, 8 84.6, 4 84.2, 2 84.1 (NOTES s30).
#define FM_PROJ_ROWS1 4
static_assert(FM_PROJ_ROWS1 <= FM_PROJ_ROWS, "b1 keeps the launch bound of FM_PROJ_ROWS warps");
// Weight bytes each lane of the b1 form loads before it sums them (see
// project()): steps of 8 weights, FM_B1_BYTES / (8 x the weight size) of
// them, rounded down: two steps of 16-bit weights (two 16-byte loads), one
// of f32 ones (two 16-byte loads). At least 32, since the f32 form is always
// built. The host does not depend on it: a tuning knob for KVSWAP_FM_DEFINES
// (H200: 48, three steps of bf16, measured slower than 32; NOTES s31).
#ifndef FM_B1_BYTES
#define FM_B1_BYTES 32
#endif

struct ProjBatch {
    u32 n;
    ProjSeq seq[FM_MAX_BATCH];
    u16 id[FM_MAX_BATCH];  // each sequence's index in the caller's batch (error records)
};

// Weights are read once per call: 16-byte loads that do not allocate in L1,
// which keeps L1 for the hidden slice every warp of the block re-reads (H200,
// bf16 weights, 262,144 chunks, full scope: 85.9 -> 85.0 us with bf16 keys,
// 86.1 -> 83.8 with fp8 keys; NOTES s30).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Eight weights of a row as their raw 16-byte parts (two for f32, one for the
// 16-bit types), then converted to f32 by unpack8: the single-sequence form
// issues the loads of several steps of its row before converting any (see
// project()).
template <typename T> struct Raw8 {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "weights are f32, bf16 or f16");
    uint4 v[sizeof(T) / 2];
};
template <typename T> __device__ __forceinline__ Raw8<T> ld_raw8(const T* p) {
    Raw8<T> r;
#pragma unroll
    for (u32 i = 0; i < sizeof(T) / 2; ++i) r.v[i] = ld_stream16((const u8*)p + 16 * i);
    return r;
}
template <typename T> __device__ __forceinline__ void unpack8(const Raw8<T>& r, float* out);
template <> __device__ __forceinline__ void unpack8<float>(const Raw8<float>& r, float* out) {
    const u32 w[8] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w, r.v[1].x, r.v[1].y, r.v[1].z, r.v[1].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __uint_as_float(w[i]);
}
template <> __device__ __forceinline__ void unpack8<u16>(const Raw8<u16>& r, float* out) {  // bf16
    const u32 w[4] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
struct F16 { u16 v; };
template <> __device__ __forceinline__ void unpack8<F16>(const Raw8<F16>& r, float* out) {
    const u32 w[4] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned short lo = (unsigned short)(w[i] & 0xffff), hi = (unsigned short)(w[i] >> 16);
        float a, b;
        asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
        asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
        out[2 * i] = a;
        out[2 * i + 1] = b;
    }
}
template <typename T> __device__ __forceinline__ void load8(const T* p, float* out) { unpack8<T>(ld_raw8(p), out); }

// w[0..8) . (x0, x1), in a fixed order (batch and single calls agree bit for bit).
__device__ __forceinline__ float dot8(const float* w, float4 x0, float4 x1) {
    float s = w[0] * x0.x;
    s = fmaf(w[1], x0.y, s);
    s = fmaf(w[2], x0.z, s);
    s = fmaf(w[3], x0.w, s);
    s = fmaf(w[4], x1.x, s);
    s = fmaf(w[5], x1.y, s);
    s = fmaf(w[6], x1.z, s);
    return fmaf(w[7], x1.w, s);
}

// Where element k (of a staged pass of the hidden state, KT a multiple of
// 256) is kept in shared memory: within each 256 elements, the first four
// of every lane's eight (k = 8 l + 4 h + i) are packed before the last four,
// so a warp's 16-byte reads hit 32 different banks.
__device__ __forceinline__ u32 hidden_slot(u32 k) {
    const u32 l = (k >> 3) & 31u, h = (k >> 2) & 1u, i = k & 3u;
    return (k & ~255u) + 128u * h + 4u * l + i;
}

// out[b][row] = W[row] . hidden_b for every row of every scorer and every
// sequence b of the batch: each warp owns RPW weight rows and reads them once
// for a group of up to MAXB sequences. Lane l always sums elements l*8 + 256 j
// in increasing j, whatever MAXB, KT (a multiple of 256) and RPW, so a batch
// computes bit-identical projections to single calls. Rows
// [0, FM_HEADS*FM_HEAD_DIM) of scorer i are Wq (output q, bf16), the next
// FM_HEADS rows are Ww (output w, f32). weights: [FM_SCORERS][rows][hidden];
// hidden % 8 == 0 and each hidden state 16-byte aligned (checked on the host).
//
// MAXB == 1 (one sequence): the hidden slice (<= 16 KB) stays in L1; no
// staging, no barrier, every warp streams its row at once.
// MAXB > 1: the batch's sequences form groups of MAXB; block x works on group
// x % G (G groups) and row block x / G: the G blocks that read a row block's
// weights are adjacent in launch order and run together, so L2 can serve one
// group's weight reads to the others. Measured on the H200 (bf16 weights,
// B = 64, session 28), with the 4-byte staging that preceded the 16-byte one
// below: 206 MB read from DRAM for 203 MB of weights, L2 hit rate 83% (ncu);
// with one hidden state for all sequences, 17.8 us per sequence against 19.7
// with a launch per group and 34.0 with one group of 64. The group's hidden
// slices are staged in shared memory KT elements at a time, 16-byte loads
// and stores (at B = 8, 4-byte ones measured 1.36x slower, and cp.async
// copies into two buffers, the next pass loading while this one is summed,
// 1.6x slower than the 4-byte ones).
template <typename T, u32 MAXB, u32 KT, u32 RPW>
__device__ void project(const T* __restrict__ weights, u32 hidden, const ProjBatch& B, u32* err) {
    extern __shared__ float sh_h[];  // [MAXB][KT] (MAXB > 1)
    constexpr u32 QR = FM_HEADS * FM_HEAD_DIM, ROWS = QR + FM_HEADS;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 scorer = blockIdx.y;
    const u32 groups = MAXB == 1 ? 1u : (B.n + MAXB - 1) / MAXB;
    const u32 group = blockIdx.x % groups, rblock = blockIdx.x / groups;
    const u32 base = group * MAXB, nb = min(MAXB, B.n - base);
    // Warp w of row block x owns rows (x * WARPS + w) * RPW + r, r < RPW
    // (RPW > 1: each staged hidden value read from shared memory serves
    // RPW rows).
    constexpr u32 WARPS = MAXB == 1 ? FM_PROJ_ROWS1 : FM_PROJ_ROWS;
    const u32 row0 = (rblock * WARPS + warp) * RPW;
    const bool active = row0 < ROWS;
    const T* wrow = weights + ((u64)scorer * ROWS + (active ? row0 : 0)) * hidden;  // the single-sequence form's
    const T* wrows[RPW];
#pragma unroll
    for (u32 r = 0; r < RPW; ++r) wrows[r] = weights + ((u64)scorer * ROWS + (row0 + r < ROWS ? row0 + r : 0)) * hidden;
    // The scoring kernel (a programmatic dependent) launches once every block
    // of this grid has started, i.e. during its last wave, and prefetches its
    // first key tiles; it waits for this grid to complete before reading q, w.
    allow_dependents();
    float acc[RPW][MAXB];
#pragma unroll
    for (u32 r = 0; r < RPW; ++r)
#pragma unroll
        for (u32 b = 0; b < MAXB; ++b) acc[r][b] = 0.f;
    if constexpr (MAXB == 1) {
        const float* h0 = B.seq[base].hidden + (u64)scorer * hidden;
        if (rblock == 0 && warp == 0) {
            for (u32 k = lane; k < hidden; k += 32)
                if (!isfinite(h0[k])) record_error3(err, FM_ERR_HIDDEN, scorer, k, B.id[base]);
        }
        // Each lane issues the loads of its next NB steps (k, k + 256, ..)
        // before summing them, in the same order as the batched form:
        // bit-identical to it and to one step at a time. H200, bf16 weights,
        // 262,144 chunks, full scope, us (three rounds, NOTES s31): one step
        // at a time 84.2 / 84.1 / 84.2, two 82.3 / 82.6 / 82.0, four 88.4 /
        // 88.1 / 88.6 (40 registers instead of 32: 12 blocks of 4 warps per
        // SM instead of 16), eight 93.3 / 93.0 / 93.3. f32 weights load 32
        // bytes per step, so they keep one step at a time, unrolled by four
        // as before (32 registers; two steps would take 40).
        if (active) {
            constexpr u32 NB = FM_B1_BYTES / sizeof(Raw8<T>);
            static_assert(NB >= 1, "FM_B1_BYTES holds at least one step");
#pragma unroll (NB == 1 ? 4 : 1)
            for (u32 k0 = lane * 8; k0 < hidden; k0 += 256 * NB) {
                Raw8<T> raw[NB];
#pragma unroll
                for (u32 i = 0; i < NB; ++i) raw[i] = k0 + 256 * i < hidden ? ld_raw8(wrow + k0 + 256 * i) : Raw8<T>{};
#pragma unroll
                for (u32 i = 0; i < NB; ++i) {
                    const u32 k = k0 + 256 * i;
                    if (k < hidden) {
                        float wv[8];
                        unpack8<T>(raw[i], wv);
                        acc[0][0] += dot8(wv, __ldg((const float4*)(h0 + k)), __ldg((const float4*)(h0 + k + 4)));
                    }
                }
            }
        }
    } else {
        for (u32 k0 = 0; k0 < hidden; k0 += KT) {
            const u32 kt = min(KT, hidden - k0);
            __syncthreads();  // every warp is done with the previous pass
            // 16 bytes per copy: four elements, contiguous in hidden_slot's
            // layout (kt % 8 == 0 and the hidden states 16-byte aligned).
            for (u32 t = threadIdx.x; t < nb * (kt / 4); t += blockDim.x) {
                const u32 b = t / (kt / 4), k = 4 * (t % (kt / 4));
                *(float4*)(sh_h + b * KT + hidden_slot(k)) = *(const float4*)(B.seq[base + b].hidden + (u64)scorer * hidden + k0 + k);
            }
            __syncthreads();
            // One block per group and scorer checks the staged values (a
            // separate pass: checking in the staging loop measured 4% slower).
            if (rblock == 0) {
                for (u32 t = threadIdx.x; t < nb * kt; t += blockDim.x) {
                    const u32 b = t / kt, k = t % kt;
                    if (!isfinite(sh_h[b * KT + hidden_slot(k)])) record_error3(err, FM_ERR_HIDDEN, scorer, k0 + k, B.id[base + b]);
                }
            }
            if (!active) continue;
#pragma unroll 4
            for (u32 k = lane * 8; k < kt; k += 256) {
                float wv[RPW][8];
#pragma unroll
                for (u32 r = 0; r < RPW; ++r) load8<T>(wrows[r] + k0 + k, wv[r]);
                // Lane l's elements k..k+3 and k+4..k+7 (k = 256 j + 8 l) lie at
                // 256 j + 4 l and 256 j + 128 + 4 l: each 16-byte read of a
                // warp covers 512 contiguous bytes (no bank conflict).
                const u32 at = (k & ~255u) + 4 * lane;
#pragma unroll
                for (u32 b = 0; b < MAXB; ++b) {
                    if (b < nb) {
                        const float* h = sh_h + b * KT + at;
                        const float4 x0 = *(const float4*)h, x1 = *(const float4*)(h + 128);
#pragma unroll
                        for (u32 r = 0; r < RPW; ++r) acc[r][b] += dot8(wv[r], x0, x1);
                    }
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (u32 r = 0; r < RPW; ++r) {
        const u32 rr = row0 + r;
        if (rr >= ROWS) break;
#pragma unroll
        for (u32 b = 0; b < MAXB; ++b) {
            if (b >= nb) break;
            float s = acc[r][b];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(KVS_FULL_MASK, s, off);
            if (lane == 0) {
                const ProjSeq& o = B.seq[base + b];
                if (rr < QR) o.q[(u64)scorer * QR + rr] = f32_to_bf16(s);
                else o.w[scorer * FM_HEADS + (rr - QR)] = s;
            }
        }
    }
}

// Instantiations: weight dtype x group width (1: one sequence, hidden read
// through L1, no shared memory; FM_PROJ_GROUP: groups of a batch, staged
// passes of 1024 elements, two rows per warp, two blocks per SM).
// BOUNDS: the launch bounds' arguments (b1's without a minimum block count:
// naming one, even 1, changes its register schedule; b1 keeps the 512-thread
// bound of that schedule, 32 registers, and is launched with FM_PROJ_ROWS1
// warps).
#define FM_PROJECT(NAME, T, MAXB, KT, RPW, BOUNDS)                                               \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                           \
    NAME(const T* W, u32 hidden, ProjBatch B, u32* err) { project<T, MAXB, KT, RPW>(W, hidden, B, err); }
// Sequences per group, staged elements per pass and rows per warp of the
// batched form (the host sizes its grid and shared memory by them:
// PROJECT_GROUP, PROJECT_KT and PROJECT_RPW in src/backend/cuda/scorer.rs; no
// #ifndef, so a -D cannot make them differ). Shared memory: 8 x 1024 x 4
// bytes (32 KiB); two blocks per SM (the launch bounds hold the registers to
// 64 per thread).
#define FM_PROJ_GROUP 8
#define FM_PROJ_KT 1024
#define FM_PROJ_RPW8 2
FM_PROJECT(fm_project_f32_b1, float, 1, 256, 1, (FM_PROJ_ROWS * 32))
FM_PROJECT(fm_project_f32_b8, float, FM_PROJ_GROUP, FM_PROJ_KT, FM_PROJ_RPW8, (FM_PROJ_ROWS * 32, 2))
FM_PROJECT(fm_project_bf16_b1, u16, 1, 256, 1, (FM_PROJ_ROWS * 32))
FM_PROJECT(fm_project_bf16_b8, u16, FM_PROJ_GROUP, FM_PROJ_KT, FM_PROJ_RPW8, (FM_PROJ_ROWS * 32, 2))
FM_PROJECT(fm_project_f16_b1, F16, 1, 256, 1, (FM_PROJ_ROWS * 32))
FM_PROJECT(fm_project_f16_b8, F16, FM_PROJ_GROUP, FM_PROJ_KT, FM_PROJ_RPW8, (FM_PROJ_ROWS * 32, 2))

// The fp8 query in place, for the kernels that score fp8 keys with a 16-bit
// q (every shape and device without fm_score_wg_fp8q): each head row of the
// bf16 q of sequence blockIdx.y (q + blockIdx.y * FM_QROWS * FM_HEAD_DIM)
// becomes e4m3(q * 2^-e) * 2^e as reference::fp8_query defines it, written
// back in bf16 (exact: a 4-bit significand, unless the value falls below
// bf16's subnormals, max |q| under about 2^-116). One warp per row; the
// rounding is done in f32 arithmetic (no fp8 instructions before sm_89),
// to nearest even like cvt.rn: |x| in [2^k, 2^(k+1)) steps by 2^(k-3), and
// below 2^-6 by 2^-9. A row with a non-finite value is left as it is (the
// scores are then non-finite: an error).
// e of reference::fp8_query_exponent for a head whose largest |q| has the
// bf16 bits `amax` (0 for 0): with amax = m' * 2^x, m' in [0.5, 1), and 448 =
// 0.875 * 2^9, x - 9 when m' <= 0.875, else x - 8. In integers, branch-free:
// amax = M * 2^(Ee - 134) with M = 128 + mantissa and Ee = E for a normal
// value, M = mantissa and Ee = 1 for a subnormal one; with M in [2^p,
// 2^(p+1)), x = p + Ee - 133 and m' <= 0.875 is 4M <= 7 * 2^p (every finite
// amax checked against the reference's frexp in NOTES s33). Bits of a
// non-finite value give an e below 122.
__device__ __forceinline__ int fp8q_exponent(u32 amax) {
    const u32 E = amax >> 7;
    const u32 M = E != 0 ? (0x80u | (amax & 0x7fu)) : max(amax, 1u);
    const int p = 31 - __clz(M);
    const int x = p + max((int)E, 1) - 133;
    const int e = (M << 2) <= (7u << p) ? x - 9 : x - 8;
    return amax != 0 ? e : 0;
}
__device__ __forceinline__ float e4m3_round(float x) {
    const float a = fabsf(x);
    if (a == 0.f) return x;
    int k;
    frexpf(a, &k);  // a in [2^(k-1), 2^k)
    const int quantum = max(k - 4, -9);
    return copysignf(scalbnf(rintf(scalbnf(a, -quantum)), quantum), x);
}
extern "C" __global__ void __launch_bounds__(256) fm_fp8_query(u16* q) {
    wait_prerequisites();
    const u32 lane = threadIdx.x & 31u, row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row < FM_QROWS) {
        u16* p = q + ((u64)blockIdx.y * FM_QROWS + row) * FM_HEAD_DIM;
        constexpr u32 PER = FM_HEAD_DIM / 32;
        u16 v[PER];
        u32 amax = 0;
#pragma unroll
        for (u32 i = 0; i < PER; ++i) {
            v[i] = p[lane + 32 * i];
            amax = max(amax, (u32)v[i] & 0x7fffu);
        }
        amax = __reduce_max_sync(KVS_FULL_MASK, amax);
        if (amax < 0x7f80u && amax != 0) {
            const int e = fp8q_exponent(amax);
#pragma unroll
            for (u32 i = 0; i < PER; ++i) p[lane + 32 * i] = f32_to_bf16(scalbnf(e4m3_round(scalbnf(bf16_to_f32(v[i]), -e)), e));
        }
    }
    allow_dependents();
}
