// FlashMemory scorer kernels: projections, chunk scoring on the tensor cores,
// ensemble, and an exact global top-k (score descending, ties to the lower id).
//
// Compiled by NVRTC per scorer shape: FM_SCORERS, FM_HEADS and FM_HEAD_DIM are
// given with -D, so every loop bound below is a compile-time constant.
//
//   fm_project_*   q = Wq h, w = Ww h for every scorer (and every sequence of a
//                  batch), weights read once; q is written in bf16 for the MMA.
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
#define FM_ERR_HIDDEN 1u    // non-finite hidden state: info = scorer, position
#define FM_ERR_SCORE 2u     // non-finite score (non-finite key, or overflow): info = chunk
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

// Monotone map of a float to u32: a < b  <=>  key(a) < key(b) (NaN excluded).
__device__ __forceinline__ u32 sort_key(float f) {
    const u32 x = __float_as_uint(f);
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

// Adds a block's shared histogram into the global one (fine and coarse
// bins). Call after a barrier; every thread of the block.
__device__ __forceinline__ void flush_hist(const u32* sh_hist, u32* hist) {
    for (u32 i = threadIdx.x; i < FM_HIST; i += blockDim.x)
        if (sh_hist[i]) atomicAdd(&hist[i], sh_hist[i]);
    const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    for (u32 c = threadIdx.x >> 5; c < FM_COARSE; c += warps) {
        u32 v = 0;
        for (u32 b = lane; b < FM_FINE_PER_COARSE; b += 32) v += sh_hist[c * FM_FINE_PER_COARSE + b];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(KVS_FULL_MASK, v, off);
        if (lane == 0 && v) atomicAdd(&hist[FM_HIST + c], v);
    }
}

// ------------------------------------------------------------ projections

// One sequence's inputs and outputs of the projection.
struct ProjSeq {
    const float* hidden;  // [FM_SCORERS][hidden]
    u16* q;               // [FM_QROWS][FM_HEAD_DIM] bf16
    float* w;             // [FM_QROWS]
};

#define FM_MAX_BATCH 64
#define FM_PROJ_ROWS 16    // weight rows per block (one per warp)

struct ProjBatch {
    u32 n;
    ProjSeq seq[FM_MAX_BATCH];
};

template <typename T> __device__ __forceinline__ void load8(const T* p, float* out);
template <> __device__ __forceinline__ void load8<float>(const float* p, float* out) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
template <> __device__ __forceinline__ void load8<u16>(const u16* p, float* out) {  // bf16
    const uint4 v = *(const uint4*)p;
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
struct F16 { u16 v; };
template <> __device__ __forceinline__ void load8<F16>(const F16* p, float* out) {
    const uint4 v = *(const uint4*)p;
    const u32 w[4] = {v.x, v.y, v.z, v.w};
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

// out[b][row] = W[row] . hidden_b for every row of every scorer and every
// sequence b of the batch (up to MAXB): each warp owns one weight row and reads
// it once for all sequences; the sequences' hidden slices are staged in
// (dynamic) shared memory KT elements at a time. Lane l always sums elements
// l*8 + 256 j in increasing j, whatever MAXB and KT (a multiple of 256), so a
// batch computes bit-identical projections to single calls. Rows
// [0, FM_HEADS*FM_HEAD_DIM) of scorer i are Wq (output q, bf16), the next
// FM_HEADS rows are Ww (output w, f32). weights: [FM_SCORERS][rows][hidden];
// hidden % 8 == 0 (checked on the host).
template <typename T, u32 MAXB, u32 KT>
__device__ void project(const T* __restrict__ weights, u32 hidden, const ProjBatch& B, u32* err) {
    extern __shared__ float sh_h[];  // [MAXB][KT]
    constexpr u32 QR = FM_HEADS * FM_HEAD_DIM, ROWS = QR + FM_HEADS;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 scorer = blockIdx.y;
    const u32 row = blockIdx.x * FM_PROJ_ROWS + warp;
    const bool active = row < ROWS;
    const T* wrow = weights + ((u64)scorer * ROWS + (active ? row : 0)) * hidden;
    // The scoring kernel (a programmatic dependent) launches once every block
    // of this grid has started, i.e. during its last wave, and prefetches its
    // first key tiles; it waits for this grid to complete before reading q, w.
    allow_dependents();
    float acc[MAXB];
#pragma unroll
    for (u32 b = 0; b < MAXB; ++b) acc[b] = 0.f;
    if constexpr (MAXB == 1) {
        // One sequence: the hidden slice (<= 16 KB) stays in L1; no staging,
        // no barrier, every warp streams its row at once.
        const float* h0 = B.seq[0].hidden + (u64)scorer * hidden;
        if (blockIdx.x == 0 && warp == 0) {
            for (u32 k = lane; k < hidden; k += 32)
                if (!isfinite(h0[k])) record_error(err, FM_ERR_HIDDEN, scorer, k);
        }
        if (active) {
#pragma unroll 4
            for (u32 k = lane * 8; k < hidden; k += 256) {
                float wv[8];
                load8<T>(wrow + k, wv);
                acc[0] += dot8(wv, __ldg((const float4*)(h0 + k)), __ldg((const float4*)(h0 + k + 4)));
            }
        }
    } else
    for (u32 k0 = 0; k0 < hidden; k0 += KT) {
        const u32 kt = min(KT, hidden - k0);
        __syncthreads();
        for (u32 t = threadIdx.x; t < B.n * kt; t += blockDim.x) {
            const u32 b = t / kt, k = t % kt;
            const float v = B.seq[b].hidden[(u64)scorer * hidden + k0 + k];
            if (!isfinite(v) && blockIdx.x == 0) record_error(err, FM_ERR_HIDDEN, scorer, k0 + k);
            sh_h[b * KT + k] = v;
        }
        __syncthreads();
        if (!active) continue;
#pragma unroll 4
        for (u32 k = lane * 8; k < kt; k += 256) {
            float wv[8];
            load8<T>(wrow + k0 + k, wv);
#pragma unroll
            for (u32 b = 0; b < MAXB; ++b) {
                if (b < B.n) {
                    const float* h = sh_h + b * KT + k;
                    acc[b] += dot8(wv, *(const float4*)h, *(const float4*)(h + 4));
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (u32 b = 0; b < MAXB; ++b) {
        if (b >= B.n) break;
        float s = acc[b];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(KVS_FULL_MASK, s, off);
        if (lane == 0) {
            if (row < QR) B.seq[b].q[(u64)scorer * QR + row] = f32_to_bf16(s);
            else B.seq[b].w[scorer * FM_HEADS + (row - QR)] = s;
        }
    }
}

// Instantiations: weight dtype x batch width (1: hidden read through L1, no
// shared memory; 8 and 64: staged passes of 1024 and 256 elements).
#define FM_PROJECT(NAME, T, MAXB, KT)                                                            \
    extern "C" __global__ void __launch_bounds__(FM_PROJ_ROWS * 32)                               \
    NAME(const T* W, u32 hidden, ProjBatch B, u32* err) { project<T, MAXB, KT>(W, hidden, B, err); }
// Shared memory: MAXB * KT * 4 bytes for b8 and b64 (32 and 64 KiB), none for b1.
FM_PROJECT(fm_project_f32_b1, float, 1, 256)
FM_PROJECT(fm_project_f32_b8, float, 8, 1024)
FM_PROJECT(fm_project_f32_b64, float, 64, 256)
FM_PROJECT(fm_project_bf16_b1, u16, 1, 256)
FM_PROJECT(fm_project_bf16_b8, u16, 8, 1024)
FM_PROJECT(fm_project_bf16_b64, u16, 64, 256)
FM_PROJECT(fm_project_f16_b1, F16, 1, 256)
FM_PROJECT(fm_project_f16_b8, F16, 8, 1024)
FM_PROJECT(fm_project_f16_b64, F16, 64, 256)

// ------------------------------------------------------- scoring (tensor cores)

// One sequence of a scoring launch.
struct ScoreSeq {
    const void* keys;     // [n][FM_HEAD_DIM] in `dtype`, rows `stride` bytes apart
    const float* scales;  // fp8: per-chunk scale; else unused
    const u16* q;         // [FM_QROWS][FM_HEAD_DIM] bf16
    const float* w;       // [FM_QROWS]
    u32* skey;            // [n] out: sortable score keys
    u32* hist;            // [FM_HIST_WORDS] out: fine and coarse counts of skey (flush_hist)
    u32 stride;           // bytes between key rows
    u32 n;
};

struct ScoreBatch {
    u32 n_seqs;
    u32 dtype;
    u32 mean;  // 1: ensemble mean, 0: max
    u32 pad;
    ScoreSeq seq[FM_MAX_BATCH];
};

#define FM_TILE 64                              // chunks per block tile
#define FM_WROWS 32                             // chunks per warp
#define FM_WHEADS (FM_HEADS < 64 ? FM_HEADS : 64)  // heads per warp
#define FM_HGROUPS (FM_HEADS / FM_WHEADS)
#define FM_SCORE_WARPS ((FM_TILE / FM_WROWS) * FM_SCORERS * FM_HGROUPS)
#define FM_CHUNKS16 (FM_HEAD_DIM / 8)           // 16-byte chunks per bf16 row
#define FM_KSTEPS (FM_HEAD_DIM / 16)

// Swizzled byte offset of 16-byte chunk `c` of row `r` (rows of FM_HEAD_DIM
// bf16): XOR with the row's low bits spreads ldmatrix rows over the banks.
__device__ __forceinline__ u32 swz(u32 r, u32 c) {
    return r * (FM_HEAD_DIM * 2) + ((c ^ (r & 7u)) << 4);
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(g));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Shared memory: Q (bf16, swizzled) | two keys tiles (bf16, swizzled; one is
// computed on while the next is loaded) | per-warp row partials | histogram.
#define FM_Q_BYTES (FM_QROWS * FM_HEAD_DIM * 2)
#define FM_TILE_BYTES (FM_TILE * FM_HEAD_DIM * 2)
#define FM_PART_BYTES (FM_SCORERS * FM_HGROUPS * FM_TILE * 4)

#define FM_SCORE_THREADS (FM_SCORE_WARPS * 32)
#define FM_STAGE_ITEMS ((FM_TILE * FM_CHUNKS16 + FM_SCORE_THREADS - 1) / FM_SCORE_THREADS)

// bf16 keys: starts the asynchronous copy of rows [c0, c0 + FM_TILE) into
// `tile` (swizzled); rows past n are zeroed. Completes at cp_async_wait_all.
__device__ void issue_tile_bf16(const ScoreSeq& S, u32 c0, u8* tile) {
    for (u32 t = threadIdx.x; t < FM_TILE * FM_CHUNKS16; t += FM_SCORE_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const u32 chunk = c0 + r;
        u8* dst = tile + swz(r, c);
        if (chunk < S.n) cp_async16(smem_addr(dst), (const u8*)S.keys + (u64)chunk * S.stride + c * 16);
        else *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
    cp_async_commit();
}

// fp8 keys: loads a tile's raw bytes into registers (8 fp8 per item) ...
struct Fp8Regs {
    uint2 v[FM_STAGE_ITEMS];
};

__device__ __forceinline__ void load_tile_fp8(const ScoreSeq& S, u32 c0, Fp8Regs& R) {
#pragma unroll
    for (u32 j = 0; j < FM_STAGE_ITEMS; ++j) {
        const u32 t = threadIdx.x + j * FM_SCORE_THREADS;
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const u32 chunk = c0 + r;
        R.v[j] = (t < FM_TILE * FM_CHUNKS16 && chunk < S.n)
                     ? *(const uint2*)((const u8*)S.keys + (u64)chunk * S.stride + c * 8)
                     : make_uint2(0, 0);
    }
}

// ... and converts them to bf16 into `tile` (exact: e4m3 fits in bf16).
__device__ __forceinline__ void store_tile_fp8(const Fp8Regs& R, u8* tile) {
#pragma unroll
    for (u32 j = 0; j < FM_STAGE_ITEMS; ++j) {
        const u32 t = threadIdx.x + j * FM_SCORE_THREADS;
        if (t >= FM_TILE * FM_CHUNKS16) break;
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const u32 w[2] = {R.v[j].x, R.v[j].y};
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[i] = fp8x2_to_bf16x2(w[i / 2] >> (16 * (i % 2)));
        }
        *(uint4*)(tile + swz(r, c)) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// f32 keys: loads and rounds to bf16 synchronously (not a fast path).
__device__ void stage_tile_f32(const ScoreSeq& S, u32 c0, u8* tile) {
    for (u32 t = threadIdx.x; t < FM_TILE * FM_CHUNKS16; t += FM_SCORE_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const u32 chunk = c0 + r;
        uint4 out = make_uint4(0, 0, 0, 0);
        if (chunk < S.n) out = f32x8_to_bf16x8((const float*)((const u8*)S.keys + (u64)chunk * S.stride) + c * 8);
        *(uint4*)(tile + swz(r, c)) = out;
    }
}

__device__ __forceinline__ void ldmatrix_x2(u32 addr, u32& a, u32& b) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "r"(addr));
}

// Grid: (blocks per sequence, sequences). Each block loads the sequence's Q
// once, then walks tiles of FM_TILE chunks. Warp (row group, scorer, head
// group) computes FM_WROWS x FM_WHEADS dot products on the tensor cores,
// applies relu, the per-chunk scale and the head weights, and reduces over its
// heads; the block combines head groups and scorers (ensemble) per chunk.
// Key rows must be 16-byte aligned (checked on the host).
extern "C" __global__ void __launch_bounds__(FM_SCORE_THREADS)
fm_score(ScoreBatch B, u32* err) {
    extern __shared__ __align__(128) u8 smem[];
    u8* sh_q = smem;
    u8* sh_tiles = smem + FM_Q_BYTES;  // [2][FM_TILE_BYTES]
    float* sh_part = (float*)(sh_tiles + 2 * FM_TILE_BYTES);
    u32* sh_hist = (u32*)(sh_part + FM_SCORERS * FM_HGROUPS * FM_TILE);
    wait_prerequisites();  // q and w come from the projection kernel
    const ScoreSeq& S = B.seq[blockIdx.y];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 rgroup = warp / (FM_SCORERS * FM_HGROUPS);
    const u32 sh_idx = warp % (FM_SCORERS * FM_HGROUPS);  // scorer * FM_HGROUPS + head group
    const u32 scorer = sh_idx / FM_HGROUPS, hgroup = sh_idx % FM_HGROUPS;
    const u32 n0 = scorer * FM_HEADS + hgroup * FM_WHEADS;  // first q row of this warp

    for (u32 t = threadIdx.x; t < FM_QROWS * FM_CHUNKS16; t += blockDim.x) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        *(uint4*)(sh_q + swz(r, c)) = *(const uint4*)(S.q + (u64)r * FM_HEAD_DIM + c * 8);
    }
    for (u32 i = threadIdx.x; i < FM_HIST; i += blockDim.x) sh_hist[i] = 0;
    // This thread's head weights: columns 2*(lane%4)+{0,1} of each 8-wide n-tile.
    float wv[FM_WHEADS / 8][2];
#pragma unroll
    for (u32 nt = 0; nt < FM_WHEADS / 8; ++nt) {
        wv[nt][0] = S.w[n0 + nt * 8 + 2 * (lane & 3u)];
        wv[nt][1] = S.w[n0 + nt * 8 + 2 * (lane & 3u) + 1];
    }
    bool bad = false;
    u32 bad_chunk = 0;
    const u32 tiles = (S.n + FM_TILE - 1) / FM_TILE;
    Fp8Regs next_fp8;
    // Prologue: the first tile into buffer 0.
    if (blockIdx.x < tiles) {
        const u32 c0 = blockIdx.x * FM_TILE;
        if (B.dtype == FM_KEYS_BF16) issue_tile_bf16(S, c0, sh_tiles);
        else if (B.dtype == FM_KEYS_FP8_E4M3) {
            load_tile_fp8(S, c0, next_fp8);
            store_tile_fp8(next_fp8, sh_tiles);
        } else stage_tile_f32(S, c0, sh_tiles);
    }
    u32 buf = 0;
    for (u32 tile = blockIdx.x; tile < tiles; tile += gridDim.x, buf ^= 1u) {
        const u32 c0 = tile * FM_TILE;
        const u32 next = tile + gridDim.x;
        u8* sh_tile = sh_tiles + buf * FM_TILE_BYTES;
        u8* sh_next = sh_tiles + (buf ^ 1u) * FM_TILE_BYTES;
        if (B.dtype == FM_KEYS_BF16) cp_async_wait_all();
        __syncthreads();  // this tile is staged; the other buffer and sh_part are free
        // Start the next tile's loads; they land while this one is computed.
        if (next < tiles) {
            if (B.dtype == FM_KEYS_BF16) issue_tile_bf16(S, next * FM_TILE, sh_next);
            else if (B.dtype == FM_KEYS_FP8_E4M3) load_tile_fp8(S, next * FM_TILE, next_fp8);
        }

        float acc[FM_WROWS / 16][FM_WHEADS / 8][4];
#pragma unroll
        for (u32 m = 0; m < FM_WROWS / 16; ++m)
#pragma unroll
            for (u32 nt = 0; nt < FM_WHEADS / 8; ++nt)
#pragma unroll
                for (u32 j = 0; j < 4; ++j) acc[m][nt][j] = 0.f;

        const u32 tile_base = smem_addr(sh_tile), q_base = smem_addr(sh_q);
#pragma unroll
        for (u32 ks = 0; ks < FM_KSTEPS; ++ks) {
            u32 a[FM_WROWS / 16][4];
#pragma unroll
            for (u32 m = 0; m < FM_WROWS / 16; ++m) {
                const u32 r = rgroup * FM_WROWS + m * 16 + (lane & 15u);
                ldmatrix_x4(tile_base + swz(r, ks * 2 + (lane >> 4)), a[m][0], a[m][1], a[m][2], a[m][3]);
            }
#pragma unroll
            for (u32 np = 0; np < FM_WHEADS / 16; ++np) {
                u32 b0, b1, b2, b3;
                const u32 r = n0 + np * 16 + (lane & 7u) + ((lane >> 4) << 3);
                ldmatrix_x4(q_base + swz(r, ks * 2 + ((lane >> 3) & 1u)), b0, b1, b2, b3);
#pragma unroll
                for (u32 m = 0; m < FM_WROWS / 16; ++m) {
                    mma_bf16(acc[m][2 * np], a[m], b0, b1);
                    mma_bf16(acc[m][2 * np + 1], a[m], b2, b3);
                }
            }
            if (FM_WHEADS % 16 == 8) {  // a last single 8-head n-tile
                constexpr u32 nt = FM_WHEADS / 8 - 1;
                u32 b0, b1;
                const u32 r = n0 + nt * 8 + (lane & 7u);
                ldmatrix_x2(q_base + swz(r, ks * 2 + ((lane >> 3) & 1u)), b0, b1);
#pragma unroll
                for (u32 m = 0; m < FM_WROWS / 16; ++m) mma_bf16(acc[m][nt], a[m], b0, b1);
            }
        }

        // Epilogue: rows lane/4 and lane/4 + 8 of each 16-row m-tile.
#pragma unroll
        for (u32 m = 0; m < FM_WROWS / 16; ++m) {
#pragma unroll
            for (u32 half = 0; half < 2; ++half) {
                const u32 row = rgroup * FM_WROWS + m * 16 + (lane >> 2) + half * 8;
                const u32 chunk = c0 + row;
                const float scale = (B.dtype == FM_KEYS_FP8_E4M3 && chunk < S.n) ? S.scales[chunk] : 1.f;
                float s = 0.f;
                bool finite = true;
#pragma unroll
                for (u32 nt = 0; nt < FM_WHEADS / 8; ++nt) {
#pragma unroll
                    for (u32 j = 0; j < 2; ++j) {
                        const float x = acc[m][nt][half * 2 + j] * scale;
                        finite &= isfinite(x);  // a non-finite key, scale or overflow
                        s = fmaf(wv[nt][j], x > 0.f ? x : 0.f, s);
                    }
                }
                s += __shfl_xor_sync(KVS_FULL_MASK, s, 1);
                s += __shfl_xor_sync(KVS_FULL_MASK, s, 2);
                if ((lane & 3u) == 0) sh_part[sh_idx * FM_TILE + row] = s;
                if (!finite && chunk < S.n) {
                    bad = true;
                    bad_chunk = chunk;
                }
            }
        }
        __syncthreads();
        for (u32 row0 = 0; row0 < FM_TILE; row0 += blockDim.x) {  // whole warps (hist_add)
            const u32 row = row0 + threadIdx.x;
            const u32 chunk = c0 + row;
            const bool valid = row < FM_TILE && chunk < S.n;
            if (!__any_sync(KVS_FULL_MASK, valid)) continue;
            float ens = 0.f;
#pragma unroll
            for (u32 i = 0; i < FM_SCORERS; ++i) {
                float si = 0.f;
#pragma unroll
                for (u32 g = 0; g < FM_HGROUPS; ++g) si += valid ? sh_part[(i * FM_HGROUPS + g) * FM_TILE + row] : 0.f;
                ens = B.mean ? ens + si : (i == 0 ? si : fmaxf(ens, si));
            }
            if (B.mean) ens *= 1.f / FM_SCORERS;
            if (valid && !isfinite(ens)) {
                bad = true;
                bad_chunk = chunk;
                ens = -3.0e38f;
            }
            const u32 k = sort_key(ens);
            if (valid) S.skey[chunk] = k;
            hist_add(sh_hist, k >> (32 - FM_HIST_BITS), valid);
        }
        if (next < tiles) {
            if (B.dtype == FM_KEYS_FP8_E4M3) store_tile_fp8(next_fp8, sh_next);
            else if (B.dtype == FM_KEYS_F32) stage_tile_f32(S, next * FM_TILE, sh_next);
        }
    }
    if (bad) record_error(err, FM_ERR_SCORE, bad_chunk, blockIdx.y);
    allow_dependents();  // the selection may start launching as blocks finish
    __syncthreads();
    flush_hist(sh_hist, S.hist);
}

// ------------------------------------------ scoring with wgmma (Hopper, sm_90a)
//
// The same result as fm_score, on Hopper's warpgroup MMA: one m64nNk16
// instruction per 16 key dimensions covers 64 chunks x every (scorer, head)
// column (N = FM_SCORERS * FM_HEADS <= 256), both operands read by the tensor
// cores straight from shared memory in the 128-byte-swizzled K-major layout.
// Each warpgroup streams its own 64-chunk tiles through a 4-deep cp.async
// ring; a thread holds whole (scorer, head) rows of its chunks, so the
// ensemble is reduced in registers (one quad shuffle) with no shared-memory
// partials. Compiled with
// -DFM_WGMMA for sm_90a when the shape allows (N a multiple of 64, head_dim a
// multiple of 64).
#if defined(FM_WGMMA)

#define WG_GROUPS 3                      // warpgroups taking turns on the tensor cores
#define WG_THREADS (128 * WG_GROUPS)
#define WG_KBLOCKS (FM_HEAD_DIM / 64)    // 128-byte K blocks per row
#define WG_Q_BYTES (FM_QROWS * FM_HEAD_DIM * 2)

// Byte offset of 16-byte chunk c (0 .. FM_CHUNKS16) of row r in a tile of
// `rows` rows, in the canonical K-major SW128 layout: one region per 64-wide
// K block; rows 128 bytes apart; 8-row atoms of 1024 bytes; chunk index XOR
// (row % 8).
__device__ __forceinline__ u32 sw128(u32 rows, u32 r, u32 c) {
    return (c >> 3) * (rows * 128u) + r * 128u + (((c & 7u) ^ (r & 7u)) << 4);
}

// GMMA shared-memory descriptor: start address, leading byte offset 16 (unused
// for swizzled K-major), stride 1024 bytes between 8-row atoms, 128B swizzle.
__device__ __forceinline__ u64 gmma_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_n64(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_n128(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_n192(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_n256(float* d, u64 desc_a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_row(float* d, u64 a, u64 b, u32 acc) {
#if FM_QROWS == 64
    wgmma_n64(d, a, b, acc);
#elif FM_QROWS == 128
    wgmma_n128(d, a, b, acc);
#elif FM_QROWS == 192
    wgmma_n192(d, a, b, acc);
#elif FM_QROWS == 256
    wgmma_n256(d, a, b, acc);
#else
#error "FM_WGMMA needs FM_SCORERS * FM_HEADS in {64, 128, 192, 256}"
#endif
}


// A from registers (f16), B from shared memory (f16): the fp8-key kernel.
__device__ __forceinline__ void wgmma_rs_n64(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n128(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n192(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n256(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_row(float* d, const u32* a, u64 b, u32 acc) {
#if FM_QROWS == 64
    wgmma_rs_n64(d, a, b, acc);
#elif FM_QROWS == 128
    wgmma_rs_n128(d, a, b, acc);
#elif FM_QROWS == 192
    wgmma_rs_n192(d, a, b, acc);
#else
    wgmma_rs_n256(d, a, b, acc);
#endif
}

#define WG_STAGES 3                        // tiles in flight per warpgroup
#define WG_ROWS 64                         // chunks per warpgroup tile (one m64 wgmma row)
#define WG_SUB_BYTES (WG_ROWS * FM_HEAD_DIM * 2)   // one bf16 warpgroup tile
#define WG_RAW_BYTES (WG_ROWS * FM_HEAD_DIM)       // one fp8 warpgroup tile
#define WG_GROUP_THREADS 128
#define WG_ORDER_BAR (1 + WG_GROUPS)       // named barriers WG_ORDER_BAR + g: warpgroup g's turn on the tensor cores
// Named barrier ids: 0 = __syncthreads, 1 .. WG_GROUPS = one warpgroup, then the turns.
static_assert(WG_ORDER_BAR + WG_GROUPS <= 16, "16 hardware barriers");

// Raw fp8 tiles: row r's 16-byte chunk c sits at chunk c ^ raw_swz(r) (128-byte
// rows: conflict-free 16-byte loads of two rows x four columns per quarter warp).
__device__ __forceinline__ u32 raw_swz(u32 r) { return FM_HEAD_DIM == 128 ? (r & 7u) : 0u; }

__device__ __forceinline__ void cp_async_wait_stages() {
    asm volatile("cp.async.wait_group %0;" ::"n"(WG_STAGES - 2) : "memory");
}

// Barrier of one warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void wg_barrier(u32 g) {
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "n"(WG_GROUP_THREADS) : "memory");
}
// A turn barrier: the waiting warpgroup syncs, the one before it arrives.
__device__ __forceinline__ void turn_wait(u32 id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(2 * WG_GROUP_THREADS) : "memory");
}
__device__ __forceinline__ void turn_pass(u32 id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(2 * WG_GROUP_THREADS) : "memory");
}

// Starts the copy of rows [c0, c0 + WG_ROWS) by the 128 threads of a
// warpgroup (t0 = thread index in the group): bf16 rows straight into the
// swizzled compute layout; fp8 rows as raw bytes (converted before use).
// Thread t0 always copies the same 16-byte column of rows t0 / per_row +
// j * (128 / per_row), so its addresses step by a constant. Rows past n are
// zeroed. Always commits one group (possibly empty) so counting stays uniform.
__device__ __forceinline__ void wg_issue(const u8* keys, u32 stride, u32 n, u32 dtype, u32 t0, u32 c0, bool valid, u8* dst) {
    if (valid && dtype == FM_KEYS_BF16) {
        constexpr u32 PER_ROW = FM_CHUNKS16, ITEMS = WG_ROWS * PER_ROW / WG_GROUP_THREADS;
        constexpr u32 RSTEP = WG_GROUP_THREADS / PER_ROW;
        if constexpr (WG_GROUP_THREADS % PER_ROW == 0 && RSTEP % 8 == 0) {
            // Rows r0 + j * RSTEP keep r % 8, so the swizzled destination
            // steps by RSTEP * 128 bytes and the source by RSTEP rows.
            const u32 r0 = t0 / PER_ROW, c = t0 % PER_ROW;
            const u8* src = keys + (u64)(c0 + r0) * stride + c * 16;
            const u64 step = (u64)RSTEP * stride;
            const u32 d0 = smem_addr(dst + sw128(WG_ROWS, r0, c));
            if (c0 + WG_ROWS <= n) {
#pragma unroll
                for (u32 j = 0; j < ITEMS; ++j) {
                    cp_async16(d0 + j * RSTEP * 128u, src);
                    src += step;
                }
            } else {
                for (u32 j = 0; j < ITEMS; ++j) {
                    if (c0 + r0 + j * RSTEP < n) cp_async16(d0 + j * RSTEP * 128u, src);
                    else *(uint4*)(dst + sw128(WG_ROWS, r0 + j * RSTEP, c)) = make_uint4(0, 0, 0, 0);
                    src += step;
                }
            }
        } else {
            for (u32 t = t0; t < WG_ROWS * PER_ROW; t += WG_GROUP_THREADS) {
                const u32 r = t / PER_ROW, c = t % PER_ROW;
                u8* d = dst + sw128(WG_ROWS, r, c);
                if (c0 + r < n) cp_async16(smem_addr(d), keys + (u64)(c0 + r) * stride + c * 16);
                else *(uint4*)d = make_uint4(0, 0, 0, 0);
            }
        }
    } else if (valid && dtype == FM_KEYS_FP8_E4M3) {
        constexpr u32 PER_ROW = FM_HEAD_DIM / 16;  // 16-byte pieces of an fp8 row
        for (u32 t = t0; t < WG_ROWS * PER_ROW; t += WG_GROUP_THREADS) {
            const u32 r = t / PER_ROW, c = t % PER_ROW;
            u8* d = dst + r * FM_HEAD_DIM + ((c ^ raw_swz(r)) << 4);
            if (c0 + r < n) cp_async16(smem_addr(d), keys + (u64)(c0 + r) * stride + c * 16);
            else *(uint4*)d = make_uint4(0, 0, 0, 0);
        }
    }
    cp_async_commit();
}

// fp8 raw tile (row-major) -> bf16 swizzled compute tile (exact).
__device__ void wg_convert_fp8(u32 t0, const u8* raw, u8* tile) {
    for (u32 t = t0; t < WG_ROWS * FM_CHUNKS16; t += WG_GROUP_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const uint2 v = *(const uint2*)(raw + r * FM_HEAD_DIM + (((c >> 1) ^ raw_swz(r)) << 4) + (c & 1u) * 8);
        const u32 w[2] = {v.x, v.y};
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = fp8x2_to_bf16x2(w[i / 2] >> (16 * (i % 2)));
        *(uint4*)(tile + sw128(WG_ROWS, r, c)) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

__device__ void wg_stage_f32(const u8* keys, u32 stride, u32 n, u32 t0, u32 c0, u8* tile) {
    for (u32 t = t0; t < WG_ROWS * FM_CHUNKS16; t += WG_GROUP_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        uint4 out = make_uint4(0, 0, 0, 0);
        if (c0 + r < n) out = f32x8_to_bf16x8((const float*)(keys + (u64)(c0 + r) * stride) + c * 8);
        *(uint4*)(tile + sw128(WG_ROWS, r, c)) = out;
    }
}

// The tiles of warpgroup g of this block: WG_GROUPS * blockIdx.x + g, then
// every WG_GROUPS * gridDim.x (`step`); counts never grow with g and differ
// by at most 1. After its turn i, a warpgroup passes the turn on only while
// i < next_turns, so no barrier is left half-arrived.
struct WgTiles {
    u32 step, first, mine, next, next_turns, first_turns;
};
__device__ __forceinline__ WgTiles wg_tiles(u32 n, u32 g) {
    const u32 tiles = (n + WG_ROWS - 1) / WG_ROWS;
    const u32 step = WG_GROUPS * gridDim.x;
    auto count = [&](u32 h) -> u32 {
        const u32 f = WG_GROUPS * blockIdx.x + h;
        return f < tiles ? (tiles - f + step - 1) / step : 0u;
    };
    WgTiles t;
    t.step = step;
    t.first = WG_GROUPS * blockIdx.x + g;
    t.mine = count(g);
    t.next = g + 1 < WG_GROUPS ? g + 1 : 0u;
    t.first_turns = count(0);
    t.next_turns = g + 1 < WG_GROUPS ? count(t.next) : (t.first_turns > 0 ? t.first_turns - 1 : 0u);
    return t;
}

// A row's sum over the quad holding it (lanes 4r .. 4r + 3).
__device__ __forceinline__ float quad_sum(float si) {
    si += __shfl_xor_sync(KVS_FULL_MASK, si, 1);
    return si + __shfl_xor_sync(KVS_FULL_MASK, si, 2);
}
// Scorer sc's score folded into the ensemble `ens` (max or mean).
__device__ __forceinline__ void ensemble_fold(float si, u32 sc, bool mean, float& ens, bool& finite) {
    finite &= isfinite(si);
    ens = mean ? ens + si : (sc == 0 ? si : fmaxf(ens, si));
}
// One scorer's term of the ensemble: its quad sum, folded into `ens`.
__device__ __forceinline__ void ensemble_add(float si, u32 sc, bool mean, float& ens, bool& finite) {
    ensemble_fold(quad_sum(si), sc, mean, ens, finite);
}

// Files a row's score: its sortable key (the lowest score after an error)
// and its histogram count; one lane of the quad writes.
__device__ __forceinline__ void wg_file_score(float ens, bool finite, bool in, u32 chunk, u32 lane, const ScoreSeq& S, u32* sh_hist,
                                              bool& bad, u32& bad_chunk) {
    if (!finite && in) {
        bad = true;
        bad_chunk = chunk;
        ens = -3.0e38f;
    }
    const u32 k = sort_key(ens);
    if ((lane & 3u) == 0 && in) {  // 8 lanes: a plain shared atomic beats match_any
        S.skey[chunk] = k;
        atomicAdd(&sh_hist[k >> (32 - FM_HIST_BITS)], 1u);
    }
}

// The ensemble score of one of this thread's two rows (`half`) from its
// accumulators: per scorer sum_h w[h] * relu(x[h]), x = scale * (q . key)
// when SCALED; the quad holding the row reduces it. `finite` turns false for
// a non-finite key (every column of its row is then non-finite, so one
// column is checked), a non-finite scale, or a dot product overflowing to
// +inf (it reaches the scorer's sum); -inf overflow is clamped by the relu as
// in exact arithmetic. relu(NaN) is not needed: a NaN column means a
// non-finite key. Two instructions per accumulator (bf16, f32 keys).
template <bool SCALED>
__device__ __forceinline__ float wg_row_score(const float* d, u32 half, const float (*wv)[2], float scale, bool mean, bool& finite) {
    finite = isfinite(d[2 * half]) && isfinite(scale);
    float ens = 0.f;
#pragma unroll
    for (u32 sc = 0; sc < FM_SCORERS; ++sc) {
        // Four independent chains (n-tiles j mod 4) hide the FMA latency.
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (u32 j = sc * (FM_HEADS / 8); j < (sc + 1) * (FM_HEADS / 8); ++j) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                const float x = SCALED ? d[4 * j + 2 * half + e] * scale : d[4 * j + 2 * half + e];
                part[j & 3u] = fmaf(wv[j][e], fmaxf(x, 0.f), part[j & 3u]);
            }
        }
        ensemble_add((part[0] + part[1]) + (part[2] + part[3]), sc, mean, ens, finite);
    }
    if (mean) ens *= 1.f / FM_SCORERS;
    return ens;
}

// Grid: (blocks per sequence, sequences), WG_GROUPS warpgroups (WG_THREADS
// threads), dynamic shared memory: Q + per warpgroup a ring of WG_STAGES
// tiles (bf16: compute tiles; fp8: raw tiles plus one compute tile; f32: one
// compute tile) + 1024 alignment slack. The warpgroups run independent
// pipelines over interleaved 64-chunk tiles and take turns on the tensor
// cores in a fixed cycle 0, 1, .., WG_GROUPS - 1 (named barriers): one issues
// its MMAs right after the one before it, so the others' epilogues overlap
// the MMAs.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg(ScoreBatch B, u32* err) {
    extern __shared__ u8 wg_smem_raw[];
    __shared__ u32 sh_hist[FM_HIST];
    // The swizzled layouts need 1024-byte aligned regions.
    const u32 raw_addr = smem_addr(wg_smem_raw);
    u8* base = wg_smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    u8* sh_q = base;
    const u32 dtype = B.dtype;
    const bool mean = B.mean != 0;
    const u32 slot_bytes = dtype == FM_KEYS_BF16 ? WG_SUB_BYTES : WG_RAW_BYTES;
    const u32 group_bytes = dtype == FM_KEYS_BF16 ? WG_STAGES * WG_SUB_BYTES : WG_STAGES * WG_RAW_BYTES + WG_SUB_BYTES;
    const ScoreSeq& S = B.seq[blockIdx.y];
    const u8* keys = (const u8*)S.keys;
    const u32 n = S.n, stride = S.stride;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = warp >> 2;                       // this warpgroup
    const u32 t0 = threadIdx.x & (WG_GROUP_THREADS - 1u);
    u8* ring = base + WG_Q_BYTES + g * group_bytes;
    u8* conv = ring + WG_STAGES * WG_RAW_BYTES;    // fp8 / f32 compute tile

    const WgTiles T = wg_tiles(n, g);
    const u32 step = T.step, first = T.first, my_tiles = T.mine, next = T.next, next_turns = T.next_turns;
    // The first key tiles are loaded before waiting for the projection: keys
    // are inputs of the call (ready before the projection started), q and w
    // are its outputs.
    if (dtype != FM_KEYS_F32) {
        for (u32 i = 0; i < WG_STAGES - 1; ++i)
            wg_issue(keys, stride, n, dtype, t0, (first + i * step) * WG_ROWS, i < my_tiles, ring + i * slot_bytes);
    }
    wait_prerequisites();
    for (u32 t = threadIdx.x; t < FM_QROWS * FM_CHUNKS16; t += WG_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        cp_async16(smem_addr(sh_q + sw128(FM_QROWS, r, c)), S.q + (u64)r * FM_HEAD_DIM + c * 8);
    }
    cp_async_commit();
    for (u32 i = threadIdx.x; i < FM_HIST; i += WG_THREADS) sh_hist[i] = 0;
    // Head weights of this thread's columns: n-tile j, columns 2*(lane%4)+{0,1}.
    float wv[FM_QROWS / 8][2];
#pragma unroll
    for (u32 j = 0; j < FM_QROWS / 8; ++j) {
        wv[j][0] = S.w[j * 8 + 2 * (lane & 3u)];
        wv[j][1] = S.w[j * 8 + 2 * (lane & 3u) + 1];
    }
    cp_async_wait_all();  // Q (and the first tiles, loaded alongside)
    fence_async_smem();
    __syncthreads();  // Q and the histogram are ready for both warpgroups
    bool bad = false;
    u32 bad_chunk = 0;
    const u64 db0 = gmma_desc(smem_addr(sh_q));
    if (g == WG_GROUPS - 1 && T.first_turns > 0) turn_pass(WG_ORDER_BAR);  // warpgroup 0 goes first
    for (u32 i = 0; i < my_tiles; ++i) {
        const u32 c0 = (first + i * step) * WG_ROWS;
        u8* slot = ring + (i % WG_STAGES) * slot_bytes;
        if (dtype != FM_KEYS_F32) cp_async_wait_stages();  // tile i has landed (this thread's part)
        wg_barrier(g);  // ... every thread's part; tile i - 1 is consumed
        if (dtype != FM_KEYS_F32) {
            const u32 ahead = i + WG_STAGES - 1;
            wg_issue(keys, stride, n, dtype, t0, (first + ahead * step) * WG_ROWS, ahead < my_tiles, ring + (ahead % WG_STAGES) * slot_bytes);
        }
        u8* cur_a = slot;
        if (dtype == FM_KEYS_FP8_E4M3) {
            wg_convert_fp8(t0, slot, conv);
            cur_a = conv;
        } else if (dtype == FM_KEYS_F32) {
            wg_stage_f32(keys, stride, n, t0, c0, conv);
            cur_a = conv;
        }
        fence_async_smem();  // generic-proxy writes (cp.async, stores) -> tensor-core reads
        wg_barrier(g);
        // Our turn: the warpgroup before us has issued its MMAs. (No branch
        // around the MMAs: ptxas would serialise them.)
        turn_wait(WG_ORDER_BAR + g);
        float d[FM_QROWS / 2];
#pragma unroll
        for (u32 k = 0; k < FM_QROWS / 2; ++k) d[k] = 0.f;
        // Descriptors of k-step ks: the base descriptor plus the step's byte
        // offset / 16 (the address field is in 16-byte units and the offsets
        // stay inside the 256 KiB window it covers).
        const u64 da0 = gmma_desc(smem_addr(cur_a));
        wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < FM_KSTEPS; ++ks) {
            const u32 kb = ks >> 2, within = (ks & 3u) * 32u;
            const u64 da = da0 + ((kb * (WG_ROWS * 128u) + within) >> 4);
            const u64 db = db0 + ((kb * (FM_QROWS * 128u) + within) >> 4);
            wgmma_row(d, da, db, ks > 0 ? 1u : 0u);
        }
        wgmma_commit();
        // The next warpgroup's turn (the last one gave warpgroup 0 its first
        // before the loop).
        if (i < next_turns) turn_pass(WG_ORDER_BAR + next);
        wgmma_wait0();

        // Epilogue: this thread's rows are r and r + 8 of its warp's 16.
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 row = (warp & 3u) * 16 + (lane >> 2) + half * 8;
            const u32 chunk = c0 + row;
            const bool in = chunk < n;
            bool finite;
            float ens;
            if (dtype == FM_KEYS_FP8_E4M3) ens = wg_row_score<true>(d, half, wv, in ? S.scales[chunk] : 1.f, mean, finite);
            else ens = wg_row_score<false>(d, half, wv, 1.f, mean, finite);
            wg_file_score(ens, finite, in, chunk, lane, S, sh_hist, bad, bad_chunk);
        }
    }
    cp_async_wait_all();
    if (bad) record_error(err, FM_ERR_SCORE, bad_chunk, blockIdx.y);
    allow_dependents();
    __syncthreads();
    flush_hist(sh_hist, S.hist);
}


#if FM_HEAD_DIM == 64 || FM_HEAD_DIM == 128
// fm_score_wg_fp8: fp8 keys go from the raw tile straight into the A
// registers of an f16 wgmma (one cvt per pair), with Q converted once per
// block to f16, scaled by 2^e so that max |q| lands in [2^14, 2^15) (exact:
// bf16 values fit f16's significand; only elements below 2^-24 of the max
// lose bits). The dot products come out scaled by 2^e; the epilogue
// multiplies by scale * 2^-e, which is exact whenever that product is a
// normal float, and by 2^-e and scale in turn otherwise.
//
// The reduction over k is order-free, so k is permuted to suit the register
// layout of A (rows g and g + 8 of each warp's 16, columns 2t, 2t + 1, 2t + 8,
// 2t + 9 of each 16-wide k step, t = lane % 4): logical column 16s + 2t + j
// (j = 0, 1) and 16s + 2t + 8 + j hold physical dims D/4 * t + 4s + j and
// D/4 * t + 4s + 2 + j. Each thread then reads D/4 contiguous bytes per row,
// and Q is stored with the same permutation.
#define WG8_SEG (FM_HEAD_DIM / 4)  // bytes of a row per thread
__device__ __forceinline__ u32 fp8_logical_k(u32 p) {
    const u32 t = p / WG8_SEG, rem = p % WG8_SEG, st = rem / 4, j = rem % 4;
    return 16 * st + 2 * t + (j < 2 ? j : 6 + j);
}

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)two));
    return h2;
}

// x = d * c (MODE 1) or (d * inv) * scale (MODE 2), then the ensemble as
// wg_row_score; wv from shared memory.
template <int MODE>
__device__ __forceinline__ float wg8_row_score(const float* d, u32 half, const float* sh_w, u32 lane, float c, float inv, float scale,
                                               bool mean, bool& finite) {
    finite = isfinite(d[2 * half]) && isfinite(scale);
    float ens = 0.f;
#pragma unroll
    for (u32 sc = 0; sc < FM_SCORERS; ++sc) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (u32 j = sc * (FM_HEADS / 8); j < (sc + 1) * (FM_HEADS / 8); ++j) {
            const float2 w2 = *(const float2*)(sh_w + j * 8 + 2 * (lane & 3u));
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                const float a = d[4 * j + 2 * half + e];
                const float x = MODE == 1 ? a * c : (a * inv) * scale;
                part[j & 3u] = fmaf(e ? w2.y : w2.x, fmaxf(x, 0.f), part[j & 3u]);
            }
        }
        ensemble_add((part[0] + part[1]) + (part[2] + part[3]), sc, mean, ens, finite);
    }
    if (mean) ens *= 1.f / FM_SCORERS;
    return ens;
}

// Both rows of this thread when every row of the warp has a positive finite
// scale: relu(scale * x) = scale * relu(x), so each scorer's sum of w * relu(x)
// is taken over the raw dot products and multiplied once by scale * 2^-e
// (when that product is not a normal float, by 2^-e and the scale in turn):
// two instructions per accumulator instead of three, and one head weight
// load for both rows.
__device__ __forceinline__ void wg8_rows_score_pos(const float* d, const float* sh_w, u32 lane, const float* scale, float inv,
                                                   bool mean, float* ens, bool* finite) {
    float c[2];
    bool normal[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        c[h] = scale[h] * inv;
        normal[h] = c[h] >= 1.17549435e-38f && c[h] <= 3.40282347e38f;
        finite[h] = isfinite(d[2 * h]);
        ens[h] = 0.f;
    }
#pragma unroll
    for (u32 sc = 0; sc < FM_SCORERS; ++sc) {
        float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (u32 j = sc * (FM_HEADS / 8); j < (sc + 1) * (FM_HEADS / 8); ++j) {
            const float2 w2 = *(const float2*)(sh_w + j * 8 + 2 * (lane & 3u));
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                part[h][j & 3u] = fmaf(w2.x, fmaxf(d[4 * j + 2 * h], 0.f), part[h][j & 3u]);
                part[h][j & 3u] = fmaf(w2.y, fmaxf(d[4 * j + 2 * h + 1], 0.f), part[h][j & 3u]);
            }
        }
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            float si = quad_sum((part[h][0] + part[h][1]) + (part[h][2] + part[h][3]));
            si = normal[h] ? si * c[h] : (si * inv) * scale[h];
            ensemble_fold(si, sc, mean, ens[h], finite[h]);
        }
    }
#pragma unroll
    for (u32 h = 0; h < 2; ++h)
        if (mean) ens[h] *= 1.f / FM_SCORERS;
}

