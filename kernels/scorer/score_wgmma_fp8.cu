// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

// ------------------------------- scoring fp8 keys with wgmma (Hopper, sm_90a)

#if defined(FM_WGMMA) && (FM_HEAD_DIM == 64 || FM_HEAD_DIM == 128)
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
// The upper two bytes of `four`: their 16-bit half goes to cvt as it is, so
// ptxas reads it with a .H1 operand selector instead of shifting it down first.
__device__ __forceinline__ u32 e4m3x2_hi_to_f16x2(u32 four) {
    u32 h2;
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(h2) : "r"(four));
    return h2;
}

// The head weights of n-tile j's two columns of this thread, from shared memory.
__device__ __forceinline__ float2 sh_weights(const float* sh_w, u32 lane, u32 j) { return *(const float2*)(sh_w + j * 8 + 2 * (lane & 3u)); }

// Both rows of this thread, before the positive path: when some row of the
// warp has a scale that is not positive and finite (zero, negative,
// non-finite; a warp-uniform test), each row's scale is split as
// scale_split (sign, |scale|), the first factor multiplied into the row's
// accumulators in place, as relu(scale * x) = |scale| * relu(sign * x), and
// `scale` replaced by the second (|scale|, or 1), positive and finite: every
// row then takes the positive path, which never forms a head's scale * dot
// product (it can lie above the float range where the weighted score does
// not). A non-finite scale leaves the row's accumulators non-finite (x *
// inf, 0 * inf), so the positive path's check of d finds it. (The fp8-query
// kernel makes the same test before its MMAs' wait and calls this only when
// it fails.)
__device__ __forceinline__ void wg8_split_rows(float* d, float* scale) {
    if (__all_sync(KVS_FULL_MASK, positive_finite(scale[0]) && positive_finite(scale[1]))) return;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const float2 f = scale_split(scale[h]);
        scale[h] = f.y;
#pragma unroll
        for (u32 j = 0; j < FM_QROWS / 8; ++j) {
            d[4 * j + 2 * h] *= f.x;
            d[4 * j + 2 * h + 1] *= f.x;
        }
    }
}

// Both rows of this thread when every row of the warp has a positive finite
// scale: relu(scale * x) = scale * relu(x), so each scorer's sum of w * relu(x)
// is taken over the raw dot products and multiplied once by scale * 2^-e
// (when that product is not a normal float for some row of the warp, by
// scaled_sum): two instructions per accumulator instead of three, and one
// head weight load for both rows.
__device__ __forceinline__ void wg8_rows_score_pos(const float* d, const float* sh_w, u32 lane, const float* scale, float inv, int e,
                                                   bool mean, float* ens, bool* finite) {
    float c[2];
    bool normal = true;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        c[h] = scale[h] * inv;
        normal &= c[h] >= 1.17549435e-38f && c[h] <= 3.40282347e38f;
        finite[h] = isfinite(d[2 * h]);
    }
    if (__all_sync(KVS_FULL_MASK, normal))
        head_sums<2>(
            d, 0, [&](u32 j) { return sh_weights(sh_w, lane, j); }, [](u32, float a) { return a; },
            [&](u32 h, u32, float si) { return si * c[h]; }, mean, ens, finite);
    else
        head_sums<2>(
            d, 0, [&](u32 j) { return sh_weights(sh_w, lane, j); }, [](u32, float a) { return a; },
            [&](u32 h, u32, float si) { return scaled_sum(si, scale[h], -e); }, mean, ens, finite);
}

// Starts the copy of fp8 rows [c0, c0 + WG_ROWS) into a raw tile (as
// wg_issue) and of their f32 scales into `sc`, as one cp.async group: the
// epilogue then reads the scales from shared memory instead of waiting on
// global loads. Scales of rows past n are not copied (nor read).
__device__ __forceinline__ void wg8_issue(const u8* keys, const float* scales, u32 stride, u32 n, u32 t0, u32 c0, bool valid, u8* dst,
                                          float* sc) {
    if (valid) {
        if (t0 < WG_ROWS && c0 + t0 < n) cp_async4(smem_addr(sc + t0), scales + c0 + t0);
        wg_copy_rows<FM_HEAD_DIM / 16, FM_HEAD_DIM>(keys, stride, n, t0, c0, dst, raw_at);
    }
    cp_async_commit();
}

// Development timeline of fm_score_wg_fp8 and fm_score_wg_fp8q (each with its
// own phases; KVSWAP_FM_DEFINES=-DFM_TRACE; the default build has none of it): SM cycles per phase, summed by lane 0 of
// every warp in shared memory, then over the grid in fm_tr; fm_order, the
// last kernel of a call, prints the sums of every 97th call and resets them
// (a printf here would make ptxas serialise the MMAs).
// fm_score_wg_fp8q's refill is stamped apart from the MMA issue: with TMA one
// thread of warp 0 issues it, so its per-warp-tile figure is a quarter of
// warp 0's. Its epilogue is stamped after the relu fragments and after
// the head sums' wait only with the wgmma head sums (FM_Q8_WGHS: 192 query
// rows); other shapes print 0 for those two and the whole epilogue as rest.
#ifdef FM_TRACE
#define TR_PHASES 14
__device__ unsigned long long fm_tr[TR_PHASES + 2];  // phases, warp-tiles, warps
__device__ u32 fm_tr_calls;
__device__ u32 fm_tr_kind;  // the kernel that filled fm_tr: 1 fm_score_wg_fp8, 2 fm_score_wg_fp8q
// Each warp's sums in shared memory: lane 0 zeroes and sums its own row.
#define TR_SHARED                                          \
    __shared__ u32 sh_tr[WG_THREADS / 32][TR_PHASES];      \
    if ((threadIdx.x & 31u) == 0)                          \
        for (u32 i = 0; i < TR_PHASES; ++i) sh_tr[threadIdx.x >> 5][i] = 0;
#define TR_START u32 tr_t = (u32)clock();
#define TR(i)                                                   \
    do {                                                        \
        const u32 t_ = (u32)clock();                            \
        if (lane == 0) sh_tr[warp][i] += t_ - tr_t;             \
        tr_t = t_;                                              \
    } while (0)
