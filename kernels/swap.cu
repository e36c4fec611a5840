// kvswap swap kernels: the residency decision of one swap_in_selected call,
// the one-launch gather of all misses from the mapped host tier, stores with
// slot refresh, validation, layer initialisation, and forgetting chunks.
//
// Compiled at run time by NVRTC for the device's compute capability (no CUDA
// headers needed). The residency rules are DESIGN.md's and match
// src/residency.rs bit for bit:
//   - -1 entries are padding and stay -1;
//   - victims are slots not selected in this call, least recently used first,
//     ties to the lower slot index; misses take victims in the order of their
//     first appearance; duplicates map to the same slot;
//   - slots selected by one call share its recency, ordered by slot index.
// The LRU order lives on the device as an array of slots (least recent first),
// double-buffered: each call writes the new order into the other buffer.


#define KV_NONE 0xFFFFFFFFu
#define KV_CLAIM 0x80000000u

// Error codes recorded on the device (first error wins).
#define KV_ERR_OUT_OF_RANGE 1u
#define KV_ERR_NOT_STORED 2u
#define KV_ERR_VALIDATION 3u

// Counters, in this order, in LayerDev::stats.
#define KV_STAT_HITS 0
#define KV_STAT_MISSES 1
#define KV_STAT_EVICTIONS 2
#define KV_STAT_STORES 3
#define KV_STAT_REFRESHES 4
#define KV_STAT_H2D 5
#define KV_STAT_D2H 6
#define KV_STAT_CALLS 7

// Bytes one warp copies per task: 32 lanes x 16 B x 4 in flight.
#define KV_PIECE 2048u

// Everything a kernel needs about one layer; passed by value (so a captured
// CUDA graph holds it), all pointers are device addresses.
struct LayerDev {
    u32* chunk_slot;      // [cap]   slot of each chunk, KV_NONE if not resident
    u32* slot_chunk;      // [slots] chunk of each slot, KV_NONE if empty
    u32* lru;             // [2*slots] two LRU orders, least recent first
    u32* parity;          // [1] which half of lru is current
    u32* stored;          // [ceil(cap/32)] chunk stored bits
    u32* selected;        // [slots] per-call flags of fully resident layers, zero between calls
    u32* miss_list;       // [2*slots] (slot, chunk) of this call's misses
    u32* n_miss;          // [1] misses of the last call (read by the gather)
    u64* stats;           // [8] counters
    u32* err;             // [8] code, position, id, spare; kvswap_validate's
                          // arrival count, spare, and (8-byte aligned) the
                          // lowest mismatch of its launch (u64)
    u8* host_tier;        // mapped pinned host memory, cap * chunk_bytes
    u8* staging;          // slot rows
    u64 stride;           // bytes between slot rows
    u64 chunk_bytes;
    u32 cap;
    u32 slots;
    u32 identity;         // 1: swap off, chunk id == slot
    u32 pad;
};

__device__ __forceinline__ bool is_stored(const LayerDev& L, u32 id) {
    return (L.stored[id >> 5] >> (id & 31)) & 1u;
}
// Sum of one value per thread over the block. Every thread must call it.
__device__ u32 block_sum(u32 v) {
    u32 total;
    block_exclusive_sum(v, &total);
    return total;
}