// Grid, threads and shared memory as fm_score_wg with fp8 keys (the compute
// tile is unused), plus the head weights.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg_fp8(ScoreBatch B, u32* err) {
    extern __shared__ u8 wg_smem_raw[];
    __shared__ u32 sh_hist[FM_HIST];
    __shared__ float sh_w[FM_QROWS];
    __shared__ u32 sh_max[WG_THREADS / 32];
    const u32 raw_addr = smem_addr(wg_smem_raw);
    u8* base = wg_smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    u8* sh_q = base;
    const bool mean = B.mean != 0;
    const u32 group_bytes = WG_STAGES * WG_RAW_BYTES + WG_SUB_BYTES;
    const ScoreSeq& S = B.seq[blockIdx.y];
    const u8* keys = (const u8*)S.keys;
    const u32 n = S.n, stride = S.stride;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = warp >> 2;
    const u32 t0 = threadIdx.x & (WG_GROUP_THREADS - 1u);
    u8* ring = base + WG_Q_BYTES + g * group_bytes;

    const WgTiles T = wg_tiles(n, g);
    const u32 step = T.step, first = T.first, my_tiles = T.mine, next = T.next, next_turns = T.next_turns;
    for (u32 i = 0; i < WG_STAGES - 1; ++i)
        wg_issue(keys, stride, n, FM_KEYS_FP8_E4M3, t0, (first + i * step) * WG_ROWS, i < my_tiles, ring + i * WG_RAW_BYTES);
    wait_prerequisites();
    // Q: four bf16 (one physical group) per item, held while max |q| is found.
    constexpr u32 Q_ITEMS = FM_QROWS * FM_HEAD_DIM / 4;
    constexpr u32 Q_PER = (Q_ITEMS + WG_THREADS - 1) / WG_THREADS;
    uint2 qv[Q_PER];
    u32 qmax = 0;  // largest |q| as bf16 bits (monotonic for non-negative values; NaN above Inf)
