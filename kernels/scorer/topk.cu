// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

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
// candidates (scores crowded into the threshold bin), its blocks narrow the
// ties to the `want - n_sure` best in a merge tree (each block its slice by
// 11-bit radix passes, then the last block of each group, then the last
// group: order_narrowed) and rank the winners. fm_order's
// block 0 also zeroes the histogram and the append counters for the next
// call (graph replay needs no memset): no fm_order block reads them.

// Per-sequence selection state (SELECT_STATE_BYTES on the host).
//   appended  fm_select's append cursors: sure keys in bits 0..19 (< want <=
//             FM_RANK_MAX), ties in bits 20..43 (<= n <= 2^22); one atomic
//             reserves a block's places in both lists. Zero between calls.
//   filed     the final counts, same fields, published by fm_select's block 0
//             and read by fm_order.
//   cnt, gcnt, garrived, arrived  fm_order's merge tree (order_narrowed):
//             the list length of each block and of each group, and the
//             arrival counts of each group and of the groups (the counts
//             are zero between calls).
#define FM_ORDER_BLOCKS 64  // fm_order's blocks per sequence (FM_ORDER_MAX / FM_ORDER_CANDS)
#define FM_ORDER_MAX 4096   // the most candidates fm_order ranks without narrowing them first
#define FM_MERGE_GROUPS 8
struct SelectState {
    u64 appended;
    u64 filed;  // at byte 8: CudaScorer::last_candidates reads it there
    u32 cnt[FM_ORDER_BLOCKS];
    u32 gcnt[FM_MERGE_GROUPS];
    u32 garrived[FM_MERGE_GROUPS];
    u32 arrived;
    u32 pad[11];
};
static_assert(sizeof(SelectState) == 384, "SELECT_STATE_BYTES on the host");
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