// Ordered stream compaction over items 0..n: for each i with flag(i), calls
// apply(i, rank) where rank counts flagged items before i. Each thread takes a
// contiguous run of items so ranks follow item order. flag(i) is evaluated
// twice and must not change in between except through apply(i, ...) itself.
// Returns the number of flagged items. Every thread must call it.
template <typename Flag, typename Apply>
__device__ u32 block_compact(u32 n, Flag flag, Apply apply) {
    const u32 per = (n + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(n, threadIdx.x * per), hi = min(n, lo + per);
    u32 local = 0;
    for (u32 i = lo; i < hi; ++i) local += flag(i) ? 1u : 0u;
    u32 total;
    u32 rank = block_exclusive_sum(local, &total);
    for (u32 i = lo; i < hi; ++i)
        if (flag(i)) apply(i, rank++);
    __syncthreads();
    return total;
}

// Initialises a layer's device state. Grid-stride; any launch shape.
extern "C" __global__ void kvswap_init_layer(LayerDev L) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    if (!L.identity) {
        for (u32 i = t; i < L.cap; i += nt) L.chunk_slot[i] = KV_NONE;
        for (u32 s = t; s < L.slots; s += nt) {
            L.slot_chunk[s] = KV_NONE;
            L.lru[s] = s;
            L.lru[L.slots + s] = s;
            L.miss_list[2 * s] = 0;
            L.miss_list[2 * s + 1] = 0;
        }
    }
    for (u32 s = t; s < L.slots; s += nt) L.selected[s] = 0;
    for (u32 w = t; w < (L.cap + 31) / 32; w += nt) L.stored[w] = 0;
    if (t < 8) L.stats[t] = 0;
    if (t < 8) L.err[t] = 0;
    if (t == 0) {
        *L.parity = 0;
        *L.n_miss = 0;
    }
}

// kvswap_layer_forget: chunks [first, first + n) of a layer become never
// stored (n <= cap - first, checked on the host). A slot holding one of them
// is emptied, and every empty slot becomes least recently used, in ascending
// slot index, ahead of the slots holding chunks (which keep their order).
// Empty slots are always that prefix of the order (a swap-in takes its
// victims from the front and never leaves one empty), so forgetting every
// chunk gives the state kvswap_init_layer makes, counters and error record
// aside; src/residency.rs's `forget` is the reference. Every block clears
// stored bits (grid-stride); block 0 also does the slots of a swapping layer.
extern "C" __global__ void kvswap_forget(LayerDev L, u32 first, u32 n) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    if (n == 0) return;
    const u32 last = first + n - 1;
    const u32 w0 = first >> 5, w1 = last >> 5;
    for (u32 w = w0 + t; w <= w1; w += nt) {
        u32 mask = KV_NONE;
        if (w == w0) mask &= KV_NONE << (first & 31u);
        if (w == w1) mask &= KV_NONE >> (31u - (last & 31u));
        L.stored[w] &= ~mask;
    }
    if (L.identity || blockIdx.x != 0) return;
    const u32 tid = threadIdx.x;
    for (u32 s = tid; s < L.slots; s += blockDim.x) {
        const u32 c = L.slot_chunk[s];
        if (c != KV_NONE && c - first < n) {
            L.slot_chunk[s] = KV_NONE;
            L.chunk_slot[c] = KV_NONE;
        }
    }
    __syncthreads();
    const u32 parity = *L.parity;
    const u32* cur = L.lru + parity * L.slots;
    u32* nxt = L.lru + (1u - parity) * L.slots;
    const u32 empty = block_compact(
        L.slots, [&](u32 s) { return L.slot_chunk[s] == KV_NONE; }, [&](u32 s, u32 r) { nxt[r] = s; });
    block_compact(
        L.slots, [&](u32 p) { return L.slot_chunk[cur[p]] != KV_NONE; }, [&](u32 p, u32 r) { nxt[empty + r] = cur[p]; });
    if (tid == 0) *L.parity = 1u - parity;
}

// Markers in the per-entry slot array of kvswap_swap_in (all >= KV_CLAIM).
#define KV_BAD 0xFFFFFFFDu
#define KV_FIRST_MISS 0xFFFFFFFEu
// A fully resident layer (swap off): validate, count distinct hits, rewrite
// id -> window + id. Uses the global per-slot flags (slots == cap can be large).
__device__ void swap_in_identity(const LayerDev& L, i32* e, u32 window, u32 count) {
    const u32 tid = threadIdx.x, nt = blockDim.x;
    u32 hits = 0;
    for (u32 i = tid; i < count; i += nt) {
        const i32 id = e[i];
        if (id == -1) continue;
        if (atomicExch(&L.selected[id], 1u) == 0u) ++hits;
        e[i] = (i32)window + id;
    }
    hits = block_sum(hits);
    for (u32 i = tid; i < count; i += nt) {
        const i32 p = e[i];
        if (p != -1) L.selected[p - (i32)window] = 0;
    }
    if (tid == 0) {
        L.stats[KV_STAT_HITS] += hits;
        L.stats[KV_STAT_CALLS] += 1;
        *L.n_miss = 0;
    }
}