#pragma unroll
    for (u32 j = 0; j < Q_PER; ++j) {
        const u32 it = threadIdx.x + j * WG_THREADS;
        qv[j] = it < Q_ITEMS ? *(const uint2*)(S.q + (u64)it * 4) : make_uint2(0, 0);
        qmax = max(qmax, max(max(qv[j].x & 0x7fffu, (qv[j].x >> 16) & 0x7fffu), max(qv[j].y & 0x7fffu, (qv[j].y >> 16) & 0x7fffu)));
    }
    for (u32 i = threadIdx.x; i < FM_HIST; i += WG_THREADS) sh_hist[i] = 0;
    for (u32 i = threadIdx.x; i < FM_QROWS; i += WG_THREADS) sh_w[i] = S.w[i];
    qmax = __reduce_max_sync(KVS_FULL_MASK, qmax);
    if (lane == 0) sh_max[warp] = qmax;
    __syncthreads();
    qmax = 0;
#pragma unroll
    for (u32 w = 0; w < WG_THREADS / 32; ++w) qmax = max(qmax, sh_max[w]);
    // 2^e with max |q| * 2^e in [2^14, 2^15); none for zero or non-finite q
    // (a non-finite q makes the scores non-finite: an error either way).
    const int qexp = (int)((qmax >> 7) & 0xffu);
    const int e = (qmax == 0 || qexp == 0xff) ? 0 : min(126, max(-126, 141 - max(qexp, 1)));
    const float qscale = __int_as_float((127 + e) << 23), inv = __int_as_float((127 - e) << 23);