__device__ __forceinline__ void trace_flush(u32 (*sh_tr)[TR_PHASES], u32 my_tiles, u32 kind) {
    __syncthreads();
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    if (lane == 0) {
        for (u32 i = 0; i < TR_PHASES; ++i) atomicAdd(&fm_tr[i], (unsigned long long)sh_tr[warp][i]);
        atomicAdd(&fm_tr[TR_PHASES], (unsigned long long)my_tiles);
        atomicAdd(&fm_tr[TR_PHASES + 1], 1ull);
    }
    if (threadIdx.x == 0) fm_tr_kind = kind;
}
#define FM_TRACE_REPORT
__device__ __forceinline__ void fm_trace_report() {
    volatile unsigned long long* t = fm_tr;
    if (t[TR_PHASES + 1] == 0) return;  // no fp8 scoring since the last report
    const double tiles = (double)t[TR_PHASES], warps = (double)t[TR_PHASES + 1];
    if (fm_tr_calls++ % 97 == 0) {
        if (fm_tr_kind == 2)
            printf("FMTRACE fp8q cycles per warp: prologue+q-load %.0f quantize %.0f E+weights+sync %.0f | per warp-tile (%.2f tiles/warp): "
                   "wait+fence+barrier %.0f scales %.0f turn %.0f mma-issue %.0f refill %.0f mma-wait %.0f epilogue: to relu %.0f head sums %.0f rest %.0f | per warp: end %.0f flush %.0f\n",
                   t[0] / warps, t[1] / warps, t[2] / warps, tiles / warps, t[3] / tiles, t[4] / tiles, t[5] / tiles, t[13] / tiles, t[6] / tiles, t[7] / tiles,
                   t[9] / tiles, t[12] / tiles, t[8] / tiles, t[10] / warps, t[11] / warps);
        else
            printf("FMTRACE fp8 cycles per warp: prologue issue+prereq %.0f q-load+max %.0f q-store+sync %.0f | per warp-tile (%.2f tiles/warp): "
                   "wait+barrier %.0f issue %.0f fragments %.0f turn %.0f mma-first %.0f mma-rest %.0f mma-wait %.0f epilogue %.0f | per warp: "
                   "end barrier %.0f flush %.0f\n",
                   t[0] / warps, t[1] / warps, t[2] / warps, tiles / warps, t[3] / tiles, t[4] / tiles, t[5] / tiles, t[6] / tiles,
                   t[12] / tiles, t[7] / tiles, t[8] / tiles, t[9] / tiles, t[10] / warps, t[11] / warps);
    }
    for (u32 i = 0; i < TR_PHASES + 2; ++i) t[i] = 0;
}
#else
#define TR_SHARED
#define TR_START
#define TR(i)
#endif

// Grid, threads and shared memory as fm_score_wg with fp8 keys, plus the head
// weights; the compute tile of each warpgroup holds its ring's scales instead.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg_fp8(ScoreBatch B, u32* err) {
    __shared__ __align__(16) u32 sh_hist[FM_HIST];
    __shared__ float sh_w[FM_QROWS];
    __shared__ u32 sh_max[WG_THREADS / 32];
    TR_SHARED
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
    float* sc_ring = (float*)(ring + WG_STAGES * WG_RAW_BYTES);  // WG_STAGES x WG_ROWS scales
    static_assert(WG_STAGES * WG_ROWS * 4 <= WG_SUB_BYTES, "the scales fit the unused compute tile");
    TR_START

    const WgTiles T = wg_tiles(n, g);
    const u32 step = T.step, first = T.first, my_tiles = T.mine, next = T.next, next_turns = T.next_turns;
    // Tile 0 is loaded before waiting for the projection (keys are inputs of
    // the call, q and w its outputs), tile 1 after Q is converted and tile 2
    // by next_tile(0): every block starts at once, and its first tiles and Q
    // share L2.
    wg8_issue(keys, S.scales, stride, n, t0, first * WG_ROWS, my_tiles > 0, ring, sc_ring);
    wait_prerequisites();
    TR(0);
    // Q: four bf16 (one physical group) per item, held while max |q| is found.
    // Item j of this thread is threadIdx.x + j * WG_THREADS: row q_r0 + j *
    // Q_RSTEP, the same four dims p of every row (WG_THREADS is a multiple of
    // the items per row).
    constexpr u32 Q_ITEMS = FM_QROWS * FM_HEAD_DIM / 4, Q_IPR = FM_HEAD_DIM / 4, Q_RSTEP = WG_THREADS / Q_IPR;
    constexpr u32 Q_PER = (Q_ITEMS + WG_THREADS - 1) / WG_THREADS;
    static_assert(WG_THREADS % Q_IPR == 0 && Q_RSTEP % 4 == 0, "Q items: whole rows per pass, rows step by 4 mod 8");
    // Only a last, partial pass has items past the end.
    auto q_item = [&](u32 j) { return Q_ITEMS % WG_THREADS == 0 || j + 1 < Q_PER || threadIdx.x + j * WG_THREADS < Q_ITEMS; };
    uint2 qv[Q_PER];
    u32 qmax = 0;  // largest |q| as bf16 bits (monotonic for non-negative values; NaN above Inf)
#pragma unroll
    for (u32 j = 0; j < Q_PER; ++j) {
        qv[j] = q_item(j) ? *(const uint2*)(S.q + (u64)(threadIdx.x + j * WG_THREADS) * 4) : make_uint2(0, 0);
        qmax = max(qmax, max(max(qv[j].x & 0x7fffu, (qv[j].x >> 16) & 0x7fffu), max(qv[j].y & 0x7fffu, (qv[j].y >> 16) & 0x7fffu)));
    }
    for (u32 i = threadIdx.x; i < FM_HIST; i += WG_THREADS) sh_hist[i] = 0;
    for (u32 i = threadIdx.x; i < FM_QROWS; i += WG_THREADS) sh_w[i] = S.w[i];
    qmax = __reduce_max_sync(KVS_FULL_MASK, qmax);
    if (lane == 0) sh_max[warp] = qmax;
    __syncthreads();
    TR(1);
    qmax = 0;