// The digit d of an FM_DIGIT_BINS-bin histogram (shared memory) with
// count(> d) < want <= count(>= d), found by one warp (suffix sums over
// lanes); the result is in *s_digit, *s_above after the caller's next
// __syncthreads.
#define FM_DIGIT_BITS 8
#define FM_DIGIT_BINS (1u << FM_DIGIT_BITS)
__device__ void threshold_digit(const u32* h, u32 want, u32* s_digit, u32* s_above) {
    if (threadIdx.x >= 32) return;
    constexpr u32 PER = FM_DIGIT_BINS / 32;
    static_assert(PER % 2 == 0 && PER <= 64, "the second pass gives lanes two of the hit lane's bins each");
    const u32 lane = threadIdx.x;
    const u32 hi = FM_DIGIT_BINS - PER * lane;  // lane l owns bins [hi - PER, hi), lane 0 the top ones
    // The lanes whose ranges start in the same shared-memory bank (all of
    // them when PER >= 32) start at different bins of their range: the same
    // bin of each would be a 32-way bank conflict on every load.
    constexpr u32 SAME_BANK = PER >= 32 ? 1u : 32u / PER;  // lanes apart whose ranges share a bank
    u32 local = 0;
#pragma unroll 8
    for (u32 j = 0; j < PER; ++j) local += h[hi - PER + ((j + lane / SAME_BANK) & (PER - 1u))];
    const u32 incl = warp_inclusive_sum(local);
    const u32 hit = __ballot_sync(KVS_FULL_MASK, incl - local < want && incl >= want);
    // Within the hit lane's PER bins, the first PER / 2 lanes: lane l takes bins
    // top - 2l and top - 2l - 1 (descending), a second suffix sum finds the
    // bin (instead of one lane walking 64 dependent loads).
    const u32 src = hit ? __ffs(hit) - 1 : 0u;  // no hit (want 0 or above the total): in bounds, and nothing is written
    const u32 acc = __shfl_sync(KVS_FULL_MASK, incl - local, src);
    const u32 top = FM_DIGIT_BINS - PER * src - 1;
    const bool mine = 2 * lane < PER;  // lanes past the hit lane's bins add 0
    const u32 ca = mine ? h[top - 2 * lane] : 0u, cb = mine ? h[top - 2 * lane - 1] : 0u;
    const u32 incl2 = warp_inclusive_sum(ca + cb);
    const u32 before = acc + incl2 - (ca + cb);
    if (mine && before < want && before + ca + cb >= want) {
        const bool upper = before + ca >= want;
        *s_digit = top - 2 * lane - (upper ? 0u : 1u);
        *s_above = upper ? before : before + ca;
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

// f(key, valid) for every key at(0 .. m) (at(i) reads global memory written
// by an earlier launch or block, through L2), FM_SCAN_UNROLL loads in flight
// per thread (one at a time, a block's scan was bound by L2 latency). Every
// thread of the block calls it and reaches f the same number of times
// (whole warps, for f's warp-aggregated atomics); valid is false past m.
#define FM_SCAN_UNROLL 8
template <typename At, typename F>
__device__ __forceinline__ void scan_keys(At at, u32 m, F f) {
    for (u32 base = 0; base < m; base += FM_SCAN_UNROLL * blockDim.x) {
        u64 k[FM_SCAN_UNROLL];
#pragma unroll
        for (u32 u = 0; u < FM_SCAN_UNROLL; ++u) {
            // Past m, key m - 1 again (valid is false there): no branch
            // around the loads, so all of them can be in flight at once.
            const u32 i = base + u * blockDim.x + threadIdx.x;
            k[u] = at(i < m ? i : m - 1);
        }
#pragma unroll
        for (u32 u = 0; u < FM_SCAN_UNROLL; ++u) f(k[u], base + u * blockDim.x + threadIdx.x < m);
    }
}

// Development timeline of fm_order's merge tree (KVSWAP_FM_DEFINES=
// -DFM_OTRACE; the default build has none of it): thread 0 of a block sums SM
// cycles per phase and level; the block that ranks the winners (it ran all
// three levels) prints them for sequence 0 of every 64th crowded call.
#ifdef FM_OTRACE
#define OT_PHASES 10  // hist, threshold, push, collect, rank, level total, arrive, passes, keys, group
__shared__ unsigned long long ot_sum[3][OT_PHASES];
__shared__ u32 ot_level;
__device__ u32 ot_calls;
#define OT_START long long ot_t = clock64();
#define OT(i)                                           \
    do {                                                \
        if (threadIdx.x == 0) {                         \
            const long long t_ = clock64();             \
            ot_sum[ot_level][i] += (u64)(t_ - ot_t);    \
            ot_t = t_;                                  \
        }                                               \
    } while (0)
#define OT_ADD(i, v) do { if (threadIdx.x == 0) ot_sum[ot_level][i] += (v); } while (0)
#define OT_LEVEL(l) do { if (threadIdx.x == 0) ot_level = (l); } while (0)
#else
#define OT_START
#define OT(i) do {} while (0)
#define OT_ADD(i, v) do {} while (0)
#define OT_LEVEL(l) do {} while (0)
#endif

// Narrows the keys at(0 .. m) (as scan_keys; all equal above bit `shift`;
// want <= m) to their top `want` by key64: FM_DIGIT_BITS-bit radix passes
// append the certain keys to fin (shared memory, at *nfin) until the
// boundary group holds at most FM_GROUP_MAX keys, which are then ranked by
// counting. (A pass's digit may overlap bits fixed by the pass before, at
// the bottom of the key: they equal the prefix in every key counted.) One
// block; every thread must call it.
template <typename At>
__device__ __forceinline__ void narrow_topk(At keys, u32 m, u32 want, int shift, u64* fin, u32* nfin) {
    __shared__ u32 s_hist[FM_DIGIT_BINS];
    __shared__ u32 s_digit, s_above, s_cnt;
    __shared__ u64 s_group[FM_GROUP_MAX];
    constexpr u64 DMASK = FM_DIGIT_BINS - 1;
    u64 prefix = 0, mask = 0;
    u32 group = m;
    OT_START
    OT_ADD(8, m);
    while (group > FM_GROUP_MAX && shift > 0) {
        OT_ADD(7, 1);
        shift = shift >= FM_DIGIT_BITS ? shift - FM_DIGIT_BITS : 0;
        for (u32 i = threadIdx.x; i < FM_DIGIT_BINS; i += blockDim.x) s_hist[i] = 0;
        __syncthreads();
        // Plain shared atomics (same-bin lanes are serialised by the
        // hardware): a warp-aggregated count (__match_any_sync per key) cost
        // more than twice the whole selection with 201,657 such candidates.
        scan_keys(keys, m, [&](u64 k, bool valid) {
            if (valid && (k & mask) == prefix) atomicAdd(&s_hist[(u32)((k >> shift) & DMASK)], 1u);
        });
        __syncthreads();
        OT(0);
        threshold_digit(s_hist, want, &s_digit, &s_above);
        __syncthreads();
        OT(1);
        const u32 digit = s_digit;
        scan_keys(keys, m, [&](u64 k, bool valid) { push_key(fin, nfin, k, valid && (k & mask) == prefix && ((k >> shift) & DMASK) > digit); });
        want -= s_above;
        group = s_hist[digit];
        prefix |= (u64)digit << shift;
        mask |= DMASK << shift;
        __syncthreads();
        OT(2);
    }
    // The boundary group (at most FM_GROUP_MAX keys: key64s are unique, so a
    // group with all 64 bits fixed has one key) into shared memory, ranked.
    if (threadIdx.x == 0) s_cnt = 0;
    __syncthreads();
    scan_keys(keys, m, [&](u64 k, bool valid) { push_key(s_group, &s_cnt, k, valid && (k & mask) == prefix); });
    __syncthreads();
    OT(3);
    const u32 g = s_cnt;
    OT_ADD(9, g);
    for (u32 i = threadIdx.x; i < g; i += blockDim.x) {
        const u64 k = s_group[i];
        const u32 r = count_greater(s_group, g, k);
        push_key(fin, nfin, k, r < want);
    }
    __syncthreads();
    OT(4);
}

// Grid: (ceil(n / (FM_SEL_THREADS * FM_SEL_ITEMS)), sequences), FM_SEL_THREADS
// threads. `err` is read by fm_order (the two take the same parameters).
extern "C" __global__ void __launch_bounds__(FM_SEL_THREADS) fm_select(SelectBatch B, const u32* err) {
    __shared__ u32 s_base_sure, s_base_tie;
    wait_prerequisites();  // skey and hist come from the scoring kernel
    CT_MIN(4);
    CT_MAX(10);
    CT_EXIT(5);
    CT_EXIT(15);
    allow_dependents();
    const SelectSeq& S = B.seq[blockIdx.y];
    const u32 n = S.n;
    const u32 want = min(B.k, n);
    const u32 lo = blockIdx.x * (FM_SEL_THREADS * FM_SEL_ITEMS);
    // The sort keys' last read: the scoring kernel stored them evict-last
    // (for this kernel); reading them evict-first hands those lines back, so
    // they do not outstay the call in L2. (volatile: after the wait above.)
    u64 last_use;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(last_use));
    u32 skeys[FM_SEL_ITEMS];
#pragma unroll
    for (u32 j = 0; j < FM_SEL_ITEMS; ++j) {  // in flight while the threshold is found
        const u32 c = lo + j * FM_SEL_THREADS + threadIdx.x;
        skeys[j] = 0u;
        if (c < n) asm volatile("ld.global.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(skeys[j]) : "l"(S.skey + c), "l"(last_use) : "memory");
    }
    u32 n_sure, n_tie;
    const u32 b1 = threshold_bin(S.hist, want, &n_sure, &n_tie);
    CT_MAX(11);
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
    CT_MAX(12);
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
#define FM_ORDER_CANDS 64
#define FM_ORDER_SLICES 8
#define FM_ORDER_THREADS (FM_ORDER_CANDS * FM_ORDER_SLICES)
static_assert(FM_ORDER_MAX % FM_ORDER_CANDS == 0 && FM_ORDER_MAX >= FM_RANK_MAX, "whole blocks of candidates");
static_assert(FM_ORDER_MAX / FM_ORDER_CANDS == FM_ORDER_BLOCKS, "SelectState holds a list length per block");

// The top `want` of the keys at(0 .. m) appended to fin (shared memory, at
// *nfin): all of them when m <= want, else by narrow_topk (ties: equal in
// the top FM_HIST_BITS bits). One block; every thread calls it.
template <typename At>
__device__ __forceinline__ void top_keys(At at, u32 m, u32 want, u64* fin, u32* nfin) {
    if (m <= want) {
        scan_keys(at, m, [&](u64 k, bool valid) { push_key(fin, nfin, k, valid); });
        __syncthreads();
        return;
    }
    narrow_topk(at, m, want, 64 - FM_HIST_BITS, fin, nfin);
}

// Called by every thread of a block when its writes for the others are done:
// true in the last of `of` blocks to arrive at *count (which resets it),
// after a fence that makes the other blocks' writes visible to it. The
// others just leave: no block ever waits for another. (Thread 0 of the
// last also fences before the barrier, as cooperative groups' grid sync
// does; the readers use __ldcg.)
__device__ __forceinline__ bool arrive_last(u32* count, u32 of) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_last = atomicAdd(count, 1u) == of - 1;
        if (s_last) {
            *count = 0;  // every arrival is in
            __threadfence();
        }
    }
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

// More than FM_ORDER_MAX candidates: the `w = want - ns` best ties, found by
// every block of the sequence in a merge tree, no block waiting for another.
// Level 0: each block narrows its slice of the tie list to the slice's own
// top w and writes them back at the slice's start (every key of the overall
// top w is in its slice's top w). Level 1: the last block of each group of
// FM_MERGE_FAN to finish merges the group's lists the same way and writes
// the result from the group's first slice's start (it can run on into the
// group's later slices). Level 2: the last group's merger merges the groups'
// lists, adds the sure keys and ranks the `want` winners (fin: shared
// memory, FM_RANK_MAX keys at least) among themselves.
#define FM_MERGE_FAN 8
__device__ void order_narrowed(const SelectSeq& S, u32 ns, u32 nt, u32 want, u64* fin) {
    static_assert(FM_ORDER_BLOCKS <= FM_MERGE_FAN * FM_MERGE_GROUPS, "the merge tree covers every block");
    __shared__ u32 s_n, s_off[FM_MERGE_FAN + 1], s_start[FM_MERGE_FAN];
    SelectState* st = S.st;
    const u32 G = gridDim.x, w = want - ns, per = (nt + G - 1) / G;
    auto slice = [&](u32 b) { return min(nt, b * per); };
    // The merged lists of regions r < R (s_start, s_off), key i of their concatenation.
    auto merged = [&](u32 R) {
        return [=, &S](u32 i) {
            u32 r = 0;
#pragma unroll
            for (u32 step = FM_MERGE_FAN / 2; step > 0; step >>= 1)
                if (r + step < R && s_off[r + step] <= i) r += step;
            return __ldcg(S.tie + s_start[r] + (i - s_off[r]));
        };
    };
    // Gathers regions r < R (start(r), count(r) keys) into s_start / s_off,
    // then appends the top w of them to fin. (One accessor type for every
    // level: each instance of narrow_topk has its own shared memory.)
    auto merge = [&](u32 R, auto start, auto count) {
        if (threadIdx.x == 0) {
            u32 a = 0;
            for (u32 r = 0; r < R; ++r) {
                s_start[r] = start(r);
                s_off[r] = a;
                a += count(r);
            }
            s_off[R] = a;
        }
        __syncthreads();
        top_keys(merged(R), s_off[R], w, fin, &s_n);
    };
    // Level 0.
#ifdef FM_OTRACE
    if (threadIdx.x < 3 * OT_PHASES) ot_sum[threadIdx.x / OT_PHASES][threadIdx.x % OT_PHASES] = 0;
    OT_LEVEL(0);
    __syncthreads();
#endif
    OT_START
    const u32 x = blockIdx.x, lo = slice(x);
    if (threadIdx.x == 0) s_n = 0;
    merge(1, [&](u32) { return lo; }, [&](u32) { return slice(x + 1) - lo; });
    for (u32 i = threadIdx.x; i < s_n; i += blockDim.x) S.tie[lo + i] = fin[i];  // every read of the slice is done
    if (threadIdx.x == 0) st->cnt[x] = s_n;
    const u32 grp = x / FM_MERGE_FAN, b0 = grp * FM_MERGE_FAN, nb = min(G, b0 + FM_MERGE_FAN) - b0;
    OT(5);
    if (!arrive_last(&st->garrived[grp], nb)) return;
    OT(6);
    OT_LEVEL(1);
    // Level 1: the group's lists, merged, written from its first slice's
    // start (they lie inside the group's slices, and so does their top w).
    if (threadIdx.x == 0) s_n = 0;
    merge(nb, [&](u32 r) { return slice(b0 + r); }, [&](u32 r) { return __ldcg(&st->cnt[b0 + r]); });
    for (u32 i = threadIdx.x; i < s_n; i += blockDim.x) S.tie[slice(b0) + i] = fin[i];
    if (threadIdx.x == 0) st->gcnt[grp] = s_n;
    const u32 groups = (G + FM_MERGE_FAN - 1) / FM_MERGE_FAN;
    OT(5);
    if (!arrive_last(&st->arrived, groups)) return;
    OT(6);
    OT_LEVEL(2);
    // Level 2: the sure keys, then the top w of the groups' lists; ranked.
    for (u32 i = threadIdx.x; i < ns; i += blockDim.x) fin[i] = __ldcg(S.sure + i);
    if (threadIdx.x == 0) s_n = ns;
    merge(groups, [&](u32 r) { return slice(r * FM_MERGE_FAN); }, [&](u32 r) { return __ldcg(&st->gcnt[r]); });
    // The winners in order: a bitonic sort of fin[0 .. P) (descending; P the
    // power of two >= want, padded with 0, below every key: the low word of a
    // key is ~id > 0), log2(P) (log2(P) + 1) / 2 steps of one compare-exchange
    // per pair, instead of ranking each winner by counting (want^2 shared loads).
    u32 P = 1;
    while (P < want) P <<= 1;
    for (u32 i = want + threadIdx.x; i < P; i += blockDim.x) fin[i] = 0;
    __syncthreads();
    for (u32 k = 2; k <= P; k <<= 1)
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            for (u32 i = threadIdx.x; i < P; i += blockDim.x) {
                const u32 l = i ^ j;
                if (l > i) {
                    const u64 a = fin[i], b = fin[l];
                    if ((a < b) == ((i & k) == 0)) {  // descending where (i & k) == 0
                        fin[i] = b;
                        fin[l] = a;
                    }
                }
            }
            __syncthreads();
        }
    for (u32 i = threadIdx.x; i < want; i += blockDim.x) S.out[i] = (i32)(0xFFFFFFFFu - (u32)fin[i]);
#ifdef FM_OTRACE
    __syncthreads();
    OT(5);
    if (threadIdx.x == 0 && blockIdx.y == 0 && ot_calls++ % 64 == 3)
        for (u32 l = 0; l < 3; ++l) {
            const unsigned long long* t = ot_sum[l];
            printf("FMOTRACE level %u (ns %u nt %u w %u): keys %llu passes %llu group %llu | cycles: hist %llu threshold %llu push %llu "
                   "collect %llu rank %llu | level total %llu arrive %llu\n",
                   l, ns, nt, w, t[8], t[7], t[9], t[0], t[1], t[2], t[3], t[4], t[5], t[6]);
        }
#endif
}

// keys[i - lo] = *at(i) for i in [lo, hi) (hi - lo <= FM_ORDER_MAX), the
// whole block: every load of a thread in flight before the first is
// stored (a loop of load-then-store made a thread with two keys wait for
// two L2 trips in turn: H200, score fp8 at 262,144 chunks, fm_order 2.6 ->
// 2.3 us in the call's trace, NOTES s46).
template <typename At>
__device__ __forceinline__ void load_group(u32 lo, u32 hi, u64* keys, At at) {
    constexpr u32 PER = FM_ORDER_MAX / FM_ORDER_THREADS;
    static_assert(FM_ORDER_MAX % FM_ORDER_THREADS == 0, "whole passes");
    u64 v[PER];
#pragma unroll
    for (u32 j = 0; j < PER; ++j) {
        const u32 i = lo + threadIdx.x + j * FM_ORDER_THREADS;
        if (i < hi) v[j] = __ldcg(at(i));
    }
#pragma unroll
    for (u32 j = 0; j < PER; ++j) {
        const u32 i = lo + threadIdx.x + j * FM_ORDER_THREADS;
        if (i < hi) keys[i - lo] = v[j];
    }
}

extern "C" __global__ void __launch_bounds__(FM_ORDER_THREADS) fm_order(SelectBatch B, const u32* err) {
    __shared__ u64 keys[FM_ORDER_MAX];
    __shared__ u32 part[FM_ORDER_SLICES][FM_ORDER_CANDS];
    wait_prerequisites();  // fm_select has filed and published the candidates
    CT_MIN(6);
    CT_MAX(13);
#ifdef FM_CTRACE
    struct CtLast {  // after every block's stamps: the last block prints
        __device__ ~CtLast() {
            if (threadIdx.x != 0) return;
            atomicMax(&fm_ct[7], ct_now());
            __threadfence();
            if (atomicAdd(&fm_ct_done, 1u) != gridDim.x * gridDim.y - 1) return;
            fm_ct_done = 0;
            volatile unsigned long long* t = fm_ct;
            const double t0 = (double)t[0];
            if (t[0] != ~0ull && fm_ct_calls++ % 97 == 5)  // calls of a kernel with stamps (fm_score_wg_fp8q)
                printf("FMCALL ns from the first score block: score blocks start by %.0f, loops start by %.0f, loops end by %.0f, score end %.0f .. %.0f "
                       "| select past wait %.0f .. %.0f, threshold by %.0f, filed by %.0f, end %.0f .. %.0f | order past wait %.0f .. %.0f, "
                       "loaded by %.0f, end %.0f\n",
                       t[1] - t0, t[2] - t0, t[9] - t0, t[8] - t0, t[3] - t0, t[4] - t0, t[10] - t0, t[11] - t0, t[12] - t0, t[15] - t0,
                       t[5] - t0, t[6] - t0, t[13] - t0, t[14] - t0, t[7] - t0);
            for (u32 i = 0; i < CT_SLOTS; ++i) t[i] = CT_IS_MIN(i) ? ~0ull : 0ull;
        }
    } ct_last_;
#endif
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
        order_narrowed(S, ns, nt, want, keys);  // every block takes part
        return;
    }
    const u32 c0 = blockIdx.x * FM_ORDER_CANDS;
    if (c0 >= m) return;
    // The groups this block's candidates belong to: keys [lo, hi).
    const u32 c1 = min(c0 + FM_ORDER_CANDS, m);
    const u32 lo = c0 < ns ? 0u : ns, hi = c1 > ns ? m : ns;
    load_group(lo, hi, keys, [&](u32 i) { return i < ns ? S.sure + i : S.tie + (i - ns); });
    __syncthreads();
    CT_MAX(14);
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
#ifdef FM_TRACE_REPORT
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) fm_trace_report();
#endif
}