#pragma unroll
    for (u32 j = 0; j < Q_PER; ++j) {
        const u32 it = threadIdx.x + j * WG_THREADS;
        if (it >= Q_ITEMS) break;
        const u32 r = it / (FM_HEAD_DIM / 4), p = (it % (FM_HEAD_DIM / 4)) * 4;
        const u32 k = fp8_logical_k(p);  // p, p + 1 -> k, k + 1; p + 2, p + 3 -> k + 8, k + 9
        const u32 w[2] = {qv[j].x, qv[j].y};
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const float lo = bf16_to_f32((u16)(w[h] & 0xffffu)) * qscale, hi = bf16_to_f32((u16)(w[h] >> 16)) * qscale;
            u32 packed;
            asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
            const u32 kk = k + 8 * h;
            *(u32*)(sh_q + sw128(FM_QROWS, r, kk / 8) + (kk % 8) * 2) = packed;
        }
    }
    cp_async_wait_all();  // the first tiles
    fence_async_smem();   // Q (generic stores) -> tensor-core reads
    __syncthreads();
    bool bad = false;
    u32 bad_chunk = 0;
    const u64 db0 = gmma_desc(smem_addr(sh_q));
    // This thread's A rows in a tile and its byte segment in them.
    const u32 ra = (warp & 3u) * 16 + (lane >> 2), rb = ra + 8, tq = lane & 3u;
    if (g == WG_GROUPS - 1 && T.first_turns > 0) turn_pass(WG_ORDER_BAR);
    for (u32 i = 0; i < my_tiles; ++i) {
        const u32 c0 = (first + i * step) * WG_ROWS;
        const u8* slot = ring + (i % WG_STAGES) * WG_RAW_BYTES;
        cp_async_wait_stages();
        wg_barrier(g);
        {
            const u32 ahead = i + WG_STAGES - 1;
            wg_issue(keys, stride, n, FM_KEYS_FP8_E4M3, t0, (first + ahead * step) * WG_ROWS, ahead < my_tiles, ring + (ahead % WG_STAGES) * WG_RAW_BYTES);
        }
        // A fragments of all k steps: row ra / rb, bytes [WG8_SEG * tq, + WG8_SEG).
        u32 a[FM_KSTEPS][4];
#pragma unroll
        for (u32 q = 0; q < WG8_SEG / 16; ++q) {
            const u32 c = (WG8_SEG / 16) * tq + q;
            const uint4 va = *(const uint4*)(slot + ra * FM_HEAD_DIM + ((c ^ raw_swz(ra)) << 4));
            const uint4 vb = *(const uint4*)(slot + rb * FM_HEAD_DIM + ((c ^ raw_swz(rb)) << 4));
            const u32 wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
            for (u32 x = 0; x < 4; ++x) {
                const u32 ks = 4 * q + x;
                a[ks][0] = e4m3x2_to_f16x2(wa[x]);        // row ra, k 2t, 2t + 1
                a[ks][1] = e4m3x2_to_f16x2(wb[x]);        // row rb
                a[ks][2] = e4m3x2_to_f16x2(wa[x] >> 16);  // row ra, k 2t + 8, 2t + 9
                a[ks][3] = e4m3x2_to_f16x2(wb[x] >> 16);  // row rb
            }
        }
        turn_wait(WG_ORDER_BAR + g);
        float d[FM_QROWS / 2];
#pragma unroll
        for (u32 k = 0; k < FM_QROWS / 2; ++k) d[k] = 0.f;
        wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < FM_KSTEPS; ++ks) {
            const u32 kb = ks >> 2, within = (ks & 3u) * 32u;
            const u64 db = db0 + ((kb * (FM_QROWS * 128u) + within) >> 4);
            wgmma_rs_row(d, a[ks], db, ks > 0 ? 1u : 0u);
        }
        wgmma_commit();
        if (i < next_turns) turn_pass(WG_ORDER_BAR + next);
        // The rows' scales, loaded while the MMAs run.
        const u32 chunks[2] = {c0 + ra, c0 + rb};
        float scales[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) scales[h] = chunks[h] < n ? S.scales[chunks[h]] : 1.f;
        wgmma_wait0();

        if (__all_sync(KVS_FULL_MASK, scales[0] > 0.f && scales[0] <= 3.40282347e38f && scales[1] > 0.f && scales[1] <= 3.40282347e38f)) {
            float ens[2];
            bool finite[2];
            wg8_rows_score_pos(d, sh_w, lane, scales, inv, mean, ens, finite);
#pragma unroll
            for (u32 h = 0; h < 2; ++h) wg_file_score(ens[h], finite[h], chunks[h] < n, chunks[h], lane, S, sh_hist, bad, bad_chunk);
            continue;
        }
        // Any scale (zero, negative, non-finite): per element.