#pragma unroll
    for (u32 w = 0; w < WG_THREADS / 32; ++w) qmax = max(qmax, sh_max[w]);
    // 2^e with max |q| * 2^e in [2^14, 2^15); none for zero or non-finite q
    // (a non-finite q makes the scores non-finite: an error either way).
    const int qexp = (int)((qmax >> 7) & 0xffu);
    const int e = (qmax == 0 || qexp == 0xff) ? 0 : min(126, max(-126, 141 - max(qexp, 1)));
    const float qscale = __int_as_float((127 + e) << 23), inv = __int_as_float((127 - e) << 23);
    {
        // Dims p, p + 1 go to logical k, k + 1 and p + 2, p + 3 to k + 8, k + 9
        // (half h); their byte in the swizzled Q of row r is sw128(r, kk / 8) +
        // (kk % 8) * 2, where r % 8 = (q_r0 % 8) ^ (j * Q_RSTEP % 8) and
        // j * Q_RSTEP % 8 is 0 or 4: four base addresses (half, parity), and
        // item j adds j * Q_RSTEP rows.
        const u32 q_r0 = threadIdx.x / Q_IPR, k = fp8_logical_k((threadIdx.x % Q_IPR) * 4);
        u8* q_at[2][2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h)
#pragma unroll
            for (u32 par = 0; par < 2; ++par) {
                const u32 kk = k + 8 * h, c = kk / 8;
                q_at[h][par] = sh_q + (c >> 3) * (FM_QROWS * 128u) + q_r0 * 128u + ((((c & 7u) ^ (q_r0 & 7u)) ^ (4u * par)) << 4) + (kk % 8) * 2;
            }
#pragma unroll
        for (u32 j = 0; j < Q_PER; ++j) {
            if (!q_item(j)) break;
            const u32 w[2] = {qv[j].x, qv[j].y};
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const float lo = bf16_to_f32((u16)(w[h] & 0xffffu)) * qscale, hi = bf16_to_f32((u16)(w[h] >> 16)) * qscale;
                u32 packed;
                asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
                *(u32*)(q_at[h][(j * Q_RSTEP) & 4u ? 1 : 0] + j * Q_RSTEP * 128u) = packed;
            }
        }
    }
    for (u32 i = 1; i < WG_STAGES - 1; ++i)
        wg8_issue(keys, S.scales, stride, n, t0, (first + i * step) * WG_ROWS, i < my_tiles, ring + i * WG_RAW_BYTES, sc_ring + i * WG_ROWS);
    fence_async_smem();  // Q (generic stores) -> tensor-core reads (tile 0 is waited for by next_tile(0))
    __syncthreads();
    bool bad = false;
    u32 bad_chunk = 0;
    const u64 db0 = gmma_desc(smem_addr(sh_q));
    // This thread's A rows in a tile and its byte segment in them.
    const u32 ra = (warp & 3u) * 16 + (lane >> 2), rb = ra + 8, tq = lane & 3u;
    // The accumulators live across tiles: each tile's first MMA overwrites
    // them (scale-d 0), so they are not cleared while holding the turn.
    float d[FM_QROWS / 2];
#pragma unroll
    for (u32 k = 0; k < FM_QROWS / 2; ++k) d[k] = 0.f;
    if (g == WG_GROUPS - 1 && T.first_turns > 0) turn_pass(WG_ORDER_BAR);
    TR(2);
    // Waits for tile i and refills the slot of tile i - 1 with tile
    // i + WG_STAGES - 1. Tile 0's before the loop; every later tile's while
    // the MMAs of the tile before it run (the A registers and the scales of
    // that tile are read by then; the barrier orders those reads before the
    // refill).
    auto next_tile = [&](u32 i) {
        cp_async_wait_stages();
        wg_barrier(g);  // tile i has landed; every thread is done with tile i - 1's slot
        TR(3);
        const u32 ahead = i + WG_STAGES - 1;
        wg8_issue(keys, S.scales, stride, n, t0, (first + ahead * step) * WG_ROWS, ahead < my_tiles, ring + (ahead % WG_STAGES) * WG_RAW_BYTES,
                  sc_ring + (ahead % WG_STAGES) * WG_ROWS);
        TR(4);
    };
    if (my_tiles > 0) next_tile(0);
    for (u32 i = 0; i < my_tiles; ++i) {
        const u32 c0 = (first + i * step) * WG_ROWS;
        const u8* slot = ring + (i % WG_STAGES) * WG_RAW_BYTES;
        const float* sc = sc_ring + (i % WG_STAGES) * WG_ROWS;
        // A fragments of all k steps: row ra / rb, bytes [WG8_SEG * tq, + WG8_SEG).
        u32 a[FM_KSTEPS][4];
#pragma unroll
        for (u32 q = 0; q < WG8_SEG / 16; ++q) {
            const u32 c = (WG8_SEG / 16) * tq + q;
            const uint4 va = *(const uint4*)(slot + raw_at(ra, c));
            const uint4 vb = *(const uint4*)(slot + raw_at(rb, c));
            const u32 wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
            for (u32 x = 0; x < 4; ++x) {
                const u32 ks = 4 * q + x;
                a[ks][0] = e4m3x2_to_f16x2(wa[x]);        // row ra, k 2t, 2t + 1
                a[ks][1] = e4m3x2_to_f16x2(wb[x]);        // row rb
                a[ks][2] = e4m3x2_hi_to_f16x2(wa[x]);     // row ra, k 2t + 8, 2t + 9
                a[ks][3] = e4m3x2_hi_to_f16x2(wb[x]);     // row rb
            }
        }
        TR(5);
        turn_wait(WG_ORDER_BAR + g);
        TR(6);
        wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < FM_KSTEPS; ++ks) {
            const u32 kb = ks >> 2, within = (ks & 3u) * 32u;
            const u64 db = db0 + ((kb * (FM_QROWS * 128u) + within) >> 4);
            wgmma_rs_row(d, a[ks], db, ks > 0 ? 1u : 0u);
#ifdef FM_TRACE
            if (ks == 0) TR(12);
#endif
        }
        wgmma_commit();
        if (i < next_turns) turn_pass(WG_ORDER_BAR + next);
        TR(7);
        // The rows' scales (landed with the tile), read while the MMAs run.
        const u32 chunks[2] = {c0 + ra, c0 + rb}, rows[2] = {ra, rb};
        float scales[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) scales[h] = chunks[h] < n ? sc[rows[h]] : 1.f;
        if (i + 1 < my_tiles) next_tile(i + 1);
        wgmma_wait0();
        TR(8);

        wg8_split_rows(d, scales);  // every row on the positive path
        {
            float ens[2];
            bool finite[2];
            wg8_rows_score_pos(d, sh_w, lane, scales, inv, e, mean, ens, finite);
#pragma unroll
            for (u32 h = 0; h < 2; ++h) wg_file_score(ens[h], finite[h], chunks[h] < n, chunks[h], (lane & 3u) == 0, S, sh_hist, bad, bad_chunk);
        }
        TR(9);
    }
    wg_scores_done(B, err, bad, bad_chunk);
    TR(10);
    flush_hist(sh_hist, S.hist);
#ifdef FM_TRACE
    TR(11);
    trace_flush(sh_tr, my_tiles, 1);
#endif
}

