// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

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
    u16 id[FM_MAX_BATCH];  // each sequence's index in the caller's batch (error records)
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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(saddr), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 saddr, const void* g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(g) : "memory");
}
// The copies write shared memory behind the compiler's back: "memory" keeps
// them (and the commits) in place relative to the barriers that hand a ring
// slot from its readers to its next copy.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
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
    static_assert((FM_Q_BYTES + 2 * FM_TILE_BYTES + FM_SCORERS * FM_HGROUPS * FM_TILE * 4) % 16 == 0, "flush_hist reads 16-byte aligned bins");
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
            // (No pair of n-tiles at 8 heads per warp: the loop's test is then
            // np < 0, which NVRTC calls pointless.)
#pragma nv_diag_suppress 186
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
#pragma nv_diag_default 186
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
                // fp8: a scale above 1 in magnitude multiplies the scorer
                // sums below and its sign each product here, any other scale
                // each product (scale_split_raw).
                const float scale = (B.dtype == FM_KEYS_FP8_E4M3 && chunk < S.n) ? S.scales[chunk] : 1.f;
                const float pre = scale_split_raw(scale).x;
                float s = 0.f;
                bool finite = isfinite(scale);
#pragma unroll
                for (u32 nt = 0; nt < FM_WHEADS / 8; ++nt) {
#pragma unroll
                    for (u32 j = 0; j < 2; ++j) {
                        const float x = acc[m][nt][half * 2 + j] * pre;
                        finite &= isfinite(x);  // a non-finite key or scale, or an overflow
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
            const float post = (B.dtype == FM_KEYS_FP8_E4M3 && valid) ? scale_split_raw(S.scales[chunk]).y : 1.f;
            float ens = 0.f;
#pragma unroll
            for (u32 i = 0; i < FM_SCORERS; ++i) {
                float si = 0.f;
#pragma unroll
                for (u32 g = 0; g < FM_HGROUPS; ++g) si += valid ? sh_part[(i * FM_HGROUPS + g) * FM_TILE + row] : 0.f;
                si *= post;  // an overflow here is the score's own: caught below
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
    if (bad) record_error(err, FM_ERR_SCORE, bad_chunk, B.id[blockIdx.y]);
    allow_dependents();  // the selection may start launching as blocks finish
    __syncthreads();
    flush_hist(sh_hist, S.hist);
}