#pragma unroll
        for (u32 half = 0; half < 2; ++half) {
            const u32 chunk = chunks[half];
            const bool in = chunk < n;
            const float scale = scales[half];
            const float c = scale * inv;
            bool finite;
            float ens;
            if (fabsf(c) >= 1.17549435e-38f && fabsf(c) <= 3.40282347e38f) ens = wg8_row_score<1>(d, half, sh_w, lane, c, inv, scale, mean, finite);
            else ens = wg8_row_score<2>(d, half, sh_w, lane, c, inv, scale, mean, finite);
            wg_file_score(ens, finite, in, chunk, lane, S, sh_hist, bad, bad_chunk);
        }
    }
    cp_async_wait_all();
    if (bad) record_error(err, FM_ERR_SCORE, bad_chunk, blockIdx.y);
    allow_dependents();
    __syncthreads();
    flush_hist(sh_hist, S.hist);
}
#endif  // FM_HEAD_DIM 64 or 128
#endif  // FM_WGMMA

// ------------------------------------------- training-free (Quest-style) scorer

// score(c) = sum_d max(q_d * min[c][d], q_d * max[c][d]); bounds f32, rows of
// `dim` floats. One warp per chunk.
extern "C" __global__ void fm_bounds_score(const float* q, const float* bmin, const float* bmax, u32 dim, u32 n,
                                           u32* skey, u32* hist, u32* err) {
    __shared__ u32 sh_hist[FM_HIST];
    for (u32 i = threadIdx.x; i < FM_HIST; i += blockDim.x) sh_hist[i] = 0;
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    for (u32 c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); c < n; c += warps) {
        const float* lo = bmin + (u64)c * dim;
        const float* hi = bmax + (u64)c * dim;
        float s = 0.f;
        bool ok = true;
        for (u32 d = lane; d < dim; d += 32) {
            ok &= lo[d] <= hi[d] && isfinite(lo[d]) && isfinite(hi[d]);  // also false for NaN
            s += fmaxf(q[d] * lo[d], q[d] * hi[d]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(KVS_FULL_MASK, s, off);
        ok = __all_sync(KVS_FULL_MASK, ok);
        if (lane == 0) {
            if (!ok) {
                record_error(err, FM_ERR_BOUNDS, c, 0);
                s = -3.0e38f;
            } else if (!isfinite(s)) {
                record_error(err, FM_ERR_SCORE, c, 0);
                s = -3.0e38f;
            }
            const u32 k = sort_key(s);
            skey[c] = k;
            atomicAdd(&sh_hist[k >> (32 - FM_HIST_BITS)], 1u);
        }
    }
    __syncthreads();
    flush_hist(sh_hist, hist);
}

// ------------------------------------------------------------------- top-k
//
// Two launches. fm_select makes one pass over the scores: every block finds
// the threshold bin b of the scoring kernel's histogram (the highest bin
// with count(bins > b) < want <= count(bins >= b)), then files its keys:
// above b into `sure` (certainly in the top-k), in b into `tie`. Keys are
// 64-bit (score key << 32 | ~id), so descending key order is descending
// score with ties to the lower id. The histogram tells every block how many
// sure keys and ties there are in all; block 0 publishes the two counts.
// fm_order, its programmatic dependent, ranks the candidates by counting,
// spread over many blocks (a sure key among the sure keys, a tie among the
// ties after them), and writes the ids of ranks below `want`, -1 padded (all
// -1 after a recorded error). When there are more than FM_ORDER_MAX
// candidates (many equal scores), its block 0 alone narrows the ties to the
// `want - n_sure` best by 8-bit radix passes and ranks the winners. fm_order's
// block 0 also zeroes the histogram and the append counters for the next
// call (graph replay needs no memset): no fm_order block reads them.

// Per-sequence selection state.
//   appended  fm_select's append cursors: sure keys in bits 0..19 (< want <=
//             FM_RANK_MAX), ties in bits 20..43 (<= n <= 2^22); one atomic
//             reserves a block's places in both lists. Zero between calls.
//   filed     the final counts, same fields, published by fm_select's block 0
//             and read by fm_order.
struct SelectState {
    u64 appended;
    u64 filed;
};
#define FM_ST_TIE_SHIFT 20
__device__ __forceinline__ u32 st_sure(u64 c) { return (u32)(c & ((1u << FM_ST_TIE_SHIFT) - 1u)); }
__device__ __forceinline__ u32 st_tie(u64 c) { return (u32)(c >> FM_ST_TIE_SHIFT); }

struct SelectSeq {
    const u32* skey;   // [n]
    u32* hist;         // [FM_HIST_WORDS] fine and coarse counts of skey (flush_hist)
    SelectState* st;
    u64* sure;         // [FM_RANK_MAX] key64 of candidates certainly in the top-k
    u64* tie;          // [n] key64 of candidates in the threshold bin
    i32* out;          // [k] result
    u32 n;
    u32 pad;
};

struct SelectBatch {
    u32 n_seqs;
    u32 k;
    SelectSeq seq[FM_MAX_BATCH];
};

#define FM_SEL_THREADS 512
#define FM_SEL_ITEMS 4      // keys per thread
#define FM_RANK_MAX 2048    // the largest k
#define FM_MAX_CHUNKS 4194304u  // scorer::FM_MAX_CHUNKS (checked on the host)
static_assert(FM_MAX_CHUNKS < (1u << (64 - FM_ST_TIE_SHIFT - 20)) && FM_RANK_MAX < (1u << FM_ST_TIE_SHIFT),
              "SelectState fields hold their counts");
#define FM_GROUP_MAX 512    // a boundary group this small is ranked by counting


__device__ __forceinline__ u64 key64(u32 skey, u32 id) { return ((u64)skey << 32) | (u64)(0xFFFFFFFFu - id); }

// Within 64 bins h[0..64) (the caller's view), the bin b with
// count(> b) < want <= count(>= b), the count above it and its own. One
// warp, every lane gets the result; lane l holds bins 63 - 2l and 62 - 2l.
__device__ __forceinline__ u32 warp_threshold64(u32 hi_bin, u32 lo_bin, u32 want, u32* above_out, u32* count_out) {
    const u32 lane = threadIdx.x & 31u;
    const u32 local = hi_bin + lo_bin;
    const u32 incl = warp_inclusive_sum(local);
    const u32 before = incl - local;
    const u32 hit = __ballot_sync(KVS_FULL_MASK, before < want && incl >= want);
    const u32 src = hit ? __ffs(hit) - 1 : 0u;
    const bool upper = before + hi_bin >= want;
    const u32 bin = 63 - 2 * lane - (upper ? 0u : 1u);
    const u32 above = upper ? before : before + hi_bin;
    *above_out = __shfl_sync(KVS_FULL_MASK, above, src);
    *count_out = __shfl_sync(KVS_FULL_MASK, upper ? hi_bin : lo_bin, src);
    return __shfl_sync(KVS_FULL_MASK, bin, src);
}

// The threshold bin: the highest fine bin b with count(bins > b) < want <=
// count(bins >= b), from the coarse bins and then the 64 fine bins of the
// chosen coarse one (two reads by one warp). Returns b and writes the count
// above it and its own. Every thread of the block gets the result.
__device__ u32 threshold_bin(const u32* hist, u32 want, u32* above_out, u32* count_out) {
    __shared__ u32 s_bin, s_above, s_count;
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
        u32 above_c, above_f, count_c, count_f;
        const u32* coarse = hist + FM_HIST;
        const u32 c = warp_threshold64(coarse[63 - 2 * lane], coarse[62 - 2 * lane], want, &above_c, &count_c);
        const u32* fine = hist + c * FM_FINE_PER_COARSE;
        const u32 f = warp_threshold64(fine[63 - 2 * lane], fine[62 - 2 * lane], want - above_c, &above_f, &count_f);
        if (lane == 0) {
            s_bin = c * FM_FINE_PER_COARSE + f;
            s_above = above_c + above_f;
            s_count = count_f;
        }
    }
    __syncthreads();
    *above_out = s_above;
    *count_out = s_count;
    return s_bin;
}