#if FM_HEAD_DIM == 128
// ------------------------------------------- fp8 keys x the fp8 query
//
// fm_score_wg_fp8q: fp8 keys scored with the fp8 query (the default for fp8
// keys; reference::fp8_query): each head's bf16 q scaled by 2^-e_h (e_h the
// smallest e with max |q_h| <= 448 * 2^e) and rounded to e4m3 once per
// block, then fp8 x fp8 wgmma (m64nNk32: half the tensor work of the 16-bit
// kernels) with both operands read from shared memory: the raw key tile is
// already the 128-byte-swizzled K-major layout (one 128-byte row per chunk,
// 16-byte chunk c of row r at c ^ (r % 8): raw_at), so keys go from the
// cp.async ring to the tensor cores with no conversion. The dot products
// q8 . k8 are exact products summed in the tensor core's f32 accumulator.
//
// Epilogue: w_h * 2^e_h * relu(scale * d) for each head, where 2^e_h is
// folded into the head weight as w_h * 2^(e_h - E) (E the scorer's largest
// e_h, exact unless that product leaves the normal range) and 2^E into the
// scorer's sum with the chunk's scale: c = scale * 2^E when 2^E and c are
// normal floats (one multiply per scorer sum), else the sum times scale and
// 2^E in two steps (scaled_sum). Other scales (zero, negative, non-finite)
// are split into the accumulators first (wg8_split_rows).
#define WG8Q_Q_BYTES (FM_QROWS * FM_HEAD_DIM)                  // Q: e4m3, 128-byte rows
#define WG8Q_GROUP_BYTES (WG_STAGES * WG_RAW_BYTES + 1024)     // raw tiles + their scales, 1024-aligned
#define WG8Q_ZERO_HEAD (-100000)                               // e of an all-zero head: left out of E
#define WG8Q_BAD_HEAD 0x7fffffff                               // e of a head with a non-finite q
static_assert(WG_STAGES * WG_ROWS * 4 <= 1024, "the scales of the ring fit its last KiB");
static_assert(WG8Q_Q_BYTES % 1024 == 0, "the rings start 1024-aligned");

// fm_score_wg_fp8q's head weights: column i = 8j + 2t + b (n-tile j, quad
// lane t, b = 0, 1) at [(j / 2) * 16 + t * 4 + (j % 2) * 2 + b], so that
// n-tiles 2m and 2m + 1 of quad lane t are one float4.
__device__ __forceinline__ u32 wq_at(u32 i) {
    const u32 j = i >> 3, t = (i >> 1) & 3u, b = i & 1u;
    return (j >> 1) * 16u + t * 4u + (j & 1u) * 2u + b;
}
__device__ __forceinline__ float2 wq_weights(const float* sh_w, u32 lane, u32 j) {
    const float4 w4 = *(const float4*)(sh_w + (j >> 1) * 16u + (lane & 3u) * 4u);  // both n-tiles' loads are one
    return (j & 1u) ? make_float2(w4.z, w4.w) : make_float2(w4.x, w4.y);
}

// FM_Q8_TC: the tensor-core head sums, where every k-step of 16 (scorer,
// head) columns lies within one scorer (FM_HEADS a multiple of 16) and each
// scorer's 4 accumulators fit the register budget (up to 4 scorers); other
// shapes, and -DFM_Q8_FMA_HEADSUM (development: to time the two side by
// side), keep the FMA path.
#if !defined(FM_Q8_FMA_HEADSUM) && FM_SCORERS <= 4 && FM_HEADS % 16 == 0
#define FM_Q8_TC 1
#endif
// FM_Q8_WGHS: at 192 query rows the head sums are wgmma m64n8k16 with A
// from registers (below; 0.15-0.55 us faster per call than mma.sync on an
// H200, NOTES s39); other row counts keep mma.sync (their accumulators and
// A operands do not fit the register cap side by side), as does
// -DFM_Q8_HMMA_HEADSUM (development: to time the two side by side).
#undef FM_Q8_WGHS
#if defined(FM_Q8_TC) && FM_QROWS == 192 && !defined(FM_Q8_HMMA_HEADSUM)
#define FM_Q8_WGHS 1
#endif
#ifdef FM_Q8_TC
// The fast path's head sums on the tensor cores (H200, 3 x 64 x 128, 262,144
// chunks: 28.1 us beside 28.7 us on the FMA path, benches/NOTES.md s34). relu(x) of the accumulators,
// rounded to bf16 two at a time (one cvt.rn.relu.bf16x2 per pair), is the A
// operand of an MMA (a warpgroup's wgmma m64n8k16 at 192 query rows, FM_Q8_WGHS;
// else each warp's mma.sync m16n8k16) whose B holds the head weights of the
// k-step's 16 (scorer, head) columns split into bf16 hi and lo parts: hi in
// every even column, lo in every odd one. A k-step covers one scorer's
// heads (FM_HEADS is a multiple of 16), and each scorer's k-steps accumulate
// into their own registers, so every lane of a quad ends with every
// scorer's hi and lo sums of its two rows: the ensemble needs no shuffle
// between lanes (it took two rounds of shuffles, NOTES s40). The
// accumulators' fragment layout is the A fragment layout, so no data moves
// between lanes. Error per term: bf16 rounding of
// relu(x) (<= u = 2^-8 relative) and of the weights (<= 2^-15 after the
// hi/lo split), within the GPU-vs-reference tolerance's 2u = 2^-7
// (tests/scorer_gpu.rs), of which it takes half.
#define FM_Q8_KSTEPS (FM_HEADS / 16)  // head-sum k-steps per scorer
__device__ __forceinline__ u32 relu_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The head-sum MMA's A fragment of k-step k: relu of the accumulators
// d[8k .. 8k + 8), in bf16 pairs.
__device__ __forceinline__ void relu_a_fragment(const float* d, u32 k, u32* a) {
#pragma unroll
    for (u32 j = 0; j < 4; ++j) a[j] = relu_bf16x2(d[8 * k + 2 * j], d[8 * k + 2 * j + 1]);
}
__device__ __forceinline__ u16 bf16_bits(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
// B value of the head-sum MMA in column n of a weight w's K row: w's hi
// part for even n, its lo part for odd n.
__device__ __forceinline__ float tc_weight(u32 n, float w) {
    // hi by truncation (rounding could carry a weight near the f32 maximum
    // to Inf, and 0 * Inf is NaN); w - hi is exact, |w - hi| < 2^-7 |w|, and
    // rounded to bf16 by bf16_bits. A NaN weight stays NaN in hi or lo.
    const float hi = __uint_as_float(__float_as_uint(w) & 0xffff0000u);
    return n % 2 == 0 ? hi : w - hi;
}
#ifdef FM_Q8_WGHS
// The head sums as wgmma m64n8k16 with A from registers (the relu'd bf16
// pairs, in the accumulators' own layout) and B = the head weights in shared
// memory, K-major without swizzle: core matrices of 8 columns x 8 K rows
// (16 bytes per column), K-adjacent core matrices 128 bytes apart (one
// 8-column group, so the other stride is unused).
__device__ __forceinline__ u64 gmma_desc_plain(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(128 >> 4) << 32);
}
__device__ __forceinline__ void wgmma_hs_n8(float* c, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
// The head sums' wgmmas of one tile, committed as one group: A the relu'd
// fragments a (FM_QROWS / 16 k-steps), B the head weights at dw0, scorer s's
// k-steps into hs[s]. The caller keeps a until the group's wait.
__device__ __forceinline__ void head_sum_mma(const u32 (*a)[4], float (*hs)[4], u64 dw0) {
    wgmma_fence();
#pragma unroll
    for (u32 k = 0; k < FM_QROWS / 16; ++k) wgmma_hs_n8(hs[k / FM_Q8_KSTEPS], a[k], dw0 + k * (256u >> 4), k % FM_Q8_KSTEPS > 0 ? 1u : 0u);
    wgmma_commit();
}
#endif
#endif

#ifdef FM_Q8_TC
// Both rows' ensemble scores from the tensor-core head sums hs (per scorer:
// row ra's hi and lo sums, then row rb's): each scorer's sum times c = scale
// * 2^E where that is a normal float for the whole warp, else the two steps
// of scaled_sum, chosen by one warp-uniform branch for all of them (a select
// per sum compiled to a branch pair per sum: with them, H200, score fp8 at
// 262,144 chunks: +0.6 us, NOTES s44); then max or mean (the mean adds the
// scorers pairwise, (v0 + v1) + (v2 + v3)). finite[h] turns false where a
// scorer's sum is not finite.
__device__ __forceinline__ void tc_ensemble(const float (*hs)[4], const float (*c)[FM_SCORERS], const float* scales, bool normal, const int* E,
                                            bool mean, float* ens, bool* finite) {
    float vs[2][FM_SCORERS];
    if (__all_sync(KVS_FULL_MASK, normal)) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h)
#pragma unroll
            for (u32 sc = 0; sc < FM_SCORERS; ++sc) vs[h][sc] = (hs[sc][2 * h] + hs[sc][2 * h + 1]) * c[h][sc];
    } else {
#pragma unroll
        for (u32 h = 0; h < 2; ++h)
#pragma unroll
            for (u32 sc = 0; sc < FM_SCORERS; ++sc) vs[h][sc] = scaled_sum(hs[sc][2 * h] + hs[sc][2 * h + 1], scales[h], E[sc]);
    }
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const float* v = vs[h];
        bool ok = true;