// The residency decision of one swap_in_selected call. One block (up to 1024
// threads). The entries, their slots, the LRU order and the selected flags
// are staged in shared memory (dynamic: 4 * (3 * count + 2 * slots) bytes for
// a swapping layer, 0 for a fully resident one), so each phase costs shared-
// memory latency, not L2 latency. `strict`: on any bad entry, record the
// error and change nothing; otherwise bad entries become -1.
// The body of kvswap_swap_in and of each block of kvswap_swap_in_multi.
__device__ __forceinline__ void swap_in_block(const LayerDev& L, i32* indices, u32 window, u32 count, u32 strict) {
    extern __shared__ u32 smem[];
    __shared__ u32 s_err_pos;
    i32* e = indices + window;
    const u32 tid = threadIdx.x, nt = blockDim.x;
    const bool swap = !L.identity;
    i32* sh_e = (i32*)smem;                 // [count] entries
    u32* sh_slot = smem + count;            // [count] slot, KV_NONE (miss), KV_BAD, KV_FIRST_MISS
    u32* sh_miss = sh_slot + count;         // [count] chunk of miss r
    u32* sh_cur = sh_miss + count;          // [slots] current LRU order
    u32* sh_sel = sh_cur + L.slots;         // [slots] selected by this call
    if (tid == 0) s_err_pos = KV_NONE;
    __syncthreads();

    // Load and validate every entry before changing anything.
    for (u32 i = tid; i < count; i += nt) {
        const i32 id = e[i];
        const bool bad = id != -1 && (id < 0 || (u32)id >= L.cap || !is_stored(L, (u32)id));
        if (bad) atomicMin(&s_err_pos, i);
        if (swap) {
            sh_e[i] = id;
            sh_slot[i] = bad ? KV_BAD : (id == -1 ? KV_NONE : L.chunk_slot[id]);
        }
    }
    const u32 parity = *L.parity;
    const u32* cur = L.lru + parity * L.slots;
    u32* nxt = L.lru + (1u - parity) * L.slots;
    if (swap) {
        for (u32 p = tid; p < L.slots; p += nt) {
            sh_cur[p] = cur[p];
            sh_sel[p] = 0u;
        }
    }
    __syncthreads();
    if (s_err_pos != KV_NONE) {
        if (tid == 0) {
            const i32 id = e[s_err_pos];
            const u32 code = (id < 0 || (u32)id >= L.cap) ? KV_ERR_OUT_OF_RANGE : KV_ERR_NOT_STORED;
            record_error(L.err, code, s_err_pos, (u32)id);
        }
        if (strict) {
            if (tid == 0) *L.n_miss = KV_NONE;  // refused: gather and validate skip
            return;  // uniform: s_err_pos is shared
        }
        __syncthreads();  // the first bad entry was read before it is overwritten
        for (u32 i = tid; i < count; i += nt) {
            const i32 id = e[i];
            if (id == -1) continue;
            if (id < 0 || (u32)id >= L.cap || !is_stored(L, (u32)id)) {
                e[i] = -1;
                if (swap) sh_e[i] = -1;
            }
        }
        __syncthreads();
    }
    if (!swap) {
        swap_in_identity(L, e, window, count);
        return;
    }

    // Hits mark their slot selected; misses claim their chunk with the lowest
    // position at which they appear (KV_CLAIM | position < KV_NONE).
    for (u32 i = tid; i < count; i += nt) {
        const i32 id = sh_e[i];
        if (id == -1) continue;
        const u32 s = sh_slot[i];
        if (s < KV_CLAIM) sh_sel[s] = 1u;
        else atomicMin(&L.chunk_slot[id], KV_CLAIM | i);
    }
    __syncthreads();
    for (u32 i = tid; i < count; i += nt) {
        const i32 id = sh_e[i];
        if (id != -1 && sh_slot[i] == KV_NONE && L.chunk_slot[id] == (KV_CLAIM | i)) sh_slot[i] = KV_FIRST_MISS;
    }
    __syncthreads();

    // Misses in order of first appearance.
    const u32 n_miss = block_compact(
        count, [&](u32 i) { return sh_slot[i] == KV_FIRST_MISS; }, [&](u32 i, u32 r) { sh_miss[r] = (u32)sh_e[i]; });

    // Victims: the first n_miss unselected slots in LRU order. Miss r takes
    // victim r; the victim becomes selected.
    u32 evictions = 0;
    block_compact(
        L.slots,
        [&](u32 p) { return sh_sel[sh_cur[p]] == 0u; },
        [&](u32 p, u32 r) {
            if (r >= n_miss) return;
            const u32 s = sh_cur[p], id = sh_miss[r];
            const u32 old = L.slot_chunk[s];
            if (old != KV_NONE) {
                L.chunk_slot[old] = KV_NONE;
                ++evictions;
            }
            L.slot_chunk[s] = id;
            L.chunk_slot[id] = s;
            sh_sel[s] = 1u;
            L.miss_list[2 * r] = s;
            L.miss_list[2 * r + 1] = id;
        });
    evictions = block_sum(evictions);

    // Rewrite every entry to its physical id (misses read their new slot).
    for (u32 i = tid; i < count; i += nt) {
        const i32 id = sh_e[i];
        if (id == -1) continue;
        const u32 s = sh_slot[i] < KV_CLAIM ? sh_slot[i] : L.chunk_slot[id];
        e[i] = (i32)window + (i32)s;
    }

    // New LRU order: unselected slots keep their order, then the selected
    // slots in ascending slot index.
    const u32 kept = block_compact(
        L.slots, [&](u32 p) { return sh_sel[sh_cur[p]] == 0u; }, [&](u32 p, u32 r) { nxt[r] = sh_cur[p]; });
    const u32 n_selected = block_compact(
        L.slots, [&](u32 s) { return sh_sel[s] != 0u; }, [&](u32 s, u32 r) { nxt[kept + r] = s; });
    if (tid == 0) {
        *L.parity = 1u - parity;
        L.stats[KV_STAT_HITS] += n_selected - n_miss;
        L.stats[KV_STAT_MISSES] += n_miss;
        L.stats[KV_STAT_EVICTIONS] += evictions;
        L.stats[KV_STAT_CALLS] += 1;
        L.stats[KV_STAT_H2D] += (u64)n_miss * L.chunk_bytes;
        *L.n_miss = n_miss;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
kvswap_swap_in(LayerDev L, i32* indices, u32 window, u32 count, u32 strict) {
    allow_dependents();
    swap_in_block(L, indices, window, count, strict);
}

// kvswap_swap_in_layers with KVSWAP_SYNC=1: one request's ids (its
// entries, or the shared top-k) checked as swap_in_block checks them before
// any layer changes. Writes only the layer's error record: the code,
// position and id of the first bad entry, as the swap-in would. One block.
extern "C" __global__ void __launch_bounds__(1024) kvswap_check_entries(LayerDev L, const i32* ids, u32 count) {
    __shared__ u32 s_err_pos;
    if (threadIdx.x == 0) s_err_pos = KV_NONE;
    __syncthreads();
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) {
        const i32 id = ids[i];
        if (id != -1 && (id < 0 || (u32)id >= L.cap || !is_stored(L, (u32)id))) atomicMin(&s_err_pos, i);
    }
    __syncthreads();
    if (threadIdx.x == 0 && s_err_pos != KV_NONE) {
        const i32 id = ids[s_err_pos];
        record_error(L.err, (id < 0 || (u32)id >= L.cap) ? KV_ERR_OUT_OF_RANGE : KV_ERR_NOT_STORED, s_err_pos, (u32)id);
    }
}

// The swap-ins of several layers in one launch (kvswap_swap_in_layers): one
// block per request, each what kvswap_swap_in does for its layer (never
// strict), after copying the shared top-k `src` (when not NULL) into the
// request's entries. The layers' LayerDev are read from a table on the
// device (written when the context is made); dynamic shared memory and the
// block size are the largest any request needs (the block's result does not
// depend on its size).
#define KV_MULTI_MAX 64u
struct MultiReq {
    i32* indices;
    u32 layer;   // index into the LayerDev table
    u32 window;
    u32 count;
    u32 width;   // the gather's copy word size for this layer (warp_copy)
};
struct MultiReqs {
    const i32* src;
    u32 n;
    u32 pad;
    MultiReq r[KV_MULTI_MAX];
};

extern "C" __global__ void __launch_bounds__(1024)
kvswap_swap_in_multi(const LayerDev* table, MultiReqs q) {
    allow_dependents();
    const MultiReq r = q.r[blockIdx.x];
    const LayerDev L = table[r.layer];
    if (q.src) {
        i32* e = r.indices + r.window;
        for (u32 i = threadIdx.x; i < r.count; i += blockDim.x) e[i] = q.src[i];
        __syncthreads();  // the block reads its entries back below
    }
    swap_in_block(L, r.indices, r.window, r.count, 0u);
}

// Copies `n` words of type T from src to dst with one warp, 4 loads in
// flight per lane (reads from the mapped host tier cross PCIe: one load at a
// time per lane would leave the copy bound by its latency).
template <typename T>
__device__ __forceinline__ void warp_copy_words(u8* dst, const u8* src, u64 n) {
    const u32 lane = threadIdx.x & 31u;
    const T* s = (const T*)src;
    T* d = (T*)dst;
    u64 i = lane;
    for (; i + 96 < n; i += 128) {
        const T a = s[i], b = s[i + 32], c = s[i + 64], f = s[i + 96];
        d[i] = a;
        d[i + 32] = b;
        d[i + 64] = c;
        d[i + 96] = f;
    }
    for (; i < n; i += 32) d[i] = s[i];
}

// Copies `bytes` bytes from src to dst with one warp, in words of `width`
// bytes (16, 8, 4 or 1: the host's choice, which divides both addresses and
// the size of every copy of the launch).
__device__ __forceinline__ void warp_copy(u8* dst, const u8* src, u64 bytes, u32 width) {
    switch (width) {
        case 16: warp_copy_words<uint4>(dst, src, bytes / 16); break;
        case 8: warp_copy_words<u64>(dst, src, bytes / 8); break;
        case 4: warp_copy_words<u32>(dst, src, bytes / 4); break;
        default: warp_copy_words<u8>(dst, src, bytes); break;
    }
}

// One launch gathers every miss of the last kvswap_swap_in from the mapped
// host tier into its slot. Each warp copies KV_PIECE-byte pieces.
__device__ __forceinline__ void gather_block(const LayerDev& L, u32 width) {
    const u32 n = *L.n_miss;
    if (n == KV_NONE) return;  // the call was refused
    const u64 pieces = (L.chunk_bytes + KV_PIECE - 1) / KV_PIECE;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = (gridDim.x * (u64)blockDim.x) >> 5;
    for (u64 t = warp; t < n * pieces; t += nwarps) {
        const u64 r = t / pieces, q = t % pieces;
        const u32 s = L.miss_list[2 * r], id = L.miss_list[2 * r + 1];
        const u64 off = q * KV_PIECE;
        const u64 len = min((u64)KV_PIECE, L.chunk_bytes - off);
        warp_copy(L.staging + s * L.stride + off, L.host_tier + id * L.chunk_bytes + off, len, width);
    }
}

extern "C" __global__ void kvswap_gather(LayerDev L, u32 width) {
    wait_prerequisites();  // launched early (programmatic dependent launch)
    gather_block(L, width);
}

// The gather of a kvswap_swap_in_multi launch: request blockIdx.y's misses,
// over the blocks of row blockIdx.y.
extern "C" __global__ void kvswap_gather_multi(const LayerDev* table, MultiReqs q) {
    wait_prerequisites();  // launched early (programmatic dependent launch)
    const MultiReq r = q.r[blockIdx.y];
    gather_block(table[r.layer], r.width);
}

#define KV_STORE_MAX 256u

// Ids of one store launch and the source row of each, by value
// (graph-capturable, no host buffer).
struct StoreIds {
    u32 n;
    u32 ids[KV_STORE_MAX];
    u32 rows[KV_STORE_MAX];
};

// Copies chunk ids.ids[i] from src + ids.rows[i] * src_stride into the mapped
// host tier (and into its slot when resident), then marks it stored. Ids are
// distinct within a launch.
extern "C" __global__ void kvswap_store(LayerDev L, const u8* src, u64 src_stride, StoreIds ids, u32 width) {
    const u64 pieces = (L.chunk_bytes + KV_PIECE - 1) / KV_PIECE;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = (gridDim.x * (u64)blockDim.x) >> 5;
    const u32 lane = threadIdx.x & 31u;
    for (u64 t = warp; t < ids.n * pieces; t += nwarps) {
        const u64 r = t / pieces, q = t % pieces;
        const u32 id = ids.ids[r];
        const u64 off = q * KV_PIECE;
        const u64 len = min((u64)KV_PIECE, L.chunk_bytes - off);
        const u8* from = src + ids.rows[r] * src_stride + off;
        warp_copy(L.host_tier + id * L.chunk_bytes + off, from, len, width);
        const u32 s = L.identity ? id : L.chunk_slot[id];
        if (s < KV_CLAIM) warp_copy(L.staging + s * L.stride + off, from, len, width);
        if (q == 0 && lane == 0) {
            // A refresh: the slot already held this chunk (on a fully
            // resident layer the first store fills the slot).
            const u32 was = atomicOr(&L.stored[id >> 5], 1u << (id & 31)) & (1u << (id & 31));
            if (s < KV_CLAIM && (!L.identity || was)) atomicAdd(&L.stats[KV_STAT_REFRESHES], 1ull);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(&L.stats[KV_STAT_STORES], (u64)ids.n);
        atomicAdd(&L.stats[KV_STAT_D2H], (u64)ids.n * L.chunk_bytes);
    }
}

// KVSWAP_VALIDATE=1: every selected slot of the last call equals its host
// copy. The error names the lowest mismatching position, as the CPU backend
// does: every mismatch goes into an atomic maximum of ~(position << 32 |
// id) (0: none), and the last block to finish records the lowest one (first
// error wins, as for every other error) and clears the word and its count.
extern "C" __global__ void kvswap_validate(LayerDev L, const i32* indices, u32 window, u32 count) {
    if (*L.n_miss == KV_NONE) return;  // the call was refused: nothing was staged (every block returns)
    u64* lowest = (u64*)(L.err + 6);
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = (gridDim.x * (u64)blockDim.x) >> 5;
    const u32 lane = threadIdx.x & 31u;
    for (u64 i = warp; i < count; i += nwarps) {
        const i32 p = indices[window + i];
        if (p < (i32)window || p >= (i32)(window + L.slots)) continue;
        const u32 s = (u32)(p - (i32)window);
        const u32 id = L.identity ? s : L.slot_chunk[s];
        const u8* a = L.staging + s * L.stride;
        const u8* b = L.host_tier + id * L.chunk_bytes;
        bool same = true;
        for (u64 k = lane; k < L.chunk_bytes; k += 32) same &= a[k] == b[k];
        if (!__all_sync(KVS_FULL_MASK, same) && lane == 0) atomicMax(lowest, ~(((u64)i << 32) | id));
    }
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&L.err[4], 1u) == gridDim.x - 1;
    __syncthreads();
    if (s_last && threadIdx.x == 0) {
        __threadfence();  // every block's maximum is in
        const u64 v = atomicExch(lowest, 0ull);
        L.err[4] = 0;
        if (v != 0) {
            const u64 p = ~v;
            record_error(L.err, KV_ERR_VALIDATION, (u32)(p >> 32), (u32)p);
        }
    }
}