// The digit d of a 256-bin histogram (shared memory) with count(> d) < want
// <= count(>= d), found by one warp (suffix sums over lanes); the result is in
// *s_digit, *s_above after the caller's next __syncthreads.
__device__ void threshold_digit(const u32* h, u32 want, u32* s_digit, u32* s_above) {
    if (threadIdx.x >= 32) return;
    const u32 lane = threadIdx.x;
    const u32 hi = 256 - 8 * lane;  // lane l owns bins [hi - 8, hi), lane 0 the top ones
    u32 local = 0;
#pragma unroll
    for (u32 b = hi - 8; b < hi; ++b) local += h[b];
    const u32 incl = warp_inclusive_sum(local);
    const u32 before = incl - local;
    if (before < want && incl >= want) {
        u32 acc = before;
        for (u32 b = hi; b-- > hi - 8;) {
            if (acc + h[b] >= want) {
                *s_digit = b;
                *s_above = acc;
                break;
            }
            acc += h[b];
        }
    }
}

// How many of x[0..m) (shared memory) exceed k; four independent loads per
// step keep the shared-memory pipeline busy.
__device__ __forceinline__ u32 count_greater(const u64* x, u32 m, u64 k) {
    u32 r0 = 0, r1 = 0, r2 = 0, r3 = 0, j = 0;
    for (; j + 4 <= m; j += 4) {
        const u64 a = x[j], b = x[j + 1], c = x[j + 2], d = x[j + 3];
        r0 += a > k;
        r1 += b > k;
        r2 += c > k;
        r3 += d > k;
    }
    for (; j < m; ++j) r0 += x[j] > k;
    return (r0 + r1) + (r2 + r3);
}