#pragma unroll
        for (u32 sc = 0; sc < FM_SCORERS; ++sc) ok &= isfinite(v[sc]);
        float x;
        if (mean) {
            float pair[(FM_SCORERS + 1) / 2];
#pragma unroll
            for (u32 p = 0; p < (FM_SCORERS + 1) / 2; ++p) pair[p] = 2 * p + 1 < FM_SCORERS ? v[2 * p] + v[2 * p + 1] : v[2 * p];
            x = pair[0];
#pragma unroll
            for (u32 p = 1; p < (FM_SCORERS + 1) / 2; ++p) x += pair[p];
            x *= 1.f / FM_SCORERS;
        } else {
            x = v[0];
#pragma unroll
            for (u32 sc = 1; sc < FM_SCORERS; ++sc) x = fmaxf(x, v[sc]);
        }
        ens[h] = x;
        finite[h] = finite[h] && ok;
    }
}
#endif

// The tile MMAs of one 64-key tile (its raw fp8 keys in `slot`) against Q
// (descriptor db0) into d, committed as one group: 4 k-steps of 32 bytes.
__device__ __forceinline__ void tile_mma(float* d, const u8* slot, u64 db0) {
    const u64 da0 = gmma_desc(smem_addr(slot));
    wgmma_fence();
#pragma unroll
#ifdef FM_Q8_WGHS
    for (u32 ks = 0; ks < FM_HEAD_DIM / 32; ++ks) {
        if (ks == 0) wgmma8_n192_z(d, da0, db0, 0u);
        else wgmma8_row(d, da0 + ks * 2u, db0 + ks * 2u, 1u);  // +32 bytes
    }
#else
    for (u32 ks = 0; ks < FM_HEAD_DIM / 32; ++ks) wgmma8_row(d, da0 + ks * 2u, db0 + ks * 2u, ks > 0 ? 1u : 0u);  // +32 bytes
#endif
    wgmma_commit();
}

// c[h][s] = scale[h] * 2^E_s (p2E[s]; 0 where 2^E_s is not a normal float)
// for both rows of this thread; `normal` turns false where some c is not a
// normal float.
__device__ __forceinline__ void scale_factors(const float* scale, const float* p2E, float (*c)[FM_SCORERS], bool& normal) {
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
#pragma unroll
        for (u32 sc = 0; sc < FM_SCORERS; ++sc) {
            c[h][sc] = scale[h] * p2E[sc];
            normal &= c[h][sc] >= 1.17549435e-38f && c[h][sc] <= 3.40282347e38f;
        }
    }
}

// The rows' scales split into the accumulators (wg8_split_rows), then their
// c and `normal` made again: where some scale of the warp is not positive
// and finite.
__device__ __forceinline__ void resplit_rows(float* d, float* scale, const float* p2E, float (*c)[FM_SCORERS], bool& normal) {
    wg8_split_rows(d, scale);
    normal = true;
    scale_factors(scale, p2E, c, normal);
}

// Two values (|v| <= 448) to e4m3, round to nearest even: lo in the low byte.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// The TMA load path (fm_score_wg_fp8q_tma: the host's default for one
// sequence per launch whose scales are 16-byte aligned, KVSWAP_FM_LOAD=
// cp.async turns it off; 0.5 us faster per call, NOTES s37): one thread per
// warpgroup and tile issues a 2D
// tensor copy of the 64 key rows (the tensor map's 128-byte swizzle gives
// raw_at's layout) and a 1D copy of their scales onto the slot's mbarrier;
// the warpgroup waits on the mbarrier instead of its cp.async groups, a
// proxy fence and a warpgroup barrier. Rows past n arrive zero-filled.
// Tensor maps: keys (u8, rank 2: 128 bytes x n rows, `stride` apart, box
// 128 x 64, SWIZZLE_128B) then scales (f32, rank 1: n, box 64), per
// sequence; one sequence per launch.
struct __align__(64) TmaMap {
    u64 opaque[16];
};
#define FM_TMA_SEQS 1
struct TmaMaps {
    TmaMap map[2 * FM_TMA_SEQS];
};
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// Tile rows [c0, c0 + WG_ROWS) into `dst` and their scales into `sc`, both
// counted on `bar` (one elected thread; `valid` false issues nothing).
__device__ __forceinline__ void wg8_tma_issue(const TmaMap* maps, u32 c0, bool valid, u8* dst, float* sc, u64* bar) {
    if (!valid) return;
    const u32 b = smem_addr(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "n"(WG_RAW_BYTES + WG_ROWS * 4) : "memory");
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(
            smem_addr(dst)),
        "l"(maps), "r"(0), "r"(c0), "r"(b), "l"(policy)
        : "memory");
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];" ::"r"(smem_addr(sc)),
                 "l"(maps + 1), "r"(c0), "r"(b)
                 : "memory");
}

// G warpgroups per block (WG_GROUPS for the cp.async entry; the TMA entry's
// FM_TMA_GROUPS, which its register count, 126 at 3 scorers, lets reach 4;
// four measured no faster than three, NOTES s37).
template <bool TMA, u32 G>
__device__ __forceinline__ void score_wg_fp8q(const ScoreBatch& B, u32* err, const TmaMap* maps) {
    constexpr u32 GT = 128 * G, ORDER_BAR = 1 + G;  // threads; named barriers 1 .. G per warpgroup, then the turns
    static_assert(ORDER_BAR + G <= 16, "16 hardware barriers");
#ifdef FM_TRACE
    static_assert(G == WG_GROUPS, "FM_TRACE sizes its shared sums for WG_GROUPS warpgroups");
#endif
    CT_EXIT(3);
    CT_EXIT(8);
    __shared__ __align__(16) u32 sh_hist[FM_HIST];
    __shared__ int sh_e[FM_QROWS];
    __shared__ int sh_E[FM_SCORERS];
    __shared__ int sh_Emax[FM_SCORERS];  // the largest e of each scorer's heads with a finite, non-zero q
    // The head weights w_h * 2^(e_h - E) of each (scorer, head) column: as
    // the head-sum MMA's B (bf16 hi and lo parts), or for the FMA path in
    // wq_at's order (the four weights a thread needs for n-tiles 2m and
    // 2m + 1 side by side: one 16-byte load instead of two 8-byte ones).
#ifdef FM_Q8_TC
#ifdef FM_Q8_WGHS
    __shared__ __align__(128) u32 sh_wt[FM_QROWS / 8][8][4];  // [K / 8][column][K % 8 pairs]: bf16x2 head weights
#else
    __shared__ uint2 sh_wb[FM_QROWS / 16][32];  // the head-sum MMA's B fragment per k-step and lane
#endif
#else
    __shared__ __align__(16) float sh_w[FM_QROWS];
#endif
    __shared__ float sh_p2E[FM_SCORERS];  // 2^E where that is a normal float, else 0 (no fast path)
#ifdef FM_Q8_TC
    __shared__ u32 sh_spare[32];  // the filing's atomics of lanes that file nothing, a word per lane index
#endif
    TR_SHARED
    const u32 raw_addr = smem_addr(wg_smem_raw);
    u8* base = wg_smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    u8* sh_q = base;
    const bool mean = B.mean != 0;
    const ScoreSeq& S = B.seq[blockIdx.y];
    const u8* keys = (const u8*)S.keys;
    const u32 n = S.n, stride = S.stride;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = __shfl_sync(KVS_FULL_MASK, warp >> 2, 0);  // warp-uniform (see score_wg)
    const u32 t0 = threadIdx.x & (WG_GROUP_THREADS - 1u);
    u8* ring = base + WG8Q_Q_BYTES + g * WG8Q_GROUP_BYTES;
    float* sc_ring = (float*)(ring + WG_STAGES * WG_RAW_BYTES);

    TR_START
    const WgTiles T = wg_tiles_of<G>(n, g);
    const u32 step = T.step, first = T.first, my_tiles = T.mine, next = T.next, next_turns = T.next_turns;
    __shared__ __align__(8) u64 sh_full[TMA ? G : 1][WG_STAGES];  // TMA: each slot's mbarrier
    // This warpgroup's tile t (its rows and their scales) into ring slot
    // t % WG_STAGES: by TMA (one thread, onto the slot's mbarrier) or by
    // cp.async (every thread); nothing for t past its tiles.
    auto issue = [&](u32 t) {
        const u32 c0 = (first + t * step) * WG_ROWS, slot = t % WG_STAGES;
        if constexpr (TMA) {
            if (t0 == 0) wg8_tma_issue(maps, c0, t < my_tiles, ring + slot * WG_RAW_BYTES, sc_ring + slot * WG_ROWS, &sh_full[g][slot]);
        } else {
            wg8_issue(keys, S.scales, stride, n, t0, c0, t < my_tiles, ring + slot * WG_RAW_BYTES, sc_ring + slot * WG_ROWS);
        }
    };
    // Tile 0 before waiting for the projection (keys are inputs of the
    // call, q and w its outputs), tile 1 once Q is quantized.
    if constexpr (TMA) {
        if (t0 == 0) {
            for (u32 i = 0; i < WG_STAGES; ++i) mbar_init(&sh_full[g][i], 1);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the inits, before the copies complete on them
        }
    }
    issue(0);
    wait_prerequisites();
    CT_MIN(0);  // past the wait: a call's stamps come after the last call's fm_order reset them
    CT_MAX(1);
    // Q: a quarter warp per head row (8 lanes of 16 dims: 32 bytes of bf16
    // in, one 16-byte chunk of the swizzled e4m3 row out), so one warp
    // instruction serves four rows and a row's exponent costs a few lanes'
    // work, not a warp's; every load of this thread in flight before any is
    // used. (A warp per row took ~960 instructions per warp: ~1 us of issue
    // in a ~5 us prologue, NOTES s33.)
    constexpr u32 WARPS = GT / 32, QPASS = 4 * WARPS, NPASS = (FM_QROWS + QPASS - 1) / QPASS;
    static_assert(FM_HEAD_DIM == 128, "8 lanes x 16 dims per row");
    const u32 qlane = lane & 7u;
    uint4 qv[NPASS][2];
#pragma unroll
    for (u32 j = 0; j < NPASS; ++j) {
        const u32 r = min(j * QPASS + warp * 4 + (lane >> 3), FM_QROWS - 1u);  // past the last row: a copy of it, not stored
        const uint4* src = (const uint4*)(S.q + (u64)r * FM_HEAD_DIM) + 2 * qlane;
        qv[j][0] = src[0];
        qv[j][1] = src[1];
    }
    for (u32 i = threadIdx.x; i < FM_HIST; i += GT) sh_hist[i] = 0;
    if (threadIdx.x < FM_SCORERS) sh_Emax[threadIdx.x] = WG8Q_ZERO_HEAD;
    float w_mine[(FM_QROWS + GT - 1) / GT];
#pragma unroll
    for (u32 j = 0; j * GT < FM_QROWS; ++j)
        w_mine[j] = threadIdx.x + j * GT < FM_QROWS ? S.w[threadIdx.x + j * GT] : 0.f;
    __syncthreads();  // sh_Emax set before the heads' atomicMax below (Q's loads are in flight)
#ifdef FM_TRACE
    asm volatile("" ::"r"(qv[0][0].x));  // waits for the first load
#endif
    TR(0);
#pragma unroll
    for (u32 j = 0; j < NPASS; ++j) {
        const u32 r = j * QPASS + warp * 4 + (lane >> 3);
        const u32 x[8] = {qv[j][0].x, qv[j][0].y, qv[j][0].z, qv[j][0].w, qv[j][1].x, qv[j][1].y, qv[j][1].z, qv[j][1].w};
        // Largest |q| as bf16 bits (two per word, sign cleared): monotonic
        // for non-negative values, above 0x7f80 (Inf, NaN) when the
        // projection overflowed; over the row's 8 lanes.
        u32 m2 = 0;
#pragma unroll
        for (u32 i = 0; i < 8; ++i) m2 = __vmaxu2(m2, x[i] & 0x7fff7fffu);
        u32 amax_bits = max(m2 & 0xffffu, m2 >> 16);
#pragma unroll
        for (u32 o = 1; o < 8; o <<= 1) amax_bits = max(amax_bits, __shfl_xor_sync(KVS_FULL_MASK, amax_bits, o));
        const bool finite = amax_bits < 0x7f80u;
        const int e = fp8q_exponent(amax_bits);  // < 122 (a non-finite row is marked below)
        // q * 2^-e exactly, as q * 2^s * 2^(-e-s) with both factors normal
        // floats: s = 64 when 2^-e is not one (e < -126: largest |q| under
        // about 2^-117), else 0. No branch.
        const int s = e < -126 ? 64 : 0;
        const float up = __int_as_float((127 + s) << 23), down = __int_as_float((127 - e - s) << 23);
        u32 packed[4];
#pragma unroll
        for (u32 k = 0; k < 4; ++k) {  // dims 4k .. 4k + 3 of the lane's 16; exact unless far below e4m3's range
            const float v0 = __uint_as_float(x[2 * k] << 16) * up * down, v1 = __uint_as_float(x[2 * k] & 0xffff0000u) * up * down;
            const float v2 = __uint_as_float(x[2 * k + 1] << 16) * up * down, v3 = __uint_as_float(x[2 * k + 1] & 0xffff0000u) * up * down;
            packed[k] = f32x2_to_e4m3x2(v0, v1) | (f32x2_to_e4m3x2(v2, v3) << 16);
        }
        if (r < FM_QROWS) {
            // The lane's 16 bytes: 16-byte chunk qlane of the swizzled row.
            *(uint4*)(sh_q + r * 128u + ((qlane ^ (r & 7u)) << 4)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            // A non-finite head is marked: its weight becomes NaN below.
            if (qlane == 0) {
                sh_e[r] = !finite ? WG8Q_BAD_HEAD : (amax_bits == 0 ? WG8Q_ZERO_HEAD : e);
                if (finite && amax_bits != 0) atomicMax(&sh_Emax[r / FM_HEADS], e);
            }
        }
    }
    TR(1);
    __syncthreads();
    // E of each scorer: its heads' largest e (0 when every head is zero).
    auto scorer_E = [&](u32 sc) {
        const int m = sh_Emax[sc];
        return m == WG8Q_ZERO_HEAD ? 0 : m;
    };
    if (threadIdx.x < FM_SCORERS) {
        const int E = scorer_E(threadIdx.x);
        sh_E[threadIdx.x] = E;
        sh_p2E[threadIdx.x] = E >= -126 && E <= 127 ? __int_as_float((127 + E) << 23) : 0.f;
    }
#pragma unroll
    for (u32 j = 0; j * GT < FM_QROWS; ++j) {
        const u32 i = threadIdx.x + j * GT;
        if (i < FM_QROWS) {
            const int e = sh_e[i];
            // A head whose q is not finite scores NaN (an error, as the 16-bit
            // kernels' infinite dot products); an all-zero head scores 0.
            // w * 2^(e - E): one multiply by a normal power of two, correctly
            // rounded as scalbnf is, which is left for a factor below 2^-126.
            float wi;
            if (e == WG8Q_BAD_HEAD) wi = __int_as_float(0x7fc00000);
            else if (e == WG8Q_ZERO_HEAD) wi = 0.f;
            else {
                const int de = e - scorer_E(i / FM_HEADS);  // <= 0
                wi = de >= -126 ? w_mine[j] * __int_as_float((127 + de) << 23) : scalbnf(w_mine[j], de);
            }
#ifdef FM_Q8_TC
            // Column i's weight as the head-sum MMA's B, in all 8 of its
            // columns (hi in the even ones, lo in the odd ones): K row i is
            // bf16 half i % 2 of a pair.
            const u16 hl[2] = {bf16_bits(tc_weight(0, wi)), bf16_bits(tc_weight(1, wi))};
#ifdef FM_Q8_WGHS
            // gmma_desc_plain's layout: [K / 8][column][K % 8 pairs].
#pragma unroll
            for (u32 nc = 0; nc < 8; ++nc) ((u16*)&sh_wt[i / 8][nc][(i % 8) / 2])[i % 2] = hl[nc % 2];
#else
            // m16n8k16 B fragments: lane l holds column l / 4 at K rows
            // 2 (l % 4) + {0, 1} (.x) and + 8, + 9 (.y) of each k-step.
            const u32 o = i % 16;
#pragma unroll
            for (u32 nc = 0; nc < 8; ++nc) ((u16*)&sh_wb[i / 16][4 * nc + (o % 8) / 2])[(o / 8) * 2 + o % 2] = hl[nc % 2];
#endif
#else
            sh_w[wq_at(i)] = wi;
#endif
        }
    }
    for (u32 i = 1; i < WG_STAGES - 1; ++i) issue(i);
    fence_async_smem();  // Q and the head weights (generic stores) -> tensor-core reads
    __syncthreads();
    // E per scorer, and 2^E as a float where that is a normal number (else 0,
    // which keeps every row of the scorer off the one-multiply path below),
    // read from shared memory where used: with 4 scorers, register copies
    // made ptxas spill (168 registers).
    const int* E = sh_E;
    const float* p2E = sh_p2E;
    bool bad = false;
    u32 bad_chunk = 0;
    const u64 db0 = gmma_desc(smem_addr(sh_q));
    const u32 ra = (warp & 3u) * 16 + (lane >> 2), rb = ra + 8;
    float d[FM_QROWS / 2];
#pragma unroll
    for (u32 k = 0; k < FM_QROWS / 2; ++k) d[k] = 0.f;
    if (g == G - 1 && T.first_turns > 0) turn_pass(ORDER_BAR);  // warpgroup 0 goes first
    TR(2);
    CT_MAX(2);
    for (u32 i = 0; i < my_tiles; ++i) {
        const u32 c0 = (first + i * step) * WG_ROWS;
        u8* slot = ring + (i % WG_STAGES) * WG_RAW_BYTES;
        const float* sc = sc_ring + (i % WG_STAGES) * WG_ROWS;
        if constexpr (TMA) {
            // Tile i's keys and scales have landed (both proxies: the
            // mbarrier's completion orders the copy before the reads). No
            // barrier for tile i - 1's slot: its refill below comes after
            // this tile's turn_wait, a bar.sync of 256 threads every tile
            // that all four warps of the group reach only after their
            // wgmma wait for tile i - 1 and their reads of its scales (if
            // turns ever become conditional, wg_barrier(g) goes back before
            // the refill). So no warp reads the slot, or waits on its
            // previous phase, when the refill lands.
            mbar_wait(&sh_full[g][i % WG_STAGES], (i / WG_STAGES) & 1u);
        } else {
            cp_async_wait_stages();  // tile i has landed (this thread's part)
            fence_async_smem();      // this thread's cp.async writes -> tensor-core reads
            wg_barrier(g);           // ... every thread's part; tile i - 1 is consumed
        }
        TR(3);
        // The chunk scales now, read while the turn and the MMAs go on.
        const u32 chunks[2] = {c0 + ra, c0 + rb}, rows[2] = {ra, rb};
        float scales[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) scales[h] = chunks[h] < n ? sc[rows[h]] : 1.f;
        // Whether every scale of the warp's rows is positive and finite, and
        // c = scale * 2^E with whether each is a normal float: from the
        // scales alone, so made here, while the turn and the MMAs go on,
        // not on the epilogue's chain after the MMAs' wait (H200, score
        // fp8 at 262,144 chunks: -0.2 us, NOTES s44).
        const bool pos_all = __all_sync(KVS_FULL_MASK, positive_finite(scales[0]) && positive_finite(scales[1]));
        float c[2][FM_SCORERS];
        bool normal = true;
        scale_factors(scales, p2E, c, normal);
        TR(4);
        turn_wait(ORDER_BAR + g);
        TR(5);
        tile_mma(d, slot, db0);
        if (i < next_turns) turn_pass(ORDER_BAR + next);
        TR(13);
        // The refill of the slot tile i - 1 used (every warp is past this
        // tile's barrier, so done with it) while this tile's MMAs run.
        issue(i + WG_STAGES - 1);
        TR(6);
        wgmma_wait0();
        TR(7);

        // The common case: every scale of the warp's rows positive and finite
        // (relu(scale * x) = scale * relu(x): the scale multiplies each
        // scorer's sum once) and every c = scale * 2^E a normal float (exact
        // then): one multiply per scorer sum, no other path issued beside it.
        // Positive finite scales with some c not normal (extreme scales or
        // exponents) take the same sums times scale and 2^E in two steps
        // (scaled_sum: neither scale * 2^E nor sum * scale is formed).
        // Other scales (zero, negative, non-finite) are split in place
        // first (wg8_split_rows), so that every row takes this path.
        if (!pos_all) resplit_rows(d, scales, p2E, c, normal);  // warp-uniform and rare
        {
            float ens[2];
            bool finite[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) finite[h] = isfinite(d[2 * h]);
#ifdef FM_Q8_TC
            // hs[s]: scorer s's hi and lo head sums of this lane's rows ra
            // (hs[s][0], hs[s][1]) and rb (hs[s][2], hs[s][3]); k-step k
            // is scorer k / FM_Q8_KSTEPS's (wgmma: the first of each
            // overwrites; mma.sync: zeroed first).
            float hs[FM_SCORERS][4];
#ifdef FM_Q8_WGHS
            // Every warp of the warpgroup (wgmma is collective), whichever
            // path its rows take below.
            {
                u32 a[FM_QROWS / 16][4];
#pragma unroll
                for (u32 k = 0; k < FM_QROWS / 16; ++k) relu_a_fragment(d, k, a[k]);
                TR(9);
                const u64 dw0 = gmma_desc_plain(smem_addr(sh_wt));
                head_sum_mma(a, hs, dw0);
                wgmma_wait0();
                TR(12);
            }
#else
            {
#pragma unroll
                for (u32 sc = 0; sc < FM_SCORERS; ++sc) hs[sc][0] = hs[sc][1] = hs[sc][2] = hs[sc][3] = 0.f;
#pragma unroll
                for (u32 k = 0; k < FM_QROWS / 16; ++k) {
                    u32 a[4];
                    relu_a_fragment(d, k, a);
                    const uint2 b = sh_wb[k][lane];
                    mma_bf16(hs[k / FM_Q8_KSTEPS], a, b.x, b.y);
                }
            }
#endif
            tc_ensemble(hs, c, scales, normal, E, mean, ens, finite);
#else
            if (__all_sync(KVS_FULL_MASK, normal))
                head_sums<2>(
                    d, 0, [&](u32 j) { return wq_weights(sh_w, lane, j); }, [](u32, float a) { return a; },
                    [&](u32 h, u32 s, float si) { return si * c[h][s]; }, mean, ens, finite);
            else
                // Some c not a normal float: the sums rescaled in two steps.
                head_sums<2>(
                    d, 0, [&](u32 j) { return wq_weights(sh_w, lane, j); }, [](u32, float a) { return a; },
                    [&](u32 h, u32 s, float si) { return scaled_sum(si, scales[h], E[s]); }, mean, ens, finite);
#endif
#ifdef FM_Q8_TC
            // Every lane of the quad holds both rows' scores: lane 0 files
            // row ra and lane 1 row rb, with no branch around the store and
            // the atomic (two filings, each behind a branch: H200, score fp8
            // at 262,144 chunks: +0.6 us, NOTES s44). A non-finite d fills
            // its whole row (fp8 products cannot overflow: |d| <= 128 x
            // 448^2), so the filing lanes' checks find every error.
            file_rows_per_lane(ens, finite, chunks, n, S, sh_hist, sh_spare, true, bad, bad_chunk);
#else
#pragma unroll
            for (u32 h = 0; h < 2; ++h) wg_file_score(ens[h], finite[h], chunks[h] < n, chunks[h], (lane & 3u) == 0, S, sh_hist, bad, bad_chunk);
#endif
        }
        TR(8);
    }
    CT_MAX(9);
    wg_scores_done(B, err, bad, bad_chunk);
    TR(10);
    flush_hist(sh_hist, S.hist);
#ifdef FM_TRACE
    TR(11);
    trace_flush(sh_tr, my_tiles, 2);
#endif
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg_fp8q(ScoreBatch B, u32* err) { score_wg_fp8q<false, WG_GROUPS>(B, err, nullptr); }
// The host launches it with its launch bound's threads (the kernel's
// attribute) and shared memory for FM_TMA_G rings.
#ifndef FM_TMA_GROUPS
#define FM_TMA_GROUPS WG_GROUPS
#endif
// Four warpgroups cap a thread at 128 registers: enough for up to 192 query
// rows (96 accumulators), not for 256 (128 accumulators), which keep three.
#define FM_TMA_G (FM_TMA_GROUPS > 3 && FM_QROWS > 192 ? 3 : FM_TMA_GROUPS)
static_assert(FM_TMA_G >= 1 && FM_TMA_G <= 4, "FM_TMA_GROUPS: 1 to 4 warpgroups");
extern "C" __global__ void __launch_bounds__(128 * FM_TMA_G, 1) fm_score_wg_fp8q_tma(ScoreBatch B, u32* err, const __grid_constant__ TmaMaps M) {
    score_wg_fp8q<true, FM_TMA_G>(B, err, M.map);
}
#endif  // FM_HEAD_DIM == 128
#endif  // FM_WGMMA, FM_HEAD_DIM 64 or 128