// counters[bin]++ for the calling lanes with `valid`, returning each one's
// old count plus its rank among the lanes of its warp with the same bin: one
// shared atomic per distinct bin and warp (same-address atomics serialise,
// and winners or ties often share a bin). Any subset of a warp may call it.
__device__ __forceinline__ u32 count_in_bin(u32* counters, u32 bin, bool valid) {
    const u32 mask = __activemask();
    const u32 peers = __match_any_sync(mask, valid ? bin : 0xFFFFFFFFu);
    const u32 lane = threadIdx.x & 31u, leader = __ffs(peers) - 1;
    u32 base = 0;
    if (valid && lane == leader) base = atomicAdd(&counters[bin], (u32)__popc(peers));
    base = __shfl_sync(mask, base, leader);
    return base + __popc(peers & ((1u << lane) - 1u));
}

// list[(*count)++] = k for the calling lanes with p, one shared atomic per
// warp (same-address atomics serialise). Lanes that reach it together are
// aggregated; any subset of a warp may call it.
__device__ __forceinline__ void push_key(u64* list, u32* count, u64 k, bool p) {
    const u32 mask = __activemask();
    const u32 b = __ballot_sync(mask, p);
    if (!b) return;
    const u32 lane = threadIdx.x & 31u, leader = __ffs(b) - 1;
    u32 base = 0;
    if (lane == leader) base = atomicAdd(count, (u32)__popc(b));
    base = __shfl_sync(mask, base, leader);
    if (p) list[base + __popc(b & ((1u << lane) - 1u))] = k;
}

// Narrows keys[0..m) (global memory, written by the previous launch, read
// through L2; all equal above bit `shift`) to their top `want` by key64:
// 8-bit radix passes append the certain keys to fin (at *nfin) until the
// boundary group holds at most FM_GROUP_MAX keys, which are then ranked by
// counting. One block; every thread must call it.
__device__ __forceinline__ void narrow_topk(const u64* keys, u32 m, u32 want, int shift, u64* fin, u32* nfin) {
    __shared__ u32 s_hist[256];
    __shared__ u32 s_digit, s_above, s_cnt;
    __shared__ u64 s_group[FM_GROUP_MAX];
    u64 prefix = 0, mask = 0;
    u32 group = m;
    while (group > FM_GROUP_MAX && shift > 0) {
        shift = shift >= 8 ? shift - 8 : 0;
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) s_hist[i] = 0;
        __syncthreads();
        for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
            const u64 k = __ldcg(keys + i);
            count_in_bin(s_hist, (u32)(k >> shift) & 0xffu, (k & mask) == prefix);
        }
        __syncthreads();
        threshold_digit(s_hist, want, &s_digit, &s_above);
        __syncthreads();
        const u32 digit = s_digit;
        for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
            const u64 k = __ldcg(keys + i);
            push_key(fin, nfin, k, (k & mask) == prefix && ((k >> shift) & 0xffu) > digit);
        }
        want -= s_above;
        group = s_hist[digit];
        prefix |= (u64)digit << shift;
        mask |= (u64)0xff << shift;
        __syncthreads();
    }
    // The boundary group (at most FM_GROUP_MAX keys: key64s are unique, so a
    // group with all 64 bits fixed has one key) into shared memory, ranked.
    if (threadIdx.x == 0) s_cnt = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < m; i += blockDim.x) {
        const u64 k = __ldcg(keys + i);
        push_key(s_group, &s_cnt, k, (k & mask) == prefix);
    }
    __syncthreads();
    const u32 g = s_cnt;
    for (u32 i = threadIdx.x; i < g; i += blockDim.x) {
        const u64 k = s_group[i];
        const u32 r = count_greater(s_group, g, k);
        push_key(fin, nfin, k, r < want);
    }
    __syncthreads();
}

// Grid: (ceil(n / (FM_SEL_THREADS * FM_SEL_ITEMS)), sequences), FM_SEL_THREADS
// threads. `err` is read by fm_order (the two take the same parameters).
extern "C" __global__ void __launch_bounds__(FM_SEL_THREADS) fm_select(SelectBatch B, const u32* err) {
    __shared__ u32 s_base_sure, s_base_tie;
    wait_prerequisites();  // skey and hist come from the scoring kernel
    allow_dependents();
    const SelectSeq& S = B.seq[blockIdx.y];
    const u32 n = S.n;
    const u32 want = min(B.k, n);
    const u32 lo = blockIdx.x * (FM_SEL_THREADS * FM_SEL_ITEMS);
    u32 skeys[FM_SEL_ITEMS];
#pragma unroll
    for (u32 j = 0; j < FM_SEL_ITEMS; ++j) {  // in flight while the threshold is found
        const u32 c = lo + j * FM_SEL_THREADS + threadIdx.x;
        skeys[j] = c < n ? S.skey[c] : 0u;
    }
    u32 n_sure, n_tie;
    const u32 b1 = threshold_bin(S.hist, want, &n_sure, &n_tie);
    if (blockIdx.x == 0 && threadIdx.x == 0) S.st->filed = (u64)n_sure | ((u64)n_tie << FM_ST_TIE_SHIFT);
    // 0 = out, 1 = tie, 2 = sure; counts packed sure | tie << 16 (< 2^16 each per block).
    u32 cls[FM_SEL_ITEMS], packed = 0;
#pragma unroll
    for (u32 j = 0; j < FM_SEL_ITEMS; ++j) {
        const u32 c = lo + j * FM_SEL_THREADS + threadIdx.x;
        const u32 b = skeys[j] >> (32 - FM_HIST_BITS);
        cls[j] = c >= n ? 0u : (b > b1 ? 2u : (b == b1 ? 1u : 0u));
        packed += cls[j] == 2u ? 1u : (cls[j] == 1u ? 0x10000u : 0u);
    }
    u32 total;
    const u32 at = block_exclusive_sum(packed, &total);
    if (total == 0) return;  // uniform: nothing to file
    if (threadIdx.x == 0) {
        const u64 old = atomicAdd(&S.st->appended, (u64)(total & 0xffffu) | ((u64)(total >> 16) << FM_ST_TIE_SHIFT));
        s_base_sure = st_sure(old);
        s_base_tie = st_tie(old);
    }
    __syncthreads();
    u32 at_sure = s_base_sure + (at & 0xffffu), at_tie = s_base_tie + (at >> 16);
#pragma unroll
    for (u32 j = 0; j < FM_SEL_ITEMS; ++j) {
        const u32 c = lo + j * FM_SEL_THREADS + threadIdx.x;
        if (cls[j] == 2u) S.sure[at_sure++] = key64(skeys[j], c);
        else if (cls[j] == 1u) S.tie[at_tie++] = key64(skeys[j], c);
    }
}

// Grid: (FM_ORDER_MAX / FM_ORDER_CANDS, sequences), FM_ORDER_THREADS threads.
// Block x ranks candidates [x * FM_ORDER_CANDS, (x + 1) * FM_ORDER_CANDS)
// (sure keys first, then ties): FM_ORDER_SLICES threads per candidate count
// the keys of its group above it, one slice of the group each. Keys are
// unique, so the ranks are distinct.
#define FM_ORDER_MAX 4096
#define FM_ORDER_CANDS 64
#define FM_ORDER_SLICES 8
#define FM_ORDER_THREADS (FM_ORDER_CANDS * FM_ORDER_SLICES)
static_assert(FM_ORDER_MAX % FM_ORDER_CANDS == 0 && FM_ORDER_MAX >= FM_RANK_MAX, "whole blocks of candidates");

// More than FM_ORDER_MAX candidates: one block narrows the ties to the
// `want - ns` best and ranks the `want` winners (fin: FM_RANK_MAX keys of
// shared memory) among themselves.
__device__ void order_narrowed(const SelectSeq& S, u32 ns, u32 nt, u32 want, u64* fin) {
    __shared__ u32 s_nfin;
    for (u32 i = threadIdx.x; i < ns; i += blockDim.x) fin[i] = __ldcg(S.sure + i);
    if (threadIdx.x == 0) s_nfin = ns;
    __syncthreads();
    // Ties share the top FM_HIST_BITS bits of the 64-bit key.
    narrow_topk(S.tie, nt, want - ns, 64 - FM_HIST_BITS, fin, &s_nfin);
    for (u32 i = threadIdx.x; i < want; i += blockDim.x)
        S.out[count_greater(fin, want, fin[i])] = (i32)(0xFFFFFFFFu - (u32)fin[i]);
}

extern "C" __global__ void __launch_bounds__(FM_ORDER_THREADS) fm_order(SelectBatch B, const u32* err) {
    __shared__ u64 keys[FM_ORDER_MAX];
    __shared__ u32 part[FM_ORDER_SLICES][FM_ORDER_CANDS];
    wait_prerequisites();  // fm_select has filed and published the candidates
    const SelectSeq& S = B.seq[blockIdx.y];
    const u32 want = min(B.k, S.n);
    const u64 filed = __ldcg(&S.st->filed);
    if (blockIdx.x == 0) {
        // fm_select is done with the histogram and the append counters, and
        // no block of this launch reads them: zero them for the next call.
        for (u32 i = threadIdx.x; i < FM_HIST_WORDS; i += blockDim.x) S.hist[i] = 0;
        if (threadIdx.x == 0) S.st->appended = 0;
        for (u32 i = (err[0] != 0 ? 0u : want) + threadIdx.x; i < B.k; i += blockDim.x) S.out[i] = -1;
    }
    if (err[0] != 0) return;  // a recorded error: no garbage, all -1 (above)
    const u32 ns = st_sure(filed), nt = st_tie(filed), m = ns + nt;
    if (m > FM_ORDER_MAX) {
        if (blockIdx.x == 0) order_narrowed(S, ns, nt, want, keys);
        return;
    }
    const u32 c0 = blockIdx.x * FM_ORDER_CANDS;
    if (c0 >= m) return;
    // The groups this block's candidates belong to: keys [lo, hi).
    const u32 c1 = min(c0 + FM_ORDER_CANDS, m);
    const u32 lo = c0 < ns ? 0u : ns, hi = c1 > ns ? m : ns;
    for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x)
        keys[i - lo] = i < ns ? __ldcg(S.sure + i) : __ldcg(S.tie + (i - ns));
    __syncthreads();
    const u32 slot = threadIdx.x % FM_ORDER_CANDS, slice = threadIdx.x / FM_ORDER_CANDS;
    const u32 c = c0 + slot;
    u32 above = 0;
    if (c < c1) {
        const u64 key = keys[c - lo];
        const u32 g0 = c < ns ? 0u : ns, g1 = c < ns ? ns : m;  // its group
        const u32 per = (g1 - g0 + FM_ORDER_SLICES - 1) / FM_ORDER_SLICES;
        const u32 a = min(g0 + slice * per, g1), z = min(a + per, g1);
        above = count_greater(keys + (a - lo), z - a, key);
    }
    part[slice][slot] = above;
    __syncthreads();
    if (slice == 0 && c < c1) {
        u32 rank = c < ns ? 0u : ns;
#pragma unroll
        for (u32 i = 0; i < FM_ORDER_SLICES; ++i) rank += part[i][slot];
        if (rank < want) S.out[rank] = (i32)(0xFFFFFFFFu - (u32)keys[c - lo]);
    }
}
