/*
 * C11 test of the kvswap C ABI (include/kvswap.h), on the backend that
 * KVSWAP_TEST_BACKEND selects: cpu (default) or cuda (see devmem.h).
 *
 * Every function of the header is called; the residency rules of DESIGN.md
 * are checked slot by slot over a hand-derived script and then against a
 * small reference model; every guard is checked for its status, a useful
 * kvswap_last_error() and an unchanged state afterwards.
 *
 * Every pointer handed to kvswap goes through the devmem adapter: store
 * sources, index buffers and engine-owned staging are device memory on CUDA
 * (host memory on the CPU backend), uploaded before a call and read back
 * after it, and staged bytes are read through kvswap_layer_staging's pointer
 * after the stream is synchronised. On CUDA every call gets a real stream;
 * the CUDA-only checks (legacy stream and host pointers refused) are in
 * test_streams_and_pointers.
 *
 * Prints one line per test group; exits 1 at the first failure with
 * file:line and the text of kvswap_last_error().
 */
#define _POSIX_C_SOURCE 200809L

#include "kvswap.h"
#include "devmem.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------ */
/* Checks                                                                   */
/* ------------------------------------------------------------------------ */

static const char *last_err(void) {
    const char *e = kvswap_last_error();
    return e ? e : "(kvswap_last_error() returned NULL!)";
}

static const char *sname(enum KvswapStatus s) { return kvswap_status_name((int32_t)s); }

#define FAIL_AT(line, ...)                                                                   \
    do {                                                                                     \
        fprintf(stderr, "%s:%d: FAILED: ", __FILE__, (int)(line));                           \
        fprintf(stderr, __VA_ARGS__);                                                        \
        fprintf(stderr, "\n  kvswap_last_error(): \"%s\"\n", last_err());                    \
        fflush(stderr);                                                                      \
        exit(1);                                                                             \
    } while (0)
#define FAIL(...) FAIL_AT(__LINE__, __VA_ARGS__)

#define CHECK_AT(line, cond)                                                                 \
    do {                                                                                     \
        if (!(cond)) FAIL_AT(line, "CHECK(%s)", #cond);                                      \
    } while (0)
#define CHECK(cond) CHECK_AT(__LINE__, cond)

#define CHECK_EQ(a, b)                                                                       \
    do {                                                                                     \
        long long a_ = (long long)(a), b_ = (long long)(b);                                  \
        if (a_ != b_) FAIL("CHECK_EQ(%s, %s): %lld != %lld", #a, #b, a_, b_);                \
    } while (0)

#define CHECK_OK_AT(line, expr)                                                              \
    do {                                                                                     \
        enum KvswapStatus s_ = (expr);                                                       \
        if (s_ != KVSWAP_STATUS_OK)                                                          \
            FAIL_AT(line, "%s returned %s, expected KVSWAP_STATUS_OK", #expr, sname(s_));    \
    } while (0)
#define CHECK_OK(expr) CHECK_OK_AT(__LINE__, expr)

#define CHECK_MSG_AT(line, substr)                                                           \
    do {                                                                                     \
        if (!strstr(last_err(), (substr)))                                                   \
            FAIL_AT(line, "kvswap_last_error() does not contain \"%s\"", (substr));          \
    } while (0)
#define CHECK_MSG(substr) CHECK_MSG_AT(__LINE__, substr)

/* The call fails with `want` and kvswap_last_error() contains `substr`. */
#define CHECK_ERR_AT(line, expr, want, substr)                                               \
    do {                                                                                     \
        enum KvswapStatus s_ = (expr);                                                       \
        if (s_ != (want))                                                                    \
            FAIL_AT(line, "%s returned %s, expected %s", #expr, sname(s_), sname(want));     \
        CHECK_MSG_AT(line, substr);                                                          \
    } while (0)
#define CHECK_ERR(expr, want, substr) CHECK_ERR_AT(__LINE__, expr, want, substr)

static void group_done(const char *name) {
    printf("ok   %s\n", name);
    fflush(stdout);
}

/* ------------------------------------------------------------------------ */
/* Pointers handed to kvswap, through the devmem adapter                     */
/* ------------------------------------------------------------------------ */

/* The stream every kvswap call of the test uses: dm_stream() (NULL on the
 * CPU backend, the main CUstream on CUDA) unless a test switches it. */
static void *g_stream;
static bool g_stream_set;

static void *cur_stream(void) { return g_stream_set ? g_stream : dm_stream(); }

/* Switches the stream of the following calls, after waiting for the work
 * of the current one (streams are not ordered with each other). */
static void use_stream(void *s) {
    dm_stream_sync(cur_stream());
    dm_sync();
    g_stream = s;
    g_stream_set = true;
}

/* A reusable "device" buffer. On the CPU backend it is reallocated at the
 * exact size of each use, so that ASan and valgrind see any access past the
 * bytes a call may touch; on CUDA it only grows (cuMemFree waits for the
 * device). Uploads into it are ordered after earlier calls on the main
 * stream, which may still read it. */
typedef struct Scratch {
    void *p;
    size_t cap;
} Scratch;

static Scratch g_idx, g_src;

static void *scratch_get(Scratch *s, size_t n) {
    if (s->p && (dm_is_cuda() ? n <= s->cap : n == s->cap)) return s->p;
    dm_free(s->p);
    s->p = dm_alloc(n);
    s->cap = n;
    return s->p;
}

static void scratch_release(Scratch *s) {
    dm_free(s->p);
    s->p = NULL;
    s->cap = 0;
}

/* Before a call on `stream`: work of the main stream (an upload) is done. */
static void before_call(void *stream) {
    if (stream != dm_stream()) dm_sync();
}

/* After a call on `stream`: its work is done before the main stream goes on. */
static void after_call(void *stream) {
    if (stream != dm_stream()) dm_stream_sync(stream);
}

/* kvswap_store of `bytes` host bytes, uploaded to a device buffer first. */
static enum KvswapStatus store_on(void *stream, KvswapContext *ctx, uint32_t layer, int32_t id, const void *src, size_t bytes) {
    void *d = scratch_get(&g_src, bytes);
    dm_upload(d, src, bytes);
    before_call(stream);
    enum KvswapStatus s = kvswap_store(ctx, layer, id, d, stream);
    after_call(stream);
    return s;
}

/* kvswap_store_batch from `src_bytes` host bytes (the rows and what lies
 * between them), uploaded to a device buffer first. `ids` is host memory. */
static enum KvswapStatus store_batch_on(void *stream, KvswapContext *ctx, uint32_t layer, const int32_t *ids, size_t n,
                                        const void *src, size_t src_bytes, size_t src_stride) {
    void *d = scratch_get(&g_src, src_bytes);
    dm_upload(d, src, src_bytes);
    before_call(stream);
    enum KvswapStatus s = kvswap_store_batch(ctx, layer, ids, n, d, src_stride, stream);
    after_call(stream);
    return s;
}

/* kvswap_swap_in_selected over the `n` entries of `buf` (the window, the
 * selection and anything after it): uploaded to a device buffer before the
 * call and downloaded back into `buf` after it, whatever its outcome. */
static enum KvswapStatus swap_on(void *stream, KvswapContext *ctx, uint32_t layer, int32_t *buf, size_t n, uint32_t window,
                                 uint32_t count) {
    size_t bytes = n * sizeof(int32_t);
    int32_t *d = (int32_t *)scratch_get(&g_idx, bytes);
    dm_upload(d, buf, bytes);
    before_call(stream);
    enum KvswapStatus s = kvswap_swap_in_selected(ctx, layer, d, window, count, stream);
    after_call(stream);
    dm_sync();
    dm_download(buf, d, bytes);
    return s;
}

#define store_dev(ctx, layer, id, src, bytes) store_on(cur_stream(), ctx, layer, id, src, bytes)
#define store_batch_dev(ctx, layer, ids, n, src, src_bytes, stride) \
    store_batch_on(cur_stream(), ctx, layer, ids, n, src, src_bytes, stride)
#define swap_dev(ctx, layer, buf, n, window, count) swap_on(cur_stream(), ctx, layer, buf, n, window, count)

/* A host copy of `rows` staging rows of `chunk_bytes` at `stride` from
 * `ptr` (a pointer of kvswap_layer_staging or an engine staging buffer),
 * read after the stream is synchronised. Free it with free(). */
static uint8_t *staging_copy(const void *ptr, size_t stride, uint32_t rows, size_t chunk_bytes) {
    size_t span = rows ? (size_t)(rows - 1) * stride + chunk_bytes : 1;
    uint8_t *h = (uint8_t *)malloc(span);
    if (!h) FAIL("out of host memory");
    dm_stream_sync(cur_stream());
    dm_sync();
    if (rows) dm_download(h, ptr, span);
    return h;
}

/* A device buffer holding a copy of `bytes` host bytes (free with dm_free). */
static void *dev_copy(const void *src, size_t bytes) {
    void *d = dm_alloc(bytes);
    dm_upload(d, src, bytes);
    return d;
}

/* ------------------------------------------------------------------------ */
/* Chunk contents: a deterministic function of (layer, id, version)          */
/* ------------------------------------------------------------------------ */

#define MAX_CB 4096

static void fill_chunk(uint8_t *dst, size_t n, uint32_t layer, uint32_t id, uint32_t version) {
    uint32_t h = (layer + 1u) * 0x9E3779B1u ^ (id + 1u) * 0x85EBCA77u ^ (version + 1u) * 0xC2B2AE3Du;
    for (size_t i = 0; i < n; i++) {
        h = h * 1664525u + 1013904223u;
        dst[i] = (uint8_t)(h >> 24);
    }
}

static bool chunk_is(const uint8_t *p, size_t n, uint32_t layer, uint32_t id, uint32_t version) {
    uint8_t want[MAX_CB];
    if (n > MAX_CB) return false;
    fill_chunk(want, n, layer, id, version);
    return memcmp(p, want, n) == 0;
}

/* ------------------------------------------------------------------------ */
/* Reference model of the residency rules of DESIGN.md                       */
/* ------------------------------------------------------------------------ */

#define MAX_SLOTS 64
#define MAX_CAP 1024

typedef struct Model {
    uint32_t cap, slots;
    int32_t slot_chunk[MAX_SLOTS]; /* -1: empty */
    int32_t chunk_slot[MAX_CAP];   /* -1: not resident */
    uint64_t last_used[MAX_SLOTS]; /* 0: never used */
    uint64_t t;
    uint64_t hits, misses, evictions;
} Model;

static void model_init(Model *m, uint32_t cap, uint32_t slots) {
    memset(m, 0, sizeof *m);
    m->cap = cap;
    m->slots = slots;
    for (uint32_t s = 0; s < MAX_SLOTS; s++) m->slot_chunk[s] = -1;
    for (uint32_t c = 0; c < MAX_CAP; c++) m->chunk_slot[c] = -1;
}

/* Applies one successful swap-in call to `e[0..count)` (logical ids, -1 padding)
 * and rewrites them to physical ids `window + slot`, as the library must. */
static void model_swap(Model *m, int32_t *e, uint32_t count, uint32_t window) {
    bool selected[MAX_SLOTS] = {false};
    m->t++;
    /* Hits first: they are not victims. Counted once per distinct chunk. */
    for (uint32_t i = 0; i < count; i++) {
        if (e[i] == -1) continue;
        int32_t s = m->chunk_slot[e[i]];
        if (s >= 0 && !selected[s]) {
            selected[s] = true;
            m->hits++;
        }
    }
    /* Misses in order of first appearance take the least recently used
     * unselected slot, ties to the lower slot index. */
    for (uint32_t i = 0; i < count; i++) {
        if (e[i] == -1) continue;
        int32_t id = e[i];
        int32_t s = m->chunk_slot[id];
        if (s < 0) {
            int32_t best = -1;
            for (uint32_t k = 0; k < m->slots; k++) {
                if (selected[k]) continue;
                if (best < 0 || m->last_used[k] < m->last_used[best]) best = (int32_t)k;
            }
            if (best < 0) {
                fprintf(stderr, "model: more distinct ids than slots\n");
                exit(1);
            }
            s = best;
            if (m->slot_chunk[s] >= 0) {
                m->chunk_slot[m->slot_chunk[s]] = -1;
                m->evictions++;
            }
            m->slot_chunk[s] = id;
            m->chunk_slot[id] = s;
            selected[s] = true;
            m->misses++;
        }
        e[i] = (int32_t)window + s;
    }
    for (uint32_t k = 0; k < m->slots; k++)
        if (selected[k]) m->last_used[k] = m->t;
}

/* kvswap_layer_forget of chunks [first, first + n): a slot holding one is
 * emptied and becomes "never used" (least recently used, ties to the lower
 * slot index: ahead of every slot holding a chunk, in slot order). */
static void model_forget(Model *m, uint32_t first, uint32_t n) {
    for (uint32_t s = 0; s < m->slots; s++) {
        int32_t c = m->slot_chunk[s];
        if (c >= 0 && (uint32_t)c - first < n) {
            m->chunk_slot[c] = -1;
            m->slot_chunk[s] = -1;
            m->last_used[s] = 0;
        }
    }
}

static uint32_t model_resident(const Model *m) {
    uint32_t n = 0;
    for (uint32_t s = 0; s < m->slots; s++) n += m->slot_chunk[s] >= 0;
    return n;
}

/* ------------------------------------------------------------------------ */
/* Helpers around one layer of a context                                     */
/* ------------------------------------------------------------------------ */

typedef struct Layer {
    KvswapContext *ctx;
    uint32_t layer;
    uint32_t cap, slots;
    size_t chunk_bytes;
    Model model;
    uint32_t version[MAX_CAP]; /* 0: never stored (or forgotten); else the version last stored */
    uint32_t high[MAX_CAP];    /* the highest version ever stored: a forgotten chunk stored again gets new bytes */
    uint64_t stores, swap_calls;
} Layer;

/* The defaults, on the backend under test (dm_backend()). */
static KvswapConfig test_config(uint32_t enable, uint32_t gpu_chunks, uint32_t index_topk) {
    KvswapConfig c;
    CHECK_OK(kvswap_config_default(&c));
    c.backend = dm_backend();
    c.enable = enable;
    c.gpu_chunks = gpu_chunks;
    c.index_topk = index_topk;
    return c;
}

static KvswapLayerSpec layer_spec(uint64_t cap, uint64_t chunk_bytes) {
    KvswapLayerSpec s;
    memset(&s, 0, sizeof s);
    s.compressed_cap = cap;
    s.chunk_bytes = chunk_bytes;
    s.staging = NULL;
    s.staging_stride = 0;
    return s;
}

static KvswapContext *create_ok_at(int line, const KvswapConfig *cfg, const KvswapLayerSpec *specs, size_t n) {
    KvswapContext *ctx = NULL;
    CHECK_OK_AT(line, kvswap_create(cfg, specs, n, &ctx));
    CHECK_AT(line, ctx != NULL);
    return ctx;
}
#define create_ok(cfg, specs, n) create_ok_at(__LINE__, cfg, specs, n)

static void layer_init(Layer *L, KvswapContext *ctx, uint32_t layer, uint32_t cap, uint32_t slots, size_t cb) {
    memset(L, 0, sizeof *L);
    L->ctx = ctx;
    L->layer = layer;
    L->cap = cap;
    L->slots = slots;
    L->chunk_bytes = cb;
    model_init(&L->model, cap, slots);
}

static void store_one_at(int line, Layer *L, uint32_t id) {
    uint8_t buf[MAX_CB];
    uint32_t v = (L->version[id] > L->high[id] ? L->version[id] : L->high[id]) + 1;
    fill_chunk(buf, L->chunk_bytes, L->layer, id, v);
    CHECK_OK_AT(line, store_dev(L->ctx, L->layer, (int32_t)id, buf, L->chunk_bytes));
    L->version[id] = L->high[id] = v;
    L->stores++;
}
#define store_one(L, id) store_one_at(__LINE__, L, id)

static KvswapLayerStats stats_of_at(int line, KvswapContext *ctx, uint32_t layer) {
    KvswapLayerStats s;
    memset(&s, 0xA5, sizeof s);
    CHECK_OK_AT(line, kvswap_layer_stats(ctx, layer, &s));
    return s;
}
#define stats_of(ctx, layer) stats_of_at(__LINE__, ctx, layer)

/* Every slot the model says is occupied holds the bytes last stored for its chunk. */
static void check_staged_at(int line, Layer *L) {
    void *ptr = NULL;
    size_t stride = 0;
    uint32_t rows = 0;
    CHECK_OK_AT(line, kvswap_layer_staging(L->ctx, L->layer, &ptr, &stride, &rows));
    CHECK_AT(line, ptr != NULL);
    CHECK_AT(line, rows == L->slots);
    CHECK_AT(line, stride >= L->chunk_bytes);
    uint8_t *rows_copy = staging_copy(ptr, stride, rows, L->chunk_bytes);
    for (uint32_t s = 0; s < L->slots; s++) {
        int32_t id = L->model.slot_chunk[s];
        if (id < 0) continue;
        const uint8_t *row = rows_copy + (size_t)s * stride;
        if (!chunk_is(row, L->chunk_bytes, L->layer, (uint32_t)id, L->version[id]))
            FAIL_AT(line, "layer %u slot %u: staged bytes are not chunk %d version %u", L->layer, s, id,
                    L->version[id]);
    }
    free(rows_copy);
}
#define check_staged(L) check_staged_at(__LINE__, L)

/* The layer's counters equal what the model and the test counted. */
static void check_stats_at(int line, Layer *L) {
    KvswapLayerStats s = stats_of_at(line, L->ctx, L->layer);
    if (s.hits != L->model.hits || s.misses != L->model.misses || s.evictions != L->model.evictions)
        FAIL_AT(line, "layer %u stats hits/misses/evictions = %llu/%llu/%llu, model %llu/%llu/%llu", L->layer,
                (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.evictions,
                (unsigned long long)L->model.hits, (unsigned long long)L->model.misses,
                (unsigned long long)L->model.evictions);
    CHECK_AT(line, s.stores == L->stores);
    CHECK_AT(line, s.d2h_bytes == L->stores * L->chunk_bytes);
    CHECK_AT(line, s.h2d_bytes == L->model.misses * L->chunk_bytes);
    CHECK_AT(line, s.swap_in_calls == L->swap_calls);
    CHECK_AT(line, s.compressed_cap == L->cap);
    CHECK_AT(line, s.chunk_bytes == L->chunk_bytes);
    CHECK_AT(line, s.slots == L->slots);
    CHECK_AT(line, s.resident == model_resident(&L->model));
    CHECK_AT(line, s.swap_enabled == 1);
    CHECK_AT(line, s.reserved == 0);
}
#define check_stats(L) check_stats_at(__LINE__, L)

#define WIN_SENTINEL(i) (int32_t)(70000 + (i))
#define TAIL_SENTINEL (int32_t)0x5EED

/* One successful swap-in of `sel[0..count)` after a window of `window`
 * entries. The result must equal the model's, and `expected` when given (a
 * hand-derived answer). The window and one entry past the end stay
 * untouched; staged bytes and counters are checked afterwards. */
static void swap_ok_at(int line, Layer *L, uint32_t window, uint32_t count, const int32_t *sel, const int32_t *expected) {
    int32_t buf[128], want[64];
    CHECK_AT(line, window + count + 1 <= 128 && count <= 64);
    for (uint32_t i = 0; i < window; i++) buf[i] = WIN_SENTINEL(i);
    for (uint32_t i = 0; i < count; i++) buf[window + i] = want[i] = sel[i];
    buf[window + count] = TAIL_SENTINEL;
    model_swap(&L->model, want, count, window);
    if (expected) {
        for (uint32_t i = 0; i < count; i++)
            if (want[i] != expected[i])
                FAIL_AT(line, "test bug: the model says entry %u -> %d, the script says %d", i, want[i], expected[i]);
    }
    CHECK_OK_AT(line, swap_dev(L->ctx, L->layer, buf, window + count + 1, window, count));
    L->swap_calls++;
    for (uint32_t i = 0; i < window; i++)
        if (buf[i] != WIN_SENTINEL(i)) FAIL_AT(line, "window entry %u changed to %d", i, buf[i]);
    if (buf[window + count] != TAIL_SENTINEL) FAIL_AT(line, "the entry after `count` was written");
    for (uint32_t i = 0; i < count; i++) {
        if (buf[window + i] != want[i]) {
            fprintf(stderr, "  selected:");
            for (uint32_t k = 0; k < count; k++) fprintf(stderr, " %d", sel[k]);
            fprintf(stderr, "\n  got:     ");
            for (uint32_t k = 0; k < count; k++) fprintf(stderr, " %d", buf[window + k]);
            fprintf(stderr, "\n  expected:");
            for (uint32_t k = 0; k < count; k++) fprintf(stderr, " %d", want[k]);
            fprintf(stderr, "\n");
            FAIL_AT(line, "entry %u (logical %d, window %u): physical %d, expected %d", i, sel[i], window,
                    buf[window + i], want[i]);
        }
    }
    check_staged_at(line, L);
    check_stats_at(line, L);
}
#define swap_ok(L, window, count, sel, expected) swap_ok_at(__LINE__, L, window, count, sel, expected)

/* Reveals the whole LRU order: selects `slots` distinct stored chunks that are
 * not resident, so every slot is a victim in LRU order. */
static void probe_lru_at(int line, Layer *L, uint32_t seed) {
    int32_t sel[MAX_SLOTS];
    uint32_t n = 0;
    for (uint32_t k = 0; k < L->cap && n < L->slots; k++) {
        uint32_t id = (k + seed) % L->cap;
        if (L->version[id] > 0 && L->model.chunk_slot[id] < 0) sel[n++] = (int32_t)id;
    }
    CHECK_AT(line, n == L->slots);
    swap_ok_at(line, L, 2, n, sel, NULL);
}
#define probe_lru(L, seed) probe_lru_at(__LINE__, L, seed)

/* Random inputs come from a fresh seed each run (KVSWAP_SEED replays one;
 * main prints it). */
static uint32_t rng_state = 12345u;

static uint32_t test_seed(void) {
    const char *s = getenv("KVSWAP_SEED");
    if (s != NULL && *s != '\0') return (uint32_t)strtoul(s, NULL, 10);
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (uint32_t)ts.tv_nsec ^ (uint32_t)ts.tv_sec;
}
static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return n ? rng_state % n : 0;
}

/* A random valid swap-in over stored chunks: padding, duplicates, hits, misses. */
static void random_swap_at(int line, Layer *L) {
    int32_t sel[MAX_SLOTS];
    uint32_t count = rnd(L->slots + 1);
    uint32_t window = rnd(6);
    for (uint32_t i = 0; i < count; i++) {
        uint32_t r = rnd(10);
        if (r == 0) {
            sel[i] = -1;
        } else if (r <= 2 && i > 0) {
            sel[i] = sel[rnd(i)]; /* duplicate (or padding) */
        } else {
            uint32_t id;
            do id = rnd(L->cap);
            while (L->version[id] == 0);
            sel[i] = (int32_t)id;
        }
    }
    swap_ok_at(line, L, window, count, sel, NULL);
}
#define random_swap(L) random_swap_at(__LINE__, L)

/* ------------------------------------------------------------------------ */
/* "State unchanged" snapshots for refused calls                             */
/* ------------------------------------------------------------------------ */

typedef struct Snapshot {
    KvswapLayerStats stats[4];
    uint32_t n;
} Snapshot;

static Snapshot snapshot_at(int line, KvswapContext *ctx, uint32_t n_layers) {
    Snapshot s;
    memset(&s, 0, sizeof s);
    s.n = n_layers;
    for (uint32_t l = 0; l < n_layers; l++) s.stats[l] = stats_of_at(line, ctx, l);
    return s;
}

static void same_snapshot_at(int line, KvswapContext *ctx, const Snapshot *before) {
    /* Read the stats without disturbing kvswap_last_error() of the refused call. */
    for (uint32_t l = 0; l < before->n; l++) {
        KvswapLayerStats now;
        memset(&now, 0, sizeof now);
        if (kvswap_layer_stats(ctx, l, &now) != KVSWAP_STATUS_OK) FAIL_AT(line, "layer_stats failed after refused call");
        if (memcmp(&now, &before->stats[l], sizeof now) != 0)
            FAIL_AT(line, "layer %u stats changed by a refused call (hits %llu->%llu misses %llu->%llu stores %llu->%llu calls %llu->%llu)",
                    l, (unsigned long long)before->stats[l].hits, (unsigned long long)now.hits,
                    (unsigned long long)before->stats[l].misses, (unsigned long long)now.misses,
                    (unsigned long long)before->stats[l].stores, (unsigned long long)now.stores,
                    (unsigned long long)before->stats[l].swap_in_calls, (unsigned long long)now.swap_in_calls);
    }
}

/* Placeholders in the selections of refused calls, resolved against the
 * current model state: the least recently used resident chunk (a wrongly
 * promoted hit would move it in the LRU order) and a stored chunk that is
 * not resident (a wrongly taken victim would show). */
#define PICK_LRU_RESIDENT (-1000)
#define PICK_FREE (-1001)

static int32_t resolve_pick(const Layer *L, int32_t v) {
    if (v == PICK_LRU_RESIDENT) {
        int32_t best = -1;
        for (uint32_t s = 0; s < L->slots; s++) {
            if (L->model.slot_chunk[s] < 0) continue;
            if (best < 0 || L->model.last_used[s] < L->model.last_used[best]) best = (int32_t)s;
        }
        if (best < 0) {
            fprintf(stderr, "test bug: no resident chunk\n");
            exit(1);
        }
        return L->model.slot_chunk[best];
    }
    if (v == PICK_FREE) {
        for (uint32_t id = 0; id < L->cap; id++)
            if (L->version[id] > 0 && L->model.chunk_slot[id] < 0) return (int32_t)id;
        fprintf(stderr, "test bug: no stored chunk outside the slots\n");
        exit(1);
    }
    return v;
}

/* A swap-in that must be refused with `want`, a message containing `substr`,
 * and leave the index buffer, every counter and the LRU order unchanged. */
static void swap_refused_at(int line, void *stream, Layer *L, KvswapContext *ctx, uint32_t layer, int32_t *indices_or_null,
                            const int32_t *sel, uint32_t window, uint32_t count, enum KvswapStatus want,
                            const char *substr, uint32_t n_layers) {
    int32_t buf[128], copy[128];
    uint32_t n = window + count + 1;
    if (indices_or_null) {
        CHECK_AT(line, n <= 128);
        for (uint32_t i = 0; i < window; i++) buf[i] = WIN_SENTINEL(i);
        for (uint32_t i = 0; i < count; i++) buf[window + i] = resolve_pick(L, sel[i]);
        buf[window + count] = TAIL_SENTINEL;
        memcpy(copy, buf, n * sizeof(int32_t));
    }
    Snapshot before = snapshot_at(line, L->ctx, n_layers);
    /* The index buffer is device memory on CUDA, read back after the call. */
    enum KvswapStatus s = indices_or_null ? swap_on(stream, ctx, layer, buf, n, window, count)
                                          : kvswap_swap_in_selected(ctx, layer, NULL, window, count, stream);
    if (s != want) FAIL_AT(line, "swap_in_selected returned %s, expected %s", sname(s), sname(want));
    CHECK_MSG_AT(line, substr);
    CHECK_MSG_AT(line, "kvswap_swap_in_selected");
    if (indices_or_null && memcmp(copy, buf, n * sizeof(int32_t)) != 0) FAIL_AT(line, "a refused swap-in changed the index buffer");
    same_snapshot_at(line, L->ctx, &before);
    check_staged_at(line, L);
    /* The LRU order is undisturbed: a full probe gives the model's slots. */
    probe_lru_at(line, L, rnd(L->cap));
}
#define swap_refused(L, ctx, layer, ind, sel, window, count, want, substr, nl) \
    swap_refused_at(__LINE__, cur_stream(), L, ctx, layer, ind, sel, window, count, want, substr, nl)
#define swap_refused_on(stream, L, ctx, layer, ind, sel, window, count, want, substr, nl) \
    swap_refused_at(__LINE__, stream, L, ctx, layer, ind, sel, window, count, want, substr, nl)

/* ------------------------------------------------------------------------ */
/* Test groups                                                               */
/* ------------------------------------------------------------------------ */

static void test_version_and_status_names(void) {
    const char *v = kvswap_version();
    CHECK(v != NULL);
    CHECK(strlen(v) > 0);
    CHECK(strchr(v, '.') != NULL);
    CHECK(kvswap_version() == v); /* static storage */

    static const struct {
        int32_t code;
        const char *name;
    } names[] = {
        {KVSWAP_STATUS_OK, "KVSWAP_STATUS_OK"},
        {KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_STATUS_INVALID_ARGUMENT"},
        {KVSWAP_STATUS_NULL_POINTER, "KVSWAP_STATUS_NULL_POINTER"},
        {KVSWAP_STATUS_OUT_OF_RANGE, "KVSWAP_STATUS_OUT_OF_RANGE"},
        {KVSWAP_STATUS_NOT_STORED, "KVSWAP_STATUS_NOT_STORED"},
        {KVSWAP_STATUS_PINNED_CAP, "KVSWAP_STATUS_PINNED_CAP"},
        {KVSWAP_STATUS_TOPK_GUARD, "KVSWAP_STATUS_TOPK_GUARD"},
        {KVSWAP_STATUS_NO_DEVICE, "KVSWAP_STATUS_NO_DEVICE"},
        {KVSWAP_STATUS_DEVICE_ERROR, "KVSWAP_STATUS_DEVICE_ERROR"},
        {KVSWAP_STATUS_OUT_OF_MEMORY, "KVSWAP_STATUS_OUT_OF_MEMORY"},
        {KVSWAP_STATUS_VALIDATION_FAILED, "KVSWAP_STATUS_VALIDATION_FAILED"},
        {KVSWAP_STATUS_WRONG_DEVICE, "KVSWAP_STATUS_WRONG_DEVICE"},
        {KVSWAP_STATUS_IO, "KVSWAP_STATUS_IO"},
        {KVSWAP_STATUS_BAD_CHECKPOINT, "KVSWAP_STATUS_BAD_CHECKPOINT"},
        {KVSWAP_STATUS_UNSUPPORTED, "KVSWAP_STATUS_UNSUPPORTED"},
        {KVSWAP_STATUS_PANIC, "KVSWAP_STATUS_PANIC"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *n = kvswap_status_name(names[i].code);
        CHECK(n != NULL);
        if (strcmp(n, names[i].name) != 0) FAIL("kvswap_status_name(%d) = \"%s\", expected \"%s\"", names[i].code, n, names[i].name);
    }
    const int32_t unknown[] = {-1, 15, 98, 100, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *n = kvswap_status_name(unknown[i]);
        CHECK(n != NULL);
        CHECK(strcmp(n, "KVSWAP_STATUS_UNKNOWN") == 0);
    }
    group_done("version, status_name");
}

static void check_default_config(const KvswapConfig *c) {
    CHECK_EQ(c->enable, 0);
    CHECK_EQ(c->gpu_chunks, 512);
    CHECK_EQ(c->pinned_mib, 16384);
    CHECK_EQ(c->sync, 1);
    CHECK_EQ(c->validate, 0);
    CHECK_EQ(c->test_allow_topk_reduction, 0);
    CHECK_EQ(c->index_topk, 512);
    CHECK_EQ(c->window, 128);
    CHECK_EQ(c->fm_ensemble, KVSWAP_ENSEMBLE_MAX);
    CHECK_EQ(c->mem_profile, 0);
    CHECK_EQ(c->backend, KVSWAP_BACKEND_AUTO);
    CHECK_EQ(c->device, 0);
    for (size_t i = 0; i < KVSWAP_PATH_MAX; i++) CHECK(c->fm_ckpt[i] == 0);
}

static void test_config_default(void) {
    KvswapConfig c;
    memset(&c, 0xA5, sizeof c);
    CHECK_OK(kvswap_config_default(&c));
    check_default_config(&c);
    CHECK_ERR(kvswap_config_default(NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    CHECK_MSG("kvswap_config_default");
    group_done("config_default matches DESIGN's settings table");
}

static const char *const ENV_NAMES[] = {
    "KVSWAP_ENABLE", "POCKETLLM_GGUF_KV_SWAP",
    "KVSWAP_GPU_CHUNKS", "POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS",
    "KVSWAP_PINNED_MIB", "POCKETLLM_GGUF_KV_SWAP_PINNED_MIB",
    "KVSWAP_SYNC", "POCKETLLM_GGUF_KV_SWAP_SYNC",
    "KVSWAP_VALIDATE", "POCKETLLM_GGUF_KV_SWAP_VALIDATE",
    "KVSWAP_TEST_ALLOW_TOPK_REDUCTION", "POCKETLLM_GGUF_KV_SWAP_TEST_ALLOW_TOPK_REDUCTION",
    "KVSWAP_INDEX_TOPK", "KVSWAP_WINDOW",
    "KVSWAP_FM_CKPT", "POCKETLLM_GGUF_FLASHMEMORY_CKPT",
    "KVSWAP_FM_ENSEMBLE", "POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE",
    "KVSWAP_MEM_PROFILE", "POCKETLLM_GGUF_MEM_PROFILE",
    "KVSWAP_BACKEND", "KVSWAP_DEVICE",
};

static void clear_env(void) {
    for (size_t i = 0; i < sizeof ENV_NAMES / sizeof ENV_NAMES[0]; i++) CHECK(unsetenv(ENV_NAMES[i]) == 0);
}

static void env_refused_at(int line, const char *var, const char *value) {
    KvswapConfig c, sentinel;
    clear_env();
    CHECK_AT(line, setenv(var, value, 1) == 0);
    memset(&c, 0xA5, sizeof c);
    memcpy(&sentinel, &c, sizeof c);
    CHECK_ERR_AT(line, kvswap_config_from_env(&c), KVSWAP_STATUS_INVALID_ARGUMENT, var);
    CHECK_MSG_AT(line, value);
    CHECK_MSG_AT(line, "kvswap_config_from_env");
    if (memcmp(&c, &sentinel, sizeof c) != 0) FAIL_AT(line, "config_from_env wrote its out-parameter on failure");
    clear_env();
}
#define env_refused(var, value) env_refused_at(__LINE__, var, value)

static void test_config_from_env(void) {
    KvswapConfig c;
    clear_env();
    memset(&c, 0xA5, sizeof c);
    CHECK_OK(kvswap_config_from_env(&c));
    check_default_config(&c);

    /* Every KVSWAP_ name. */
    CHECK(setenv("KVSWAP_ENABLE", "1", 1) == 0);
    CHECK(setenv("KVSWAP_GPU_CHUNKS", "1024", 1) == 0);
    CHECK(setenv("KVSWAP_PINNED_MIB", "4096", 1) == 0);
    CHECK(setenv("KVSWAP_SYNC", "0", 1) == 0);
    CHECK(setenv("KVSWAP_VALIDATE", "1", 1) == 0);
    CHECK(setenv("KVSWAP_TEST_ALLOW_TOPK_REDUCTION", "1", 1) == 0);
    CHECK(setenv("KVSWAP_INDEX_TOPK", "256", 1) == 0);
    CHECK(setenv("KVSWAP_WINDOW", "64", 1) == 0);
    CHECK(setenv("KVSWAP_FM_CKPT", "/tmp/fm.safetensors", 1) == 0);
    CHECK(setenv("KVSWAP_FM_ENSEMBLE", "mean", 1) == 0);
    CHECK(setenv("KVSWAP_MEM_PROFILE", "1", 1) == 0);
    CHECK(setenv("KVSWAP_BACKEND", "cpu", 1) == 0);
    CHECK(setenv("KVSWAP_DEVICE", "3", 1) == 0);
    memset(&c, 0xA5, sizeof c);
    CHECK_OK(kvswap_config_from_env(&c));
    CHECK_EQ(c.enable, 1);
    CHECK_EQ(c.gpu_chunks, 1024);
    CHECK_EQ(c.pinned_mib, 4096);
    CHECK_EQ(c.sync, 0);
    CHECK_EQ(c.validate, 1);
    CHECK_EQ(c.test_allow_topk_reduction, 1);
    CHECK_EQ(c.index_topk, 256);
    CHECK_EQ(c.window, 64);
    CHECK(strcmp(c.fm_ckpt, "/tmp/fm.safetensors") == 0);
    CHECK_EQ(c.fm_ensemble, KVSWAP_ENSEMBLE_MEAN);
    CHECK_EQ(c.mem_profile, 1);
    CHECK_EQ(c.backend, KVSWAP_BACKEND_CPU);
    CHECK_EQ(c.device, 3);
    clear_env();

    /* The original engine's aliases. */
    CHECK(setenv("POCKETLLM_GGUF_KV_SWAP", "1", 1) == 0);
    CHECK(setenv("POCKETLLM_GGUF_KV_SWAP_PINNED_MIB", "256", 1) == 0);
    CHECK(setenv("POCKETLLM_GGUF_KV_SWAP_SYNC", "0", 1) == 0);
    CHECK(setenv("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "mean", 1) == 0);
    CHECK(setenv("POCKETLLM_GGUF_FLASHMEMORY_CKPT", "a.safetensors", 1) == 0);
    /* ... and the KVSWAP_ name wins over its alias. */
    CHECK(setenv("POCKETLLM_GGUF_KV_SWAP_GPU_CHUNKS", "2048", 1) == 0);
    CHECK(setenv("KVSWAP_GPU_CHUNKS", "768", 1) == 0);
    memset(&c, 0xA5, sizeof c);
    CHECK_OK(kvswap_config_from_env(&c));
    CHECK_EQ(c.enable, 1);
    CHECK_EQ(c.pinned_mib, 256);
    CHECK_EQ(c.sync, 0);
    CHECK_EQ(c.fm_ensemble, KVSWAP_ENSEMBLE_MEAN);
    CHECK(strcmp(c.fm_ckpt, "a.safetensors") == 0);
    CHECK_EQ(c.gpu_chunks, 768);
    CHECK_EQ(c.index_topk, 512); /* untouched settings keep their defaults */
    CHECK_EQ(c.validate, 0);
    /* The alias alone. */
    CHECK(unsetenv("KVSWAP_GPU_CHUNKS") == 0);
    CHECK_OK(kvswap_config_from_env(&c));
    CHECK_EQ(c.gpu_chunks, 2048);
    clear_env();

    /* Bad values: INVALID_ARGUMENT naming the variable and the value; out untouched. */
    env_refused("KVSWAP_FM_ENSEMBLE", "foo");
    env_refused("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "bar");
    env_refused("KVSWAP_GPU_CHUNKS", "abc");
    env_refused("KVSWAP_GPU_CHUNKS", "-4");
    env_refused("KVSWAP_PINNED_MIB", "1.5");
    env_refused("KVSWAP_ENABLE", "maybe");
    env_refused("POCKETLLM_GGUF_KV_SWAP_SYNC", "2");
    env_refused("KVSWAP_BACKEND", "tpu");
    env_refused("KVSWAP_INDEX_TOPK", "99999999999");
    /* A bad KVSWAP_ value is refused even when a good alias is set. */
    CHECK(setenv("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "max", 1) == 0);
    CHECK(setenv("KVSWAP_FM_ENSEMBLE", "foo", 1) == 0);
    memset(&c, 0xA5, sizeof c);
    CHECK_ERR(kvswap_config_from_env(&c), KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_FM_ENSEMBLE");
    CHECK_MSG("foo");
    clear_env();

    CHECK_ERR(kvswap_config_from_env(NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    group_done("config_from_env: KVSWAP_ names, POCKETLLM_GGUF_ aliases, precedence, bad values");
}

/* ---- logging ---- */

static char log_text[1 << 16];
static size_t log_len;
static unsigned log_calls;
static unsigned log_bad_level;
static int log_token;

static void log_cb(uint32_t level, const char *line, void *user_data) {
    if (user_data != &log_token || level < 1 || level > 5 || line == NULL) log_bad_level++;
    log_calls++;
    size_t n = line ? strlen(line) : 0;
    if (log_len + n + 2 < sizeof log_text) {
        memcpy(log_text + log_len, line, n);
        log_len += n;
        log_text[log_len++] = '\n';
        log_text[log_len] = 0;
    }
}

static void log_reset(void) {
    log_len = 0;
    log_text[0] = 0;
    log_calls = 0;
}

#define CHECK_LOG(substr)                                                                    \
    do {                                                                                     \
        if (!strstr(log_text, (substr)))                                                     \
            FAIL("no log line contains \"%s\"; lines received:\n%s", (substr), log_text);    \
    } while (0)

static void test_logging(void) {
    CHECK_OK(kvswap_set_log_level(3));
    CHECK_ERR(kvswap_set_log_level(6), KVSWAP_STATUS_INVALID_ARGUMENT, "6");
    CHECK_MSG("kvswap_set_log_level");
    CHECK_OK(kvswap_set_log_callback(log_cb, &log_token));

    /* Swap on for layer 0 (cap 16 > 4 slots), off for layer 1 (cap 4 <= 4). */
    KvswapConfig cfg = test_config(1, 4, 4);
    KvswapLayerSpec specs[2] = {layer_spec(16, 64), layer_spec(4, 64)};
    log_reset();
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    CHECK_LOG("kvswap: swap on");
    CHECK_LOG("gpu_chunks=4");
    CHECK_LOG("index_topk=4");
    CHECK_LOG("layer=1 swap off reason=compressed_cap_le_gpu_chunks");
    CHECK(strstr(log_text, "layer=0 swap off") == NULL);
    log_reset();
    kvswap_destroy(ctx);
    CHECK_LOG("kvswap_stats layer=0 gpu_chunks=4 compressed_cap=16 hits=0 misses=0");
    CHECK_LOG("kvswap_stats layer=1");

    /* No layer large enough: swap off for all, with the reason. */
    KvswapLayerSpec small[2] = {layer_spec(4, 64), layer_spec(2, 64)};
    log_reset();
    ctx = create_ok(&cfg, small, 2);
    CHECK_LOG("reason=no_layer_with_compressed_cap_gt_gpu_chunks");
    CHECK(strstr(log_text, "kvswap: swap on") == NULL);
    kvswap_destroy(ctx);

    /* Disabled by config. */
    cfg.enable = 0;
    log_reset();
    ctx = create_ok(&cfg, specs, 2);
    CHECK_LOG("kvswap: swap off reason=disabled_by_config (KVSWAP_ENABLE=0) layers=2 all_chunks_resident=1");
    CHECK(strstr(log_text, "kvswap: swap on") == NULL);
    kvswap_destroy(ctx);
    cfg.enable = 1;

    /* Level 0 silences the log; level 3 brings it back. */
    CHECK_OK(kvswap_set_log_level(0));
    log_reset();
    ctx = create_ok(&cfg, specs, 2);
    kvswap_destroy(ctx);
    CHECK_EQ(log_calls, 0);
    CHECK_OK(kvswap_set_log_level(3));
    log_reset();
    ctx = create_ok(&cfg, specs, 2);
    kvswap_destroy(ctx);
    CHECK(log_calls > 0);

    CHECK_EQ(log_bad_level, 0);

    /* Back to stderr: the callback is no longer called. Silence stderr meanwhile. */
    CHECK_OK(kvswap_set_log_callback(NULL, NULL));
    CHECK_OK(kvswap_set_log_level(0));
    log_reset();
    ctx = create_ok(&cfg, specs, 2);
    kvswap_destroy(ctx);
    CHECK_OK(kvswap_set_log_level(3));
    CHECK_EQ(log_calls, 0);
    /* Keep the rest of the run quiet, through the callback (which checks its arguments). */
    CHECK_OK(kvswap_set_log_callback(log_cb, &log_token));
    group_done("set_log_level, set_log_callback: swap on / compressed_cap_le_gpu_chunks / no_layer_with_compressed_cap_gt_gpu_chunks / stats lines");
}

/* ---- create, destroy, context_info and the creation guards ---- */

static void create_refused_at(int line, const KvswapConfig *cfg, const KvswapLayerSpec *specs, size_t n,
                              enum KvswapStatus want, const char *substr) {
    KvswapContext *out;
    memset(&out, 0xA5, sizeof out);
    unsigned char before[sizeof out];
    memcpy(before, &out, sizeof out);
    CHECK_ERR_AT(line, kvswap_create(cfg, specs, n, &out), want, substr);
    CHECK_MSG_AT(line, "kvswap_create");
    if (memcmp(before, &out, sizeof out) != 0) FAIL_AT(line, "kvswap_create wrote *out on failure");
}
#define create_refused(cfg, specs, n, want, substr) create_refused_at(__LINE__, cfg, specs, n, want, substr)

static void test_create_destroy_info(void) {
    kvswap_destroy(NULL); /* no-op */

    KvswapConfig cfg = test_config(1, 4, 4);
    void *engine_staging = dm_alloc(4 * 96); /* engine-owned: device memory on CUDA */
    KvswapLayerSpec specs[3] = {layer_spec(16, 64), layer_spec(3, 32), layer_spec(100, 80)};
    specs[2].staging = engine_staging;
    specs[2].staging_stride = 96;
    KvswapContext *ctx = create_ok(&cfg, specs, 3);

    KvswapContextInfo info;
    memset(&info, 0xA5, sizeof info);
    CHECK_OK(kvswap_context_info(ctx, &info));
    CHECK_EQ(info.backend, dm_backend());
    CHECK_EQ(info.device, dm_is_cuda() ? 0 : -1);
    CHECK_EQ(info.n_layers, 3);
    CHECK_EQ(info.swap_layers, 2);
    CHECK_EQ(info.host_tier_bytes, 16 * 64 + 3 * 32 + 100 * 80);
    /* Library-owned staging only: 4 slots x 64 + 3 rows (swap off) x 32. */
    CHECK_EQ(info.staging_bytes, 4 * 64 + 3 * 32);

    KvswapContextInfo sent;
    memset(&sent, 0x5A, sizeof sent);
    memcpy(&info, &sent, sizeof info);
    CHECK_ERR(kvswap_context_info(NULL, &info), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_context_info");
    CHECK(memcmp(&info, &sent, sizeof info) == 0);
    CHECK_ERR(kvswap_context_info(ctx, NULL), KVSWAP_STATUS_NULL_POINTER, "out");

    /* Per-layer stats right after creation. */
    KvswapLayerStats s = stats_of(ctx, 0);
    CHECK_EQ(s.hits + s.misses + s.evictions + s.stores + s.refreshes + s.h2d_bytes + s.d2h_bytes + s.swap_in_calls, 0);
    CHECK_EQ(s.compressed_cap, 16);
    CHECK_EQ(s.chunk_bytes, 64);
    CHECK_EQ(s.slots, 4);
    CHECK_EQ(s.resident, 0);
    CHECK_EQ(s.swap_enabled, 1);
    CHECK_EQ(s.reserved, 0);
    s = stats_of(ctx, 1);
    CHECK_EQ(s.slots, 3);
    CHECK_EQ(s.swap_enabled, 0);
    s = stats_of(ctx, 2);
    CHECK_EQ(s.slots, 4);
    CHECK_EQ(s.swap_enabled, 1);

    void *ptr;
    size_t stride;
    uint32_t rows;
    CHECK_OK(kvswap_layer_staging(ctx, 2, &ptr, &stride, &rows));
    CHECK(ptr == engine_staging);
    CHECK_EQ(stride, 96);
    CHECK_EQ(rows, 4);
    CHECK_OK(kvswap_layer_staging(ctx, 1, &ptr, &stride, &rows));
    CHECK_EQ(stride, 32);
    CHECK_EQ(rows, 3);
    CHECK_OK(kvswap_layer_staging(ctx, 0, &ptr, &stride, &rows));
    CHECK_EQ(stride, 64);
    CHECK_EQ(rows, 4);
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    kvswap_destroy(ctx);

    /* The auto backend: CUDA on the CUDA run; the CPU on a machine without
     * a CUDA driver; either on a CPU run where a driver is installed. */
    cfg.backend = KVSWAP_BACKEND_AUTO;
    ctx = create_ok(&cfg, specs, 1);
    CHECK_OK(kvswap_context_info(ctx, &info));
    if (dm_is_cuda())
        CHECK_EQ(info.backend, KVSWAP_BACKEND_CUDA);
    else if (!dm_driver_present())
        CHECK_EQ(info.backend, KVSWAP_BACKEND_CPU);
    else
        CHECK(info.backend == KVSWAP_BACKEND_CPU || info.backend == KVSWAP_BACKEND_CUDA);
    kvswap_destroy(ctx);
    group_done("create, destroy (NULL too), context_info, layer_staging, auto backend");

    /* ---- guards ---- */
    KvswapLayerSpec one = layer_spec(16, 64);
    cfg = test_config(1, 4, 4);
    KvswapContext *out = NULL;
    CHECK_ERR(kvswap_create(NULL, &one, 1, &out), KVSWAP_STATUS_NULL_POINTER, "config");
    CHECK(out == NULL);
    CHECK_ERR(kvswap_create(&cfg, NULL, 1, &out), KVSWAP_STATUS_NULL_POINTER, "layers");
    CHECK(out == NULL);
    CHECK_ERR(kvswap_create(&cfg, &one, 1, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    create_refused(&cfg, &one, 0, KVSWAP_STATUS_INVALID_ARGUMENT, "n_layers");
    /* Refused before the (one-element) array is read past its end. */
    create_refused(&cfg, &one, (size_t)KVSWAP_MAX_LAYERS + 1, KVSWAP_STATUS_OUT_OF_RANGE, "KVSWAP_MAX_LAYERS");

    KvswapLayerSpec bad = layer_spec(0, 64);
    create_refused(&cfg, &bad, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "compressed_cap");
    bad = layer_spec(16, 0);
    create_refused(&cfg, &bad, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "chunk_bytes");
    /* A bad layer after a good one: the whole create is refused, naming it. */
    KvswapLayerSpec two[2] = {layer_spec(16, 64), layer_spec(16, 0)};
    create_refused(&cfg, two, 2, KVSWAP_STATUS_INVALID_ARGUMENT, "layer 1");
    bad = layer_spec(16, 64);
    bad.staging_stride = 128; /* without a staging pointer */
    create_refused(&cfg, &bad, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "staging_stride");
    bad.staging = engine_staging;
    bad.staging_stride = 32; /* smaller than chunk_bytes */
    create_refused(&cfg, &bad, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "staging_stride");
    bad = layer_spec((uint64_t)INT32_MAX, 64);
    create_refused(&cfg, &bad, 1, KVSWAP_STATUS_OUT_OF_RANGE, "compressed_cap");

    KvswapConfig c2 = cfg;
    c2.sync = 7;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "sync");
    c2 = cfg;
    c2.enable = 2;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "enable");
    c2 = cfg;
    c2.validate = 0xFFFFFFFFu;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "validate");
    c2 = cfg;
    c2.backend = 9;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "backend");
    c2 = cfg;
    c2.fm_ensemble = 5;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "fm_ensemble");
    c2 = cfg;
    c2.gpu_chunks = 0;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "gpu_chunks");
    c2 = cfg;
    c2.index_topk = 0;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "index_topk");
    c2 = cfg;
    c2.device = -2;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "device=-2");
    /* -1 is the CPU: accepted with the CPU backend only. */
    c2 = cfg;
    c2.device = -1;
    c2.backend = KVSWAP_BACKEND_AUTO;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "device=-1 (the CPU) needs backend=KVSWAP_BACKEND_CPU");
    c2.backend = KVSWAP_BACKEND_CPU;
    {
        KvswapContext *cpu_ctx = NULL;
        CHECK_OK(kvswap_create(&c2, &one, 1, &cpu_ctx));
        KvswapContextInfo ci;
        CHECK_OK(kvswap_context_info(cpu_ctx, &ci));
        CHECK(ci.backend == KVSWAP_BACKEND_CPU && ci.device == -1);
        kvswap_destroy(cpu_ctx);
    }
    c2 = cfg;
    memset(c2.fm_ckpt, 'a', sizeof c2.fm_ckpt); /* no NUL */
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "fm_ckpt");

    /* gpu_chunks < index_topk with swap on: refused unless the test flag is set. */
    c2 = test_config(1, 4, 8);
    create_refused(&c2, &one, 1, KVSWAP_STATUS_TOPK_GUARD, "index_topk");
    CHECK_MSG("gpu_chunks=4");
    CHECK_MSG("KVSWAP_TEST_ALLOW_TOPK_REDUCTION");
    c2.test_allow_topk_reduction = 1;
    ctx = create_ok(&c2, &one, 1);
    kvswap_destroy(ctx);
    c2 = test_config(0, 4, 8); /* swap off: no guard */
    ctx = create_ok(&c2, &one, 1);
    kvswap_destroy(ctx);

    /* Pinned host tier over the cap: 1024 x 2048 B = 2 MiB > 1 MiB. */
    c2 = test_config(1, 4, 4);
    c2.pinned_mib = 1;
    KvswapLayerSpec big = layer_spec(1024, 2048);
    create_refused(&c2, &big, 1, KVSWAP_STATUS_PINNED_CAP, "required_mib=2");
    CHECK_MSG("cap_mib=1");
    /* Summed over layers: 2 x 1 MiB. */
    KvswapLayerSpec halves[2] = {layer_spec(512, 2048), layer_spec(512, 2048)};
    create_refused(&c2, halves, 2, KVSWAP_STATUS_PINNED_CAP, "required_mib=2");
    CHECK_MSG("cap_mib=1");
    /* Exactly at the cap is fine. */
    ctx = create_ok(&c2, halves, 1);
    kvswap_destroy(ctx);

    /* An explicit CUDA backend: refused with NO_DEVICE on a machine without
     * libcuda; created on the CUDA run, where a missing device is NO_DEVICE. */
    c2 = test_config(1, 4, 4);
    c2.backend = KVSWAP_BACKEND_CUDA;
    if (dm_is_cuda()) {
        ctx = create_ok(&c2, &one, 1);
        memset(&info, 0xA5, sizeof info);
        CHECK_OK(kvswap_context_info(ctx, &info));
        CHECK_EQ(info.backend, KVSWAP_BACKEND_CUDA);
        CHECK_EQ(info.device, 0);
        CHECK_EQ(info.n_layers, 1);
        CHECK_EQ(info.swap_layers, 1);
        kvswap_destroy(ctx);
        c2.device = 99;
        create_refused(&c2, &one, 1, KVSWAP_STATUS_NO_DEVICE, "99");
    } else if (!dm_driver_present()) {
        create_refused(&c2, &one, 1, KVSWAP_STATUS_NO_DEVICE, "");
        CHECK(strlen(last_err()) > strlen("kvswap_create: "));
    } else {
        printf("note: libcuda.so.1 is present: NO_DEVICE of an explicit CUDA backend not checked on the CPU run\n");
    }
    dm_free(engine_staging);
    group_done(dm_is_cuda() ? "create guards: NULLs, zero sizes, bad flags, TOPK_GUARD, PINNED_CAP, explicit CUDA, NO_DEVICE (device 99); *out untouched"
                            : "create guards: NULLs, zero sizes, bad flags, TOPK_GUARD, PINNED_CAP, NO_DEVICE; *out untouched");
}

/* ---- store, store_batch, staging bytes, refresh ---- */

static void test_store_and_staging(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    enum { CB = 64, EXTRA = 24, ESTRIDE = 96 };
    void *engine = dm_alloc(4 * ESTRIDE); /* engine-owned staging: device memory on CUDA */
    dm_memset(engine, 0xEE, 4 * ESTRIDE);
    KvswapLayerSpec specs[2] = {layer_spec(16, CB), layer_spec(16, CB)};
    specs[1].staging = engine;
    specs[1].staging_stride = ESTRIDE;
    KvswapContext *ctx = create_ok(&cfg, specs, 2);

    for (uint32_t l = 0; l < 2; l++) {
        Layer L;
        layer_init(&L, ctx, l, 16, 4, CB);
        /* 0..7 one by one. */
        for (uint32_t id = 0; id < 8; id++) store_one(&L, id);
        /* 15..8 in one batch with a source stride larger than chunk_bytes. */
        uint8_t src[8 * (CB + EXTRA)];
        int32_t ids[8];
        memset(src, 0x77, sizeof src);
        for (uint32_t i = 0; i < 8; i++) {
            ids[i] = (int32_t)(15 - i);
            fill_chunk(src + i * (CB + EXTRA), CB, l, 15 - i, 1);
        }
        CHECK_OK(store_batch_dev(ctx, l, ids, 8, src, sizeof src, CB + EXTRA));
        for (uint32_t i = 8; i < 16; i++) L.version[i] = 1;
        L.stores += 8;
        /* A batch with src_stride 0 (= chunk_bytes): new versions of 2 and 3. */
        uint8_t packed[2 * CB];
        int32_t ids2[2] = {2, 3};
        fill_chunk(packed, CB, l, 2, 2);
        fill_chunk(packed + CB, CB, l, 3, 2);
        CHECK_OK(store_batch_dev(ctx, l, ids2, 2, packed, sizeof packed, 0));
        L.version[2] = L.version[3] = 2;
        L.stores += 2;
        KvswapLayerStats s = stats_of(ctx, l);
        CHECK_EQ(s.stores, 18);
        CHECK_EQ(s.d2h_bytes, 18 * CB);
        CHECK_EQ(s.refreshes, 0);
        CHECK_EQ(s.resident, 0);

        const int32_t sel[4] = {15, 2, 8, 3};
        const int32_t exp[4] = {5, 6, 7, 8};
        swap_ok(&L, 5, 4, sel, exp);

        /* A store of a resident chunk refreshes its slot at once. */
        store_one(&L, 8);
        check_staged(&L);
        s = stats_of(ctx, l);
        CHECK_EQ(s.refreshes, 1);
        /* A store of a non-resident chunk does not. */
        store_one(&L, 9);
        s = stats_of(ctx, l);
        CHECK_EQ(s.refreshes, 1);
        /* A batch refreshing two resident chunks. */
        int32_t ids3[2] = {15, 3};
        uint8_t two[2 * (CB + 8)];
        fill_chunk(two, CB, l, 15, 2);
        fill_chunk(two + CB + 8, CB, l, 3, 3);
        CHECK_OK(store_batch_dev(ctx, l, ids3, 2, two, sizeof two, CB + 8));
        L.version[15] = 2;
        L.version[3] = 3;
        L.stores += 2;
        check_staged(&L);
        s = stats_of(ctx, l);
        CHECK_EQ(s.refreshes, 3);
        /* The new version of 9 comes in on its miss. */
        const int32_t sel2[2] = {9, 8};
        swap_ok(&L, 0, 2, sel2, NULL);
        check_stats(&L);
        CHECK_OK(kvswap_sync(ctx, cur_stream()));
    }
    /* Engine staging: the bytes between rows (stride 96 > 64) were never written. */
    uint8_t *eng = staging_copy(engine, ESTRIDE, 4, ESTRIDE);
    for (uint32_t s = 0; s < 4; s++)
        for (uint32_t b = CB; b < ESTRIDE; b++) CHECK(eng[s * ESTRIDE + b] == 0xEE);
    free(eng);
    kvswap_destroy(ctx);
    dm_free(engine);
    group_done("store, store_batch (src_stride > chunk_bytes and 0), refresh of resident slots, layer_staging bytes, sync");
}

/* ---- the scripted LRU sequence ---- */

struct Step {
    uint32_t window, count;
    int32_t sel[4];
    int32_t exp[4];
    uint64_t hits, misses, evictions; /* cumulative */
    uint32_t resident;
};

static void test_lru_script(void) {
    /* 4 slots, cap 16, index_topk 4; W = window_len. Derivation in comments:
     * slot recency is (last call that selected it, slot index); never used = 0. */
    static const struct Step script[] = {
        /* all miss; never-used slots 0,1,2 in order; -1 stays -1 */
        {3, 4, {5, 3, -1, 9}, {3 + 0, 3 + 1, -1, 3 + 2}, 0, 3, 0, 3},
        /* 3 hits s1; victims s3 (never used), then s0 (evicts 5); dup 3 -> s1 */
        {3, 4, {7, 3, 8, 3}, {3 + 3, 3 + 1, 3 + 0, 3 + 1}, 1, 5, 1, 4},
        /* one distinct hit counted once */
        {3, 3, {9, 9, 9, 0}, {3 + 2, 3 + 2, 3 + 2, 0}, 2, 5, 1, 4},
        /* LRU order s0,s1,s3 (t2, by index), s2 (t3): 10 -> s0 (evicts 8), 11 -> s1 (evicts 3) */
        {3, 4, {10, 11, -1, -1}, {3 + 0, 3 + 1, -1, -1}, 2, 7, 3, 4},
        /* hits 7 (s3), 10 (s0); misses take s2 (t3, evicts 9) then s1 (t4, evicts 11) */
        {3, 4, {3, 7, 12, 10}, {3 + 2, 3 + 3, 3 + 1, 3 + 0}, 4, 9, 5, 4},
        /* count 0: nothing changes */
        {3, 0, {0, 0, 0, 0}, {0, 0, 0, 0}, 4, 9, 5, 4},
        /* all four used at the same call: ties to the lower index */
        {3, 4, {13, 14, 15, 0}, {3 + 0, 3 + 1, 3 + 2, 3 + 3}, 4, 13, 9, 4},
        /* window 0: 0 hits s3; 1 -> s0 (evicts 13) */
        {0, 2, {0, 1, 0, 0}, {3, 0, 0, 0}, 5, 14, 10, 4},
        /* window 5: LRU s1,s2 (t7) then s0,s3 (t8): 2 -> s1 (evicts 14) */
        {5, 4, {-1, 2, -1, 2}, {-1, 5 + 1, -1, 5 + 1}, 5, 15, 11, 4},
        /* all hits */
        {3, 4, {15, 1, 0, 2}, {3 + 2, 3 + 0, 3 + 3, 3 + 1}, 9, 15, 11, 4},
        /* dup misses in the order they first appear: 4 -> s0 (evicts 1), 5 -> s1 (evicts 2) */
        {3, 4, {4, 4, 5, -1}, {3 + 0, 3 + 0, 3 + 1, -1}, 9, 17, 13, 4},
        /* hits 0 (s3), 15 (s2); 6 -> s0 (evicts 4), 7 -> s1 (evicts 5) */
        {3, 4, {0, 6, 15, 7}, {3 + 3, 3 + 0, 3 + 2, 3 + 1}, 11, 19, 15, 4},
    };
    KvswapConfig cfg = test_config(1, 4, 4);
    KvswapLayerSpec specs[2] = {layer_spec(16, 48), layer_spec(32, 16)};
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 48);
    for (uint32_t id = 0; id < 16; id++) store_one(&L, id);
    /* Layer 1 is stored too and must not be affected by layer 0's calls. */
    Layer L1;
    layer_init(&L1, ctx, 1, 32, 4, 16);
    for (uint32_t id = 0; id < 32; id++) store_one(&L1, id);

    for (size_t k = 0; k < sizeof script / sizeof script[0]; k++) {
        const struct Step *st = &script[k];
        swap_ok(&L, st->window, st->count, st->sel, st->exp);
        KvswapLayerStats s = stats_of(ctx, 0);
        if (s.hits != st->hits || s.misses != st->misses || s.evictions != st->evictions || s.resident != st->resident)
            FAIL("script step %zu: hits/misses/evictions/resident %llu/%llu/%llu/%u, expected %llu/%llu/%llu/%u", k + 1,
                 (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.evictions, s.resident,
                 (unsigned long long)st->hits, (unsigned long long)st->misses, (unsigned long long)st->evictions,
                 st->resident);
        CHECK_EQ(s.swap_in_calls, k + 1);
        CHECK_EQ(s.h2d_bytes, st->misses * 48);
        check_stats(&L1);
    }
    /* Refresh while resident after the script: 15 sits in slot 2. */
    store_one(&L, 15);
    check_staged(&L);
    const int32_t again[1] = {15};
    const int32_t again_exp[1] = {1 + 2};
    swap_ok(&L, 1, 1, again, again_exp);
    group_done("exact LRU order over a scripted sequence (12 calls, slots and counters derived by hand)");

    /* Many random calls against the reference model, on both layers. */
    for (int i = 0; i < 400; i++) {
        Layer *X = (i % 3 == 0) ? &L1 : &L;
        if (rnd(8) == 0) store_one(X, rnd(X->cap));
        random_swap(X);
    }
    check_stats(&L);
    check_stats(&L1);
    kvswap_destroy(ctx);
    group_done("400 random calls (padding, duplicates, windows 0..5, re-stores) match the reference model");
}

/* kvswap_layer_forget against the model: random ranges and "every chunk"
 * between stores and swap-ins on both layers; forgotten chunks are refused
 * until stored again; bad arguments change nothing. */
/* `n` as passed to the call: KVSWAP_FORGET_TO_END means every chunk from `first` on. */
static void forget_ok_at(int line, Layer *L, uint32_t first, uint32_t n_arg) {
    CHECK_OK_AT(line, kvswap_layer_forget(L->ctx, L->layer, (int32_t)first, n_arg, cur_stream()));
    uint32_t n = n_arg == KVSWAP_FORGET_TO_END ? L->cap - first : n_arg;
    model_forget(&L->model, first, n);
    for (uint32_t id = first; id < first + n; id++) L->version[id] = 0;
    check_stats_at(line, L);
    check_staged_at(line, L);
}
#define forget_ok(L, first, n) forget_ok_at(__LINE__, L, first, n)

static void test_forget(void) {
    KvswapConfig cfg = test_config(1, 8, 8);
    KvswapLayerSpec specs[2] = {layer_spec(100, 40), layer_spec(70, 24)};
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    Layer L, L1;
    layer_init(&L, ctx, 0, 100, 8, 40);
    layer_init(&L1, ctx, 1, 70, 8, 24);
    for (uint32_t id = 0; id < 100; id++) store_one(&L, id);
    for (uint32_t id = 0; id < 70; id++) store_one(&L1, id);
    probe_lru(&L, 0);
    probe_lru(&L, 40);

    /* Refused: nothing changes (counters, residency: probed below). */
    Snapshot before = snapshot_at(__LINE__, ctx, 2);
    CHECK_ERR(kvswap_layer_forget(NULL, 0, 0, 1, cur_stream()), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_ERR(kvswap_layer_forget(ctx, 2, 0, 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_layer_forget(ctx, 0, -1, 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "compressed_cap");
    CHECK_ERR(kvswap_layer_forget(ctx, 0, 90, 11, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "0..100");
    CHECK_ERR(kvswap_layer_forget(ctx, 0, 0, UINT32_MAX - 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "compressed_cap");
    CHECK_ERR(kvswap_layer_forget(ctx, 0, INT32_MAX, 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "compressed_cap");
    if (dm_is_cuda())
        CHECK_ERR(kvswap_layer_forget(ctx, 0, 0, 1, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
    same_snapshot_at(__LINE__, ctx, &before);
    CHECK_OK(kvswap_layer_forget(ctx, 0, 100, 0, cur_stream())); /* n 0 at the end: nothing */
    CHECK_OK(kvswap_layer_forget(ctx, 0, 100, KVSWAP_FORGET_TO_END, cur_stream())); /* to the end, from it */
    CHECK_ERR(kvswap_layer_forget(ctx, 0, 101, KVSWAP_FORGET_TO_END, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "0..100");
    same_snapshot_at(__LINE__, ctx, &before);
    group_done("kvswap_layer_forget refuses a NULL context, a bad layer or range (and on CUDA the NULL stream), changing nothing");

    /* The chunks of slots emptied by a forget are refused; the emptied slots
     * are the next victims, in slot order; counters go on. */
    int32_t resident_id = L.model.slot_chunk[3];
    forget_ok(&L, (uint32_t)resident_id, 1);
    CHECK(L.model.chunk_slot[resident_id] < 0);
    int32_t buf[4] = {resident_id, -1, -1, -1};
    enum KvswapStatus st = swap_dev(ctx, 0, buf, 4, 0, 1);
    if (cfg.sync) {
        CHECK_EQ(st, KVSWAP_STATUS_NOT_STORED);
        CHECK_EQ(buf[0], resident_id);
    } else {
        CHECK_OK(st);
        CHECK_EQ(buf[0], -1);
        CHECK_ERR(kvswap_sync(ctx, cur_stream()), KVSWAP_STATUS_NOT_STORED, "never stored");
        L.swap_calls++;
    }
    check_stats(&L);
    store_one(&L, (uint32_t)resident_id);
    const int32_t sel[1] = {resident_id};
    const int32_t exp[1] = {2 + 3};
    swap_ok(&L, 2, 1, sel, exp);
    group_done("a forgotten chunk is NOT_STORED until stored again, and its emptied slot is the next victim");

    /* Random forgets between random stores and swap-ins, on both layers;
     * the second layer is left alone now and then, and must not change. */
    for (int i = 0; i < 600; i++) {
        Layer *X = (i % 3 == 0) ? &L1 : &L;
        uint32_t r = rnd(20);
        if (r == 0) {
            /* every chunk: by count, or to the end */
            forget_ok(X, 0, rnd(2) ? X->cap : KVSWAP_FORGET_TO_END);
            for (uint32_t id = 0; id < X->cap; id += 1 + rnd(3)) store_one(X, id);
        } else if (r <= 2) {
            uint32_t first = rnd(X->cap);
            forget_ok(X, first, rnd(X->cap - first + 1));
        } else if (r == 3) {
            /* a tail, to the end */
            forget_ok(X, rnd(X->cap + 1), KVSWAP_FORGET_TO_END);
        } else if (r <= 6) {
            store_one(X, rnd(X->cap));
        }
        /* keep enough chunks stored for a probe and a random selection */
        uint32_t stored = 0;
        for (uint32_t id = 0; id < X->cap; id++) stored += X->version[id] > 0;
        while (stored < X->slots * 3) {
            uint32_t id = rnd(X->cap);
            if (X->version[id] == 0) stored++;
            store_one(X, id);
        }
        if (rnd(25) == 0) probe_lru(X, rnd(X->cap));
        else random_swap(X);
    }
    forget_ok(&L, 0, L.cap);
    for (uint32_t id = 0; id < L.cap; id++) store_one(&L, id);
    probe_lru(&L, 17); /* a layer forgotten whole fills slots 0, 1, ... in order */
    check_stats(&L1);
    kvswap_destroy(ctx);
    group_done("600 random stores, swap-ins and forgets (ranges, tails to the end, every chunk) on two layers match the reference model");
}

/* ---- guards on a live context; the state is unchanged after each ---- */

static void test_guards(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    KvswapLayerSpec specs[2] = {layer_spec(16, 32), layer_spec(16, 32)};
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    for (uint32_t id = 0; id < 12; id++) store_one(&L, id); /* 12..15 never stored */
    Layer L1;
    layer_init(&L1, ctx, 1, 16, 4, 32);
    for (uint32_t id = 0; id < 16; id++) store_one(&L1, id);
    const int32_t warm[4] = {1, 2, 3, 4};
    swap_ok(&L, 2, 4, warm, NULL);
    const int32_t warm2[3] = {5, 2, 6};
    swap_ok(&L, 2, 3, warm2, NULL);

    /* Each refused selection holds the least recently used resident chunk and
     * a stored non-resident one before the bad entry, so that a partial change
     * (a hit promoted, a victim taken) shows in the probe that follows. */
    const int32_t R = PICK_LRU_RESIDENT, F = PICK_FREE;
    int32_t dummy = 0;

    int32_t sel_ns[3] = {R, F, 13};
    swap_refused(&L, ctx, 0, &dummy, sel_ns, 2, 3, KVSWAP_STATUS_NOT_STORED, "chunk 13", 2);
    CHECK_MSG("never stored");
    int32_t sel_ns2[3] = {12, R, F};
    swap_refused(&L, ctx, 0, &dummy, sel_ns2, 0, 3, KVSWAP_STATUS_NOT_STORED, "chunk 12", 2);
    int32_t sel_ns3[4] = {F, -1, R, 15};
    swap_refused(&L, ctx, 0, &dummy, sel_ns3, 5, 4, KVSWAP_STATUS_NOT_STORED, "chunk 15", 2);

    int32_t sel_ok[2] = {R, F};
    swap_refused(&L, NULL, 0, &dummy, sel_ok, 2, 2, KVSWAP_STATUS_NULL_POINTER, "ctx", 2);
    swap_refused(&L, ctx, 0, NULL, sel_ok, 2, 2, KVSWAP_STATUS_NULL_POINTER, "indices", 2);
    swap_refused(&L, ctx, 2, &dummy, sel_ok, 2, 2, KVSWAP_STATUS_OUT_OF_RANGE, "layer 2", 2);
    swap_refused(&L, ctx, UINT32_MAX, &dummy, sel_ok, 2, 2, KVSWAP_STATUS_OUT_OF_RANGE, "layer", 2);

    int32_t sel_neg[3] = {R, F, -2};
    swap_refused(&L, ctx, 0, &dummy, sel_neg, 2, 3, KVSWAP_STATUS_OUT_OF_RANGE, "-2", 2);
    int32_t sel_min[3] = {R, INT32_MIN, F};
    swap_refused(&L, ctx, 0, &dummy, sel_min, 1, 3, KVSWAP_STATUS_OUT_OF_RANGE, "-2147483648", 2);
    int32_t sel_cap[3] = {R, F, 16};
    swap_refused(&L, ctx, 0, &dummy, sel_cap, 2, 3, KVSWAP_STATUS_OUT_OF_RANGE, "16", 2);
    int32_t sel_big[3] = {R, F, 1 << 30};
    swap_refused(&L, ctx, 0, &dummy, sel_big, 2, 3, KVSWAP_STATUS_OUT_OF_RANGE, "1073741824", 2);

    /* count > gpu_chunks. */
    int32_t sel5[5] = {0, 1, 2, 3, R};
    swap_refused(&L, ctx, 0, &dummy, sel5, 2, 5, KVSWAP_STATUS_OUT_OF_RANGE, "count=5", 2);
    CHECK_MSG("gpu_chunks");
    /* Absurd count / window_len: refused before touching memory. */
    swap_refused(&L, ctx, 0, NULL, NULL, 0, UINT32_MAX, KVSWAP_STATUS_NULL_POINTER, "indices", 2);
    {
        Snapshot before = snapshot_at(__LINE__, ctx, 2);
        int32_t *d_dummy = (int32_t *)dev_copy(&dummy, sizeof dummy);
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, d_dummy, 0, UINT32_MAX, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "count=");
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, d_dummy, UINT32_MAX, 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "window_len");
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, d_dummy, (uint32_t)INT32_MAX - 2, 0, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "window_len");
        /* indices not 4-byte aligned: refused before any access. */
        int32_t *d_odd = (int32_t *)((uintptr_t)d_dummy + 1);
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, d_odd, 0, 1, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "aligned");
        CHECK_MSG("indices");
        same_snapshot_at(__LINE__, ctx, &before);
        dm_sync();
        dm_download(&dummy, d_dummy, sizeof dummy);
        dm_free(d_dummy);
        CHECK(dummy == 0);
        probe_lru(&L, 3);
    }
    check_stats(&L1);
    group_done("swap_in guards: NULL ctx/indices, misaligned indices, layer, ids <0 and >=cap, count > gpu_chunks, NOT_STORED; state unchanged, LRU order intact");

    /* ---- store / store_batch guards ---- */
    uint8_t chunk[32];
    fill_chunk(chunk, 32, 0, 1, 99);
    void *dchunk = dev_copy(chunk, sizeof chunk);
    void *S = cur_stream();
    Snapshot before = snapshot_at(__LINE__, ctx, 2);
    CHECK_ERR(kvswap_store(NULL, 0, 1, dchunk, S), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_store");
    CHECK_ERR(kvswap_store(ctx, 0, 1, NULL, S), KVSWAP_STATUS_NULL_POINTER, "src");
    CHECK_ERR(kvswap_store(ctx, 2, 1, dchunk, S), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_store(ctx, 0, -1, dchunk, S), KVSWAP_STATUS_OUT_OF_RANGE, "-1");
    CHECK_ERR(kvswap_store(ctx, 0, 16, dchunk, S), KVSWAP_STATUS_OUT_OF_RANGE, "16");
    CHECK_ERR(kvswap_store(ctx, 0, INT32_MIN, dchunk, S), KVSWAP_STATUS_OUT_OF_RANGE, "-2147483648");

    int32_t resident_id = L.model.slot_chunk[0];
    int32_t ids_bad[3] = {resident_id, 13, 99};
    uint8_t rows[3 * 32];
    fill_chunk(rows, 32, 0, (uint32_t)resident_id, 77);
    fill_chunk(rows + 32, 32, 0, 13, 77);
    fill_chunk(rows + 64, 32, 0, 99, 77);
    void *drows = dev_copy(rows, sizeof rows);
    CHECK_ERR(kvswap_store_batch(NULL, 0, ids_bad, 2, drows, 0, S), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_store_batch");
    CHECK_ERR(kvswap_store_batch(ctx, 0, NULL, 2, drows, 0, S), KVSWAP_STATUS_NULL_POINTER, "ids");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 2, NULL, 0, S), KVSWAP_STATUS_NULL_POINTER, "src");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 0, drows, 0, S), KVSWAP_STATUS_INVALID_ARGUMENT, "n is 0");
    CHECK_ERR(kvswap_store_batch(ctx, 2, ids_bad, 2, drows, 0, S), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    /* One bad id among good ones: nothing is stored (not 13, not the resident chunk). */
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 3, drows, 32, S), KVSWAP_STATUS_OUT_OF_RANGE, "99");
    int32_t ids_neg[2] = {13, -7};
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_neg, 2, drows, 32, S), KVSWAP_STATUS_OUT_OF_RANGE, "-7");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 2, drows, 16, S), KVSWAP_STATUS_INVALID_ARGUMENT, "src_stride");
    CHECK_ERR(kvswap_store_batch(ctx, 0, (const int32_t *)((uintptr_t)ids_bad + 2), 1, drows, 0, S), KVSWAP_STATUS_INVALID_ARGUMENT, "aligned");
    CHECK_MSG("ids");
    same_snapshot_at(__LINE__, ctx, &before);
    check_staged(&L); /* the resident chunk still holds its old bytes */
    {
        int32_t buf[2] = {0, 13};
        CHECK_ERR(swap_dev(ctx, 0, buf, 2, 1, 1), KVSWAP_STATUS_NOT_STORED, "13");
        CHECK(buf[0] == 0 && buf[1] == 13);
    }
    dm_free(dchunk);
    dm_free(drows);
    same_snapshot_at(__LINE__, ctx, &before);
    probe_lru(&L, 5);
    check_stats(&L1);
    group_done("store / store_batch guards: NULLs, misaligned ids, n 0, layer, ids, src_stride; nothing stored, slots not refreshed");

    /* ---- stats / staging / sync / info guards: out-parameters untouched ---- */
    before = snapshot_at(__LINE__, ctx, 2);
    KvswapLayerStats st, st_sent;
    memset(&st, 0x3C, sizeof st);
    memcpy(&st_sent, &st, sizeof st);
    CHECK_ERR(kvswap_layer_stats(NULL, 0, &st), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_layer_stats");
    CHECK_ERR(kvswap_layer_stats(ctx, 0, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    CHECK_ERR(kvswap_layer_stats(ctx, 2, &st), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_layer_stats(ctx, UINT32_MAX, &st), KVSWAP_STATUS_OUT_OF_RANGE, "layer");
    CHECK(memcmp(&st, &st_sent, sizeof st) == 0);

    void *p, *p_sent;
    size_t stride, stride_sent;
    uint32_t nrows, nrows_sent;
    memset(&p, 0x3C, sizeof p);
    memset(&stride, 0x3C, sizeof stride);
    memset(&nrows, 0x3C, sizeof nrows);
    memcpy(&p_sent, &p, sizeof p);
    stride_sent = stride;
    nrows_sent = nrows;
    CHECK_ERR(kvswap_layer_staging(NULL, 0, &p, &stride, &nrows), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_layer_staging");
    CHECK_ERR(kvswap_layer_staging(ctx, 0, NULL, &stride, &nrows), KVSWAP_STATUS_NULL_POINTER, "out_ptr");
    CHECK_ERR(kvswap_layer_staging(ctx, 0, &p, NULL, &nrows), KVSWAP_STATUS_NULL_POINTER, "out_stride");
    CHECK_ERR(kvswap_layer_staging(ctx, 0, &p, &stride, NULL), KVSWAP_STATUS_NULL_POINTER, "out_rows");
    CHECK_ERR(kvswap_layer_staging(ctx, 2, &p, &stride, &nrows), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK(memcmp(&p, &p_sent, sizeof p) == 0);
    CHECK(stride == stride_sent);
    CHECK(nrows == nrows_sent);

    CHECK_ERR(kvswap_sync(NULL, NULL), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_sync");
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    same_snapshot_at(__LINE__, ctx, &before);
    probe_lru(&L, 7);
    check_stats(&L);
    check_stats(&L1);
    kvswap_destroy(ctx);
    group_done("layer_stats / layer_staging / sync guards; out-parameters untouched (context_info guards: in the create, destroy group)");
}

/* ---- asynchronous mode ---- */

/* Requests i = 0 .. n-1 of kvswap_swap_in_layers: layer order[i], index
 * buffer idx[i], the same window and count, reserved 0. */
static void swap_requests(KvswapSwapIn *req, uint32_t n, const uint32_t *order, int32_t *const *idx, uint32_t window,
                          uint32_t count) {
    for (uint32_t i = 0; i < n; i++) {
        memset(&req[i], 0, sizeof req[i]);
        req[i].layer = order[i];
        req[i].window_len = window;
        req[i].count = count;
        req[i].indices = idx[i];
    }
}

/* kvswap_swap_in_layers: three layers in one call (not in layer order), the
 * shared top-k copied in, against one kvswap_swap_in_selected per layer on
 * a twin context (index buffers, counters, deferred errors); then refusals,
 * each naming its request and changing nothing. With sync = 0, so on CUDA
 * the layers share one launch pair. */
static void test_swap_in_layers(void) {
    enum { NL = 3, CAP = 32, CB = 32, SLOTS = 4, WIN = 2, CNT = 4, N = WIN + CNT };
    KvswapConfig cfg = test_config(1, SLOTS, SLOTS);
    cfg.sync = 0;
    KvswapLayerSpec specs[NL] = {layer_spec(CAP, CB), layer_spec(CAP, CB), layer_spec(CAP, CB)};
    KvswapContext *multi = create_ok(&cfg, specs, NL);
    KvswapContext *single = create_ok(&cfg, specs, NL);
    /* Chunks 0..27 of every layer stored in both; 28..31 never. */
    int32_t ids[CAP - 4];
    uint8_t rows[(CAP - 4) * CB];
    for (uint32_t l = 0; l < NL; l++) {
        for (uint32_t i = 0; i < CAP - 4; i++) {
            ids[i] = (int32_t)i;
            fill_chunk(rows + i * CB, CB, l, i, 1);
        }
        CHECK_OK(store_batch_dev(multi, l, ids, CAP - 4, rows, sizeof rows, 0));
        CHECK_OK(store_batch_dev(single, l, ids, CAP - 4, rows, sizeof rows, 0));
    }
    const uint32_t order[NL] = {2, 0, 1};
    int32_t *dev_idx[NL];
    for (uint32_t i = 0; i < NL; i++) dev_idx[i] = (int32_t *)dm_alloc(N * sizeof(int32_t));
    int32_t *dev_topk = (int32_t *)dm_alloc(CNT * sizeof(int32_t));
    KvswapSwapIn req[NL];
    for (int step = 0; step < 40; step++) {
        int32_t topk[CNT];
        for (uint32_t j = 0; j < CNT; j++) {
            uint32_t r = rnd(40);
            topk[j] = r == 0 ? -1 : r == 1 ? (int32_t)(CAP - 1) /* never stored */ : (int32_t)((step + rnd(12)) % (CAP - 4));
        }
        int32_t host[N] = {WIN_SENTINEL(0), WIN_SENTINEL(1), -5, -5, -5, -5};
        for (uint32_t i = 0; i < NL; i++) dm_upload(dev_idx[i], host, sizeof host);
        dm_upload(dev_topk, topk, sizeof topk);
        swap_requests(req, NL, order, dev_idx, WIN, CNT);
        CHECK_OK(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()));
        for (uint32_t i = 0; i < NL; i++) {
            int32_t expect[N] = {WIN_SENTINEL(0), WIN_SENTINEL(1), topk[0], topk[1], topk[2], topk[3]};
            CHECK_OK(swap_dev(single, order[i], expect, N, WIN, CNT));
            int32_t got[N];
            dm_sync();
            dm_download(got, dev_idx[i], sizeof got);
            if (memcmp(got, expect, sizeof got) != 0)
                FAIL("step %d layer %u: {%d %d %d %d} after kvswap_swap_in_layers, {%d %d %d %d} one call per layer", step,
                     order[i], got[2], got[3], got[4], got[5], expect[2], expect[3], expect[4], expect[5]);
        }
        enum KvswapStatus a = kvswap_sync(multi, cur_stream()), b = kvswap_sync(single, cur_stream());
        if (a != b) FAIL("step %d: deferred errors differ: %s vs %s", step, sname(a), sname(b));
        for (uint32_t l = 0; l < NL; l++) {
            KvswapLayerStats x = stats_of_at(__LINE__, multi, l), y = stats_of_at(__LINE__, single, l);
            if (memcmp(&x, &y, sizeof x) != 0) FAIL("step %d layer %u: counters differ", step, l);
        }
    }

    /* Refusals: nothing changes, the message names the request. */
    Snapshot before = snapshot_at(__LINE__, multi, NL);
    swap_requests(req, NL, order, dev_idx, WIN, CNT);
    CHECK_ERR(kvswap_swap_in_layers(multi, NULL, NL, dev_topk, cur_stream()), KVSWAP_STATUS_NULL_POINTER, "requests");
    CHECK_ERR(kvswap_swap_in_layers(NULL, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_ERR(kvswap_swap_in_layers(multi, req, 0, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "n is 0");
    req[2].layer = 2;
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
              "requests[0] and requests[2] both name layer 2");
    req[2].layer = 7;
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE,
              "requests[2] (layer 7): layer 7 is out of range");
    req[2].layer = 1;
    req[1].reserved = 1;
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
              "requests[1] (layer 0): reserved is 1");
    req[1].reserved = 0;
    req[1].indices = dev_idx[0] + 1; /* its entries start inside request 0's */
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "overlap");
    req[1].indices = dev_idx[1];
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_idx[2] + WIN + 1, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
              "overlap topk");
    req[0].count = SLOTS + 1;
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, NULL, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE,
              "requests[0] (layer 2): layer 2: count=5");
    req[0].count = CNT;
    req[2].indices = NULL;
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_NULL_POINTER,
              "requests[2] (layer 1): argument `indices` is NULL");
    req[2].indices = (int32_t *)((uintptr_t)dev_idx[2] + 2);
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
              "requests[2] (layer 1): indices");
    CHECK_MSG("aligned");
    req[2].indices = dev_idx[2];
    CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, (const int32_t *)((uintptr_t)dev_topk + 2), cur_stream()),
              KVSWAP_STATUS_INVALID_ARGUMENT, "topk");
    KvswapSwapIn four[NL + 1];
    memcpy(four, req, sizeof req);
    four[NL] = req[0];
    CHECK_ERR(kvswap_swap_in_layers(multi, four, NL + 1, dev_topk, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
              "n = 4 requests, but the context has 3 layers");
    if (dm_is_cuda()) {
        /* CUDA: the legacy stream, and a topk running past its allocation
         * (the request's count is one more than it holds). */
        CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
        CHECK_ERR(kvswap_swap_in_layers(multi, req, NL, dev_topk + 1, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE,
                  "topk");
        CHECK_MSG("past the end of its allocation");
    }
    same_snapshot_at(__LINE__, multi, &before);

    for (uint32_t i = 0; i < NL; i++) dm_free(dev_idx[i]);
    dm_free(dev_topk);
    kvswap_destroy(multi);
    kvswap_destroy(single);
    group_done("swap_in_layers");
}

static void test_async(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    cfg.sync = 0;
    KvswapLayerSpec specs[2] = {layer_spec(16, 32), layer_spec(16, 32)};
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    for (uint32_t id = 0; id < 9; id++) store_one(&L, id); /* 9.. never stored */

    /* 9 was never stored: its entry becomes -1, the rest proceed, OK. */
    int32_t buf[6] = {WIN_SENTINEL(0), WIN_SENTINEL(1), 1, 9, 2, 9};
    CHECK_OK(swap_dev(ctx, 0, buf, 6, 2, 4)); /* read back after the stream is synchronised */
    L.swap_calls++;
    int32_t as_model[4] = {1, -1, 2, -1};
    model_swap(&L.model, as_model, 4, 2);
    CHECK(buf[0] == WIN_SENTINEL(0) && buf[1] == WIN_SENTINEL(1));
    CHECK_EQ(buf[2], 2 + 0);
    CHECK_EQ(buf[3], -1);
    CHECK_EQ(buf[4], 2 + 1);
    CHECK_EQ(buf[5], -1);
    check_staged(&L);
    /* The next synchronising call reports it once, then OK. */
    CHECK_ERR(kvswap_sync(ctx, cur_stream()), KVSWAP_STATUS_NOT_STORED, "chunk 9");
    CHECK_MSG("never stored");
    CHECK_OK(kvswap_sync(ctx, cur_stream()));

    /* The same through layer_stats; its out-parameter is untouched on the error. */
    int32_t buf2[3] = {4, 10, 4};
    CHECK_OK(swap_dev(ctx, 0, buf2, 3, 0, 3));
    L.swap_calls++;
    int32_t as_model2[3] = {4, -1, 4};
    model_swap(&L.model, as_model2, 3, 0);
    CHECK_EQ(buf2[0], as_model2[0]);
    CHECK_EQ(buf2[1], -1);
    CHECK_EQ(buf2[2], as_model2[2]);
    KvswapLayerStats st, sent;
    memset(&st, 0x3C, sizeof st);
    memcpy(&sent, &st, sizeof st);
    CHECK_ERR(kvswap_layer_stats(ctx, 0, &st), KVSWAP_STATUS_NOT_STORED, "chunk 10");
    CHECK(memcmp(&st, &sent, sizeof st) == 0);
    check_stats(&L); /* OK now, with exact counters */

    /* Two refused entries in two calls before a sync: the first is reported, once. */
    int32_t b3[1] = {11};
    int32_t b4[1] = {12};
    CHECK_OK(swap_dev(ctx, 0, b3, 1, 0, 1));
    CHECK_OK(swap_dev(ctx, 0, b4, 1, 0, 1));
    L.swap_calls += 2;
    int32_t none[1] = {-1};
    model_swap(&L.model, none, 1, 0);
    model_swap(&L.model, none, 1, 0);
    CHECK_EQ(b3[0], -1);
    CHECK_EQ(b4[0], -1);
    CHECK_ERR(kvswap_sync(ctx, cur_stream()), KVSWAP_STATUS_NOT_STORED, "chunk 11");
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    check_stats(&L);

    /* An out-of-range id in async mode is either refused at once (nothing
     * changed) or becomes -1 and is reported by the next sync. */
    int32_t b5[2] = {3, 16};
    enum KvswapStatus s = swap_dev(ctx, 0, b5, 2, 0, 2);
    if (s == KVSWAP_STATUS_OK) {
        L.swap_calls++;
        int32_t m5[2] = {3, -1};
        model_swap(&L.model, m5, 2, 0);
        CHECK_EQ(b5[0], m5[0]);
        CHECK_EQ(b5[1], -1);
        CHECK_ERR(kvswap_sync(ctx, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "16");
    } else {
        CHECK_EQ(s, KVSWAP_STATUS_OUT_OF_RANGE);
        CHECK_MSG("16");
        CHECK(b5[0] == 3 && b5[1] == 16);
    }
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    /* kvswap_layer_sync returns its own layer's error only. */
    int32_t b7[1] = {5}; /* layer 1 has nothing stored */
    int32_t b8[1] = {13};
    CHECK_OK(swap_dev(ctx, 1, b7, 1, 0, 1));
    CHECK_OK(swap_dev(ctx, 0, b8, 1, 0, 1));
    L.swap_calls++;
    model_swap(&L.model, none, 1, 0);
    CHECK_EQ(b7[0], -1);
    /* A peek at layer 1's counters (one call, nothing resident) leaves its error. */
    KvswapLayerStats peek;
    memset(&peek, 0x3C, sizeof peek);
    CHECK_OK(kvswap_layer_stats_peek(ctx, 1, &peek));
    CHECK(peek.swap_in_calls == 1 && peek.resident == 0 && peek.misses == 0);
    CHECK_ERR(kvswap_layer_stats_peek(ctx, 2, &peek), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_layer_stats_peek(ctx, 1, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    CHECK_ERR(kvswap_layer_sync(NULL, 0, cur_stream()), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_ERR(kvswap_layer_sync(ctx, 2, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_layer_sync(ctx, 1, cur_stream()), KVSWAP_STATUS_NOT_STORED, "layer 1");
    CHECK_OK(kvswap_layer_sync(ctx, 1, cur_stream()));
    CHECK_ERR(kvswap_sync(ctx, cur_stream()), KVSWAP_STATUS_NOT_STORED, "chunk 13");
    CHECK_OK(kvswap_layer_sync(ctx, 0, cur_stream()));
    if (dm_is_cuda())
        CHECK_ERR(kvswap_layer_sync(ctx, 0, (void *)1), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy");
    check_stats(&L);
    /* Host-side guards are still immediate in async mode. */
    int32_t b6[5] = {0, 1, 2, 3, 4};
    CHECK_ERR(swap_dev(ctx, 0, b6, 5, 0, 5), KVSWAP_STATUS_OUT_OF_RANGE, "count=5");
    CHECK_ERR(swap_dev(ctx, 3, b6, 5, 0, 1), KVSWAP_STATUS_OUT_OF_RANGE, "layer 3");
    for (int32_t i = 0; i < 5; i++) CHECK_EQ(b6[i], i);
    probe_lru(&L, 1);
    check_stats(&L);
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    kvswap_destroy(ctx);
    group_done("async mode (sync=0): not-stored entry -> -1, call OK, next sync / layer_stats / layer_sync reports it once (layer_sync its own layer's only; layer_stats_peek leaves it)");
}

/* ---- swap off: every chunk resident at its own id ---- */

static void test_disabled(void) {
    for (int variant = 0; variant < 2; variant++) {
        /* variant 0: enable=0; variant 1: enable=1 but cap <= gpu_chunks. */
        KvswapConfig cfg = variant == 0 ? test_config(0, 4, 512) : test_config(1, 32, 32);
        KvswapLayerSpec specs[2] = {layer_spec(16, 24), layer_spec(7, 40)};
        KvswapContext *ctx = create_ok(&cfg, specs, 2);
        KvswapContextInfo info;
        CHECK_OK(kvswap_context_info(ctx, &info));
        CHECK_EQ(info.swap_layers, 0);
        CHECK_EQ(info.staging_bytes, 16 * 24 + 7 * 40);
        for (uint32_t l = 0; l < 2; l++) {
            uint32_t cap = l == 0 ? 16 : 7;
            size_t cb = l == 0 ? 24 : 40;
            KvswapLayerStats s = stats_of(ctx, l);
            CHECK_EQ(s.swap_enabled, 0);
            CHECK_EQ(s.slots, cap);
            CHECK_EQ(s.resident, 0);
            void *ptr;
            size_t stride;
            uint32_t rows;
            CHECK_OK(kvswap_layer_staging(ctx, l, &ptr, &stride, &rows));
            CHECK_EQ(rows, cap);
            CHECK(stride >= cb);
            uint8_t chunk[64];
            for (uint32_t id = 0; id < cap; id++) {
                fill_chunk(chunk, cb, l, id, 1);
                CHECK_OK(store_dev(ctx, l, (int32_t)id, chunk, cb));
            }
            s = stats_of(ctx, l);
            CHECK_EQ(s.resident, cap);
            /* With swap off, count is bounded by the layer's rows, not by
             * gpu_chunks (variant 0 has gpu_chunks 4 < count 7). */
            int32_t buf[3 + 7 + 1] = {WIN_SENTINEL(0), WIN_SENTINEL(1), WIN_SENTINEL(2), (int32_t)cap - 1, 3, 3, -1, 0, 5, 1,
                                      TAIL_SENTINEL};
            CHECK_OK(swap_dev(ctx, l, buf, 11, 3, 7));
            const int32_t want[7] = {3 + (int32_t)cap - 1, 3 + 3, 3 + 3, -1, 3 + 0, 3 + 5, 3 + 1};
            for (int i = 0; i < 3; i++) CHECK(buf[i] == WIN_SENTINEL(i));
            CHECK(buf[10] == TAIL_SENTINEL);
            for (int i = 0; i < 7; i++)
                if (buf[3 + i] != want[i]) FAIL("swap off, layer %u entry %d: %d, expected %d", l, i, buf[3 + i], want[i]);
            uint8_t *rows_copy = staging_copy(ptr, stride, rows, cb);
            for (uint32_t id = 0; id < cap; id++)
                if (!chunk_is(rows_copy + id * stride, cb, l, id, 1)) FAIL("swap off: row %u is not chunk %u", id, id);
            free(rows_copy);
            s = stats_of(ctx, l);
            CHECK_EQ(s.misses, 0);
            CHECK_EQ(s.evictions, 0);
            CHECK_EQ(s.hits, 5); /* distinct: cap-1, 3, 0, 5, 1 */
            CHECK_EQ(s.swap_in_calls, 1);
            /* A new version is visible in its row at once. */
            fill_chunk(chunk, cb, l, 3, 2);
            CHECK_OK(store_dev(ctx, l, 3, chunk, cb));
            rows_copy = staging_copy(ptr, stride, rows, cb);
            CHECK(chunk_is(rows_copy + 3 * stride, cb, l, 3, 2));
            free(rows_copy);
            /* Guards still apply. */
            int32_t bad[2] = {(int32_t)cap, 0};
            char bad_msg[64];
            snprintf(bad_msg, sizeof bad_msg, "selected id %d at selection position 0", (int)cap);
            CHECK_ERR(swap_dev(ctx, l, bad, 2, 0, 2), KVSWAP_STATUS_OUT_OF_RANGE, bad_msg);
            CHECK(bad[0] == (int32_t)cap && bad[1] == 0);
        }
        /* A chunk never stored cannot be selected even when swap is off. */
        KvswapLayerSpec one = layer_spec(8, 16);
        KvswapContext *c2 = create_ok(&cfg, &one, 1);
        int32_t b[2] = {0, 0};
        CHECK_ERR(swap_dev(c2, 0, b, 2, 0, 2), KVSWAP_STATUS_NOT_STORED, "0");
        CHECK(b[0] == 0 && b[1] == 0);
        kvswap_destroy(c2);
        kvswap_destroy(ctx);
    }
    group_done("swap off (enable=0, and cap <= gpu_chunks): slot == logical id, swap_enabled == 0");
}

/* ---- validate ---- */

static void test_validate(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    cfg.validate = 1;
    void *engine = dm_alloc(4 * 32); /* engine-owned staging: device memory on CUDA */
    KvswapLayerSpec spec = layer_spec(16, 32);
    spec.staging = engine;
    KvswapContext *ctx = create_ok(&cfg, &spec, 1);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    for (uint32_t id = 0; id < 16; id++) store_one(&L, id);
    const int32_t sel[3] = {3, 4, 5};
    swap_ok(&L, 0, 3, sel, NULL);
    /* Scribble on chunk 4's slot behind kvswap's back (through the device
     * pointer, ordered before the next call): the next hit is caught. */
    int32_t slot = L.model.chunk_slot[4];
    uint8_t row[32];
    uint8_t *slot_row = (uint8_t *)engine + slot * 32;
    dm_sync();
    dm_download(row, slot_row, sizeof row);
    CHECK(chunk_is(row, 32, 0, 4, L.version[4]));
    row[7] ^= 0xFF;
    dm_upload(slot_row, row, sizeof row);
    int32_t buf[1] = {4};
    CHECK_ERR(swap_dev(ctx, 0, buf, 1, 0, 1), KVSWAP_STATUS_VALIDATION_FAILED, "differs");
    kvswap_destroy(ctx);
    dm_free(engine);
    group_done("validate=1 passes on honest slots and catches a corrupted slot");
}

/* ---- streams and pointers ---- */

/* CU_STREAM_PER_THREAD is accepted (ignored on the CPU backend). On CUDA:
 * the legacy default stream (NULL, CU_STREAM_LEGACY) is refused, on a
 * layer's first call too; host memory where device memory is expected
 * (indices, src, staging) is refused; so are device buffers too small for
 * what a call would touch. Every refusal leaves everything unchanged. */
static void test_streams_and_pointers(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    KvswapLayerSpec specs[3] = {layer_spec(16, 32), layer_spec(16, 32), layer_spec(16, 32)};
    KvswapContext *ctx = create_ok(&cfg, specs, 3);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    const int32_t R = PICK_LRU_RESIDENT, F = PICK_FREE;
    int32_t dummy = 0;

    for (uint32_t id = 0; id < 10; id++) store_one(&L, id);
    const int32_t warm[4] = {1, 2, 3, 4};
    swap_ok(&L, 1, 4, warm, NULL);

    if (dm_is_cuda()) {
        /* Once the layer has used a real stream: still refused. */
        int32_t sel[2] = {R, F};
        swap_refused_on(NULL, &L, ctx, 0, &dummy, sel, 2, 2, KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream", 3);
        swap_refused_on(DM_STREAM_LEGACY, &L, ctx, 0, &dummy, sel, 2, 2, KVSWAP_STATUS_INVALID_ARGUMENT,
                        "legacy default stream", 3);
        /* A refused store of a resident chunk does not refresh its slot. */
        int32_t rid = L.model.slot_chunk[0];
        uint8_t v2[32];
        fill_chunk(v2, 32, 0, (uint32_t)rid, L.version[rid] + 1);
        Snapshot before = snapshot_at(__LINE__, ctx, 3);
        CHECK_ERR(store_on(NULL, ctx, 0, rid, v2, sizeof v2), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
        CHECK_ERR(store_on(DM_STREAM_LEGACY, ctx, 0, rid, v2, sizeof v2), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "legacy default stream");
        same_snapshot_at(__LINE__, ctx, &before);
        check_staged(&L);

        /* Host memory (malloc) where device memory is expected. */
        int32_t *host_idx = (int32_t *)malloc(4 * sizeof(int32_t));
        CHECK(host_idx != NULL);
        host_idx[0] = WIN_SENTINEL(0);
        host_idx[1] = resolve_pick(&L, R);
        host_idx[2] = resolve_pick(&L, F);
        host_idx[3] = TAIL_SENTINEL;
        int32_t copy[4];
        memcpy(copy, host_idx, sizeof copy);
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, host_idx, 1, 2, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "not CUDA memory");
        CHECK_MSG("indices");
        CHECK(memcmp(host_idx, copy, sizeof copy) == 0);
        free(host_idx);
        uint8_t *host_src = (uint8_t *)malloc(64);
        CHECK(host_src != NULL);
        fill_chunk(host_src, 32, 0, (uint32_t)rid, L.version[rid] + 1);
        fill_chunk(host_src + 32, 32, 0, 11, 1);
        CHECK_ERR(kvswap_store(ctx, 0, rid, host_src, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "not CUDA memory");
        CHECK_MSG("src");
        int32_t two[2] = {rid, 11};
        CHECK_ERR(kvswap_store_batch(ctx, 0, two, 2, host_src, 32, cur_stream()), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "not CUDA memory");
        CHECK_MSG("src");
        free(host_src);
        same_snapshot_at(__LINE__, ctx, &before);
        check_staged(&L);
        probe_lru(&L, 3);
        void *host_staging = malloc(4 * 32);
        CHECK(host_staging != NULL);
        KvswapLayerSpec hs = layer_spec(16, 32);
        hs.staging = host_staging;
        create_refused(&cfg, &hs, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "not CUDA memory");
        CHECK_MSG("staging");
        free(host_staging);
        group_done("CUDA: legacy stream (NULL, CU_STREAM_LEGACY) refused for swap_in and store; host pointers as "
                   "indices, src and staging refused (\"not CUDA memory\"); nothing changed");
    }

    /* CU_STREAM_PER_THREAD: stores (one refreshing a resident chunk) and
     * swap-ins on it, checked like any other. */
    use_stream(DM_STREAM_PER_THREAD);
    store_one(&L, 10);
    store_one(&L, 11);
    CHECK(L.model.slot_chunk[2] >= 0);
    store_one(&L, (uint32_t)L.model.slot_chunk[2]);
    check_staged(&L);
    const int32_t pt_sel[4] = {10, 11, -1, 2};
    swap_ok(&L, 3, 4, pt_sel, NULL);
    for (int i = 0; i < 20; i++) random_swap(&L);
    CHECK_OK(kvswap_sync(ctx, DM_STREAM_PER_THREAD));
    use_stream(dm_stream());
    random_swap(&L);
    check_stats(&L);
    kvswap_destroy(ctx);
    group_done("CU_STREAM_PER_THREAD accepted for store, swap_in_selected and sync");

    if (dm_is_cuda()) {
        /* Device buffers smaller than what a call would touch: refused
         * before any device work (fresh context: nothing checked earlier). */
        void *small = dm_alloc(64);
        int32_t pad[16];
        for (int i = 0; i < 16; i++) pad[i] = -1;
        dm_upload(small, pad, sizeof pad);
        KvswapLayerSpec big = layer_spec(16, 32);
        big.staging = small;
        big.staging_stride = (uint64_t)1 << 24; /* 4 rows: 48 MiB */
        create_refused(&cfg, &big, 1, KVSWAP_STATUS_OUT_OF_RANGE, "runs past the end");
        CHECK_MSG("staging");
        KvswapContext *c2 = create_ok(&cfg, specs, 1);
        Snapshot before = snapshot_at(__LINE__, c2, 1);
        int32_t ids[2] = {0, 1};
        CHECK_ERR(kvswap_store_batch(c2, 0, ids, 2, small, (size_t)1 << 26, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE,
                  "runs past the end");
        CHECK_MSG("src");
        CHECK_ERR(kvswap_swap_in_selected(c2, 0, (int32_t *)small, 1u << 22, 2, cur_stream()), KVSWAP_STATUS_OUT_OF_RANGE,
                  "runs past the end");
        CHECK_MSG("indices");
        same_snapshot_at(__LINE__, c2, &before);
        int32_t back[16];
        dm_sync();
        dm_download(back, small, sizeof back);
        CHECK(memcmp(back, pad, sizeof pad) == 0);
        kvswap_destroy(c2);
        dm_free(small);
        group_done("CUDA: staging, src and indices past the end of their allocation refused");
    }
}

/* ---- validate=1 and refused swap-ins ---- */

/* A swap-in refused with sync=1 leaves the logical ids in the index buffer:
 * nothing may read them as physical ids (the first entry, 5, is below
 * window_len 8: read as a physical id it names slot -3). The refusal
 * changes nothing and the context stays usable. */
static void test_validate_refused(void) {
    KvswapConfig cfg = test_config(1, 4, 4);
    cfg.validate = 1;
    KvswapLayerSpec spec = layer_spec(32, 32);
    KvswapContext *ctx = create_ok(&cfg, &spec, 1);
    Layer L;
    layer_init(&L, ctx, 0, 32, 4, 32);
    for (uint32_t id = 0; id < 16; id++) store_one(&L, id); /* 16..31 never stored */
    const int32_t sel[3] = {3, 4, 5};
    swap_ok(&L, 8, 3, sel, NULL);
    int32_t dummy = 0;
    const int32_t ns[3] = {5, 1, 20};
    swap_refused(&L, ctx, 0, &dummy, ns, 8, 3, KVSWAP_STATUS_NOT_STORED, "chunk 20", 1);
    const int32_t oor[2] = {2, 99};
    swap_refused(&L, ctx, 0, &dummy, oor, 8, 2, KVSWAP_STATUS_OUT_OF_RANGE, "99", 1);
    for (int i = 0; i < 20; i++) random_swap(&L);
    check_stats(&L);
    CHECK_OK(kvswap_sync(ctx, cur_stream()));
    kvswap_destroy(ctx);
    group_done("validate=1: refused swap-ins (NOT_STORED, OUT_OF_RANGE) change nothing; the context stays usable");
}

/* ---- the legacy stream on a fresh layer (CUDA) ---- */

static void test_legacy_stream_fresh_layer(void) {
    if (!dm_is_cuda()) return;
    KvswapConfig cfg = test_config(1, 4, 4);
    KvswapLayerSpec specs[3] = {layer_spec(16, 32), layer_spec(16, 32), layer_spec(16, 32)};
    KvswapContext *ctx = create_ok(&cfg, specs, 3);
    Snapshot before;
    /* The legacy stream on the very first call of a layer (no stream
     * seen yet, on any of the three layers): refused too. */
    uint8_t chunk[32], rows[64];
    int32_t ids2[2] = {0, 1};
    fill_chunk(chunk, 32, 0, 0, 1);
    fill_chunk(rows, 32, 1, 0, 1);
    fill_chunk(rows + 32, 32, 1, 1, 1);
    before = snapshot_at(__LINE__, ctx, 3);
    CHECK_ERR(store_on(NULL, ctx, 0, 0, chunk, sizeof chunk), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
    CHECK_MSG("kvswap_store");
    CHECK_ERR(store_batch_on(NULL, ctx, 1, ids2, 2, rows, sizeof rows, 0), KVSWAP_STATUS_INVALID_ARGUMENT,
              "legacy default stream");
    CHECK_MSG("kvswap_store_batch");
    int32_t padding[4] = {WIN_SENTINEL(0), -1, -1, TAIL_SENTINEL};
    CHECK_ERR(swap_on(NULL, ctx, 2, padding, 4, 1, 2), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
    CHECK_MSG("kvswap_swap_in_selected");
    CHECK(padding[0] == WIN_SENTINEL(0) && padding[1] == -1 && padding[2] == -1 && padding[3] == TAIL_SENTINEL);
    same_snapshot_at(__LINE__, ctx, &before);
    kvswap_destroy(ctx);
    group_done("CUDA: the legacy stream refused on the first call of a fresh layer (store, store_batch, swap_in)");
}

/* ------------------------------------------------------------------------ */
/* FlashMemory scorer (fm_*)                                                 */
/* ------------------------------------------------------------------------ */

/*
 * The checkpoint comes from the environment: KVSWAP_TEST_FM_CKPT names a file
 * made by
 *     kvswap fm init --hidden 64 --heads 16 --head-dim 64 --scorers 2 \
 *                    --dtype bf16 --seed 7 --out FILE
 * (tests/ffi_c.rs makes one and always sets the variable). This program
 * generates no checkpoint itself; without the variable the scorer group is
 * skipped with a loud note and the final line says so
 * (KVSWAP_TEST_REQUIRE_FM_CKPT=1 turns the skip into a failure).
 *
 * The reference: the test reads the weights straight from the safetensors
 * file (not through the ABI) and computes every score in double precision in
 * the library's order of operations, so on the CPU backend the top-k must
 * equal the reference exactly, tie order included. On CUDA (bf16 q, f32
 * accumulation) a chunk must be in the top-k when it is certainly among the k
 * best once each score is widened by an error bound, and must be absent when
 * it is certainly not (see fm_check_topk). Relations that need no weights are
 * checked as well: ties, -1 padding, f32 keys holding bf16 values, fp8 keys
 * with power-of-two scales, key strides, permuted key rows, a scaled hidden
 * state, the ensemble with one scorer's input zero, batches against single
 * calls.
 *
 * On CUDA the scorer is on device 0 and hidden, keys, scales, out_indices,
 * query and bounds are device memory (exact copies made for each call);
 * fm_bounds_build is host memory on both backends, and fm_bounds_topk(-1, ..)
 * is also run with host memory there.
 */

#define FM_WANT_SCORERS 2u
#define FM_WANT_HIDDEN 64u
#define FM_WANT_HEADS 16u
#define FM_WANT_HEAD_DIM 64u
#define FM_INIT_CMD \
    "kvswap fm init --hidden 64 --heads 16 --head-dim 64 --scorers 2 --dtype bf16 --seed 7 --out FILE"
#define FM_SENTINEL ((int32_t)-7)

static uint32_t fm_rng = 0x2545F491u; /* reseeded from the run's seed in main */

static uint32_t fm_rand_u32(void) {
    fm_rng ^= fm_rng << 13;
    fm_rng ^= fm_rng >> 17;
    fm_rng ^= fm_rng << 5;
    return fm_rng;
}

/* Uniform in [-1, 1), multiples of 2^-23 (exact f32 values). */
static float fm_frand(void) { return (float)((int32_t)(fm_rand_u32() >> 8) - (1 << 23)) / (float)(1 << 23); }

static float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float -> bf16, round to nearest even on the upper 16 bits (finite inputs). */
static uint16_t f32_to_bf16(float f) {
    uint32_t u = bits_of_f32(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t b) { return f32_of_bits((uint32_t)b << 16); }

static double dabs(double x) { return x < 0 ? -x : x; }

static double pow2i(int e) {
    double v = 1.0;
    for (; e > 0; e--) v *= 2.0;
    for (; e < 0; e++) v *= 0.5;
    return v;
}

/* OCP fp8 e4m3 (bias 7, no infinities, S.1111.111 = NaN), exactly. */
static bool fp8_is_nan(uint8_t b) { return (b & 0x7Fu) == 0x7Fu; }
static double fp8_to_double(uint8_t b) {
    double sign = (b & 0x80u) ? -1.0 : 1.0;
    int exp = (b >> 3) & 0x0F, man = b & 0x07;
    double mag = exp == 0 ? (man / 8.0) * pow2i(-6) : (1.0 + man / 8.0) * pow2i(exp - 7);
    return sign * mag;
}

/* IEEE half -> double (finite values of a checkpoint). */
static double f16_to_double(uint16_t h, bool *finite) {
    uint32_t s = h >> 15, e = (h >> 10) & 31u, m = h & 1023u;
    *finite = e != 31u;
    double v = e == 0 ? m / 16777216.0 : (double)f32_of_bits((e - 15u + 127u) << 23 | m << 13);
    return s ? -v : v;
}

/* ---- the weights, read from the safetensors file itself ---- */

typedef struct FmRef {
    uint32_t ns, hid, nh, hd;
    double *wq; /* [ns][nh*hd][hid] */
    double *ww; /* [ns][nh][hid] */
} FmRef;

static FmRef g_fmref;

static uint8_t *read_whole_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) FAIL("cannot open %s", path);
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 1 << 16;
            uint8_t *nb = (uint8_t *)realloc(buf, cap);
            if (!nb) FAIL("out of host memory");
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    *len = n;
    return buf;
}

/* In the JSON header `hdr`: the object of tensor `name`, its dtype, shape
 * [r, c] and data offsets. The header is written by the safetensors crate;
 * a plain text search is enough for it. */
static void st_tensor(const char *path, const char *hdr, const char *name, char *dtype, size_t dtype_cap,
                      uint64_t shape[2], uint64_t off[2]) {
    char key[64];
    snprintf(key, sizeof key, "\"%s\"", name);
    const char *p = strstr(hdr, key);
    if (!p) FAIL("%s: the safetensors header has no tensor %s (made by `" FM_INIT_CMD "`?)", path, name);
    const char *open = strchr(p, '{'), *close = open ? strchr(open, '}') : NULL;
    if (!open || !close) FAIL("%s: tensor %s: malformed header", path, name);
    const char *d = strstr(open, "\"dtype\"");
    const char *s = strstr(open, "\"shape\"");
    const char *o = strstr(open, "\"data_offsets\"");
    if (!d || !s || !o || d > close || s > close || o > close) FAIL("%s: tensor %s: dtype/shape/data_offsets missing", path, name);
    d = strchr(d + 7, '"');
    const char *dend = d ? strchr(d + 1, '"') : NULL;
    if (!d || !dend || (size_t)(dend - d - 1) >= dtype_cap) FAIL("%s: tensor %s: bad dtype", path, name);
    memcpy(dtype, d + 1, (size_t)(dend - d - 1));
    dtype[dend - d - 1] = 0;
    const char *lists[2] = {s, o};
    uint64_t *vals[2] = {shape, off};
    for (int l = 0; l < 2; l++) {
        const char *b = strchr(lists[l], '[');
        if (!b || b > close) FAIL("%s: tensor %s: bad list", path, name);
        char *end = NULL;
        vals[l][0] = strtoull(b + 1, &end, 10);
        if (!end || *end != ',') FAIL("%s: tensor %s: expected two numbers in a list", path, name);
        vals[l][1] = strtoull(end + 1, &end, 10);
        if (!end || *end != ']') FAIL("%s: tensor %s: expected two numbers in a list", path, name);
    }
}

/* Decodes tensor `name` ([rows, cols]) to doubles at `dst`. */
static void st_read(const char *path, const uint8_t *file, size_t len, const char *hdr, size_t data_start,
                    const char *name, uint64_t rows, uint64_t cols, double *dst) {
    char dtype[16];
    uint64_t shape[2], off[2];
    st_tensor(path, hdr, name, dtype, sizeof dtype, shape, off);
    if (shape[0] != rows || shape[1] != cols)
        FAIL("%s: tensor %s has shape [%llu, %llu], expected [%llu, %llu]", path, name, (unsigned long long)shape[0],
             (unsigned long long)shape[1], (unsigned long long)rows, (unsigned long long)cols);
    size_t es = strcmp(dtype, "F32") == 0 ? 4 : (strcmp(dtype, "BF16") == 0 || strcmp(dtype, "F16") == 0) ? 2 : 0;
    if (es == 0) FAIL("%s: tensor %s has dtype %s (expected F32, F16 or BF16)", path, name, dtype);
    uint64_t n = rows * cols;
    if (off[1] < off[0] || off[1] - off[0] != n * es || data_start + off[1] > len)
        FAIL("%s: tensor %s: data_offsets [%llu, %llu] do not fit", path, name, (unsigned long long)off[0],
             (unsigned long long)off[1]);
    const uint8_t *p = file + data_start + off[0];
    for (uint64_t i = 0; i < n; i++) {
        bool finite = true;
        if (es == 4) {
            uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 | (uint32_t)p[4 * i + 2] << 16 |
                         (uint32_t)p[4 * i + 3] << 24;
            dst[i] = (double)f32_of_bits(u);
        } else {
            uint16_t h = (uint16_t)(p[2 * i] | p[2 * i + 1] << 8);
            if (strcmp(dtype, "BF16") == 0) dst[i] = (double)bf16_to_f32(h);
            else dst[i] = f16_to_double(h, &finite);
        }
        if (!finite || dst[i] != dst[i]) FAIL("%s: tensor %s: element %llu is not finite", path, name, (unsigned long long)i);
    }
}

static void fmref_load(const char *path, const FmScorerInfo *info) {
    size_t len = 0;
    uint8_t *file = read_whole_file(path, &len);
    if (len < 8) FAIL("%s: %zu bytes: not a safetensors file", path, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | file[i];
    if (hlen > len - 8) FAIL("%s: header length %llu runs past the file", path, (unsigned long long)hlen);
    char *hdr = (char *)malloc((size_t)hlen + 1);
    if (!hdr) FAIL("out of host memory");
    memcpy(hdr, file + 8, (size_t)hlen);
    hdr[hlen] = 0;
    FmRef *r = &g_fmref;
    r->ns = info->n_scorers;
    r->hid = info->hidden;
    r->nh = info->n_heads;
    r->hd = info->head_dim;
    size_t qn = (size_t)r->nh * r->hd * r->hid, wn = (size_t)r->nh * r->hid;
    r->wq = (double *)malloc(r->ns * qn * sizeof(double));
    r->ww = (double *)malloc(r->ns * wn * sizeof(double));
    if (!r->wq || !r->ww) FAIL("out of host memory");
    for (uint32_t i = 0; i < r->ns; i++) {
        char name[64];
        snprintf(name, sizeof name, "scorers.%u.wq", i);
        st_read(path, file, len, hdr, 8 + (size_t)hlen, name, (uint64_t)r->nh * r->hd, r->hid, r->wq + i * qn);
        snprintf(name, sizeof name, "scorers.%u.ww", i);
        st_read(path, file, len, hdr, 8 + (size_t)hlen, name, r->nh, r->hid, r->ww + i * wn);
    }
    free(hdr);
    free(file);
}

static void fmref_free(void) {
    free(g_fmref.wq);
    free(g_fmref.ww);
    memset(&g_fmref, 0, sizeof g_fmref);
}

/* ---- keys on the host ---- */

typedef struct HKeys {
    FmKeyDtype dtype;
    uint32_t dim;
    size_t n;          /* rows */
    size_t stride;     /* bytes between rows */
    size_t stride_arg; /* FmKeys.row_stride_bytes: 0 (dense) or `stride` */
    uint8_t *data;     /* (n - 1) * stride + dim * esize bytes */
    float *scales;     /* fp8 only: n */
} HKeys;

static size_t key_esize(FmKeyDtype dt) { return dt == FM_KEYS_F32 ? 4 : dt == FM_KEYS_BF16 ? 2 : 1; }

static size_t hkeys_bytes(const HKeys *k) { return k->n ? (k->n - 1) * k->stride + k->dim * key_esize(k->dtype) : 0; }

/* Rows of `dim` elements; `stride_arg` 0 is dense; padding bytes are 0xFF
 * (NaN as f32 or bf16), so reading them would be an error. */
static HKeys hkeys_new(FmKeyDtype dt, size_t n, uint32_t dim, size_t stride_arg) {
    HKeys k;
    memset(&k, 0, sizeof k);
    k.dtype = dt;
    k.dim = dim;
    k.n = n;
    k.stride_arg = stride_arg;
    k.stride = stride_arg ? stride_arg : dim * key_esize(dt);
    size_t bytes = hkeys_bytes(&k);
    k.data = (uint8_t *)malloc(bytes ? bytes : 1);
    if (!k.data) FAIL("out of host memory");
    memset(k.data, 0xFF, bytes);
    if (dt == FM_KEYS_FP8_E4M3) {
        k.scales = (float *)malloc((n ? n : 1) * sizeof(float));
        if (!k.scales) FAIL("out of host memory");
        for (size_t r = 0; r < n; r++) k.scales[r] = 1.0f;
    }
    return k;
}

static void hkeys_free(HKeys *k) {
    free(k->data);
    free(k->scales);
    memset(k, 0, sizeof *k);
}

static uint8_t *hkeys_at(const HKeys *k, size_t r, uint32_t d) { return k->data + r * k->stride + d * key_esize(k->dtype); }

/* Stores `v` (f32 keys: as is; bf16: rounded to bf16). */
static void hkeys_set(HKeys *k, size_t r, uint32_t d, float v) {
    if (k->dtype == FM_KEYS_F32) {
        memcpy(hkeys_at(k, r, d), &v, 4);
    } else if (k->dtype == FM_KEYS_BF16) {
        uint16_t b = f32_to_bf16(v);
        memcpy(hkeys_at(k, r, d), &b, 2);
    } else {
        FAIL("test bug: hkeys_set on fp8 keys");
    }
}

/* The key value the library must use: exact, fp8 times its row scale. */
static double hkeys_value(const HKeys *k, size_t r, uint32_t d) {
    const uint8_t *p = hkeys_at(k, r, d);
    if (k->dtype == FM_KEYS_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    if (k->dtype == FM_KEYS_BF16) {
        uint16_t b;
        memcpy(&b, p, 2);
        return bf16_to_f32(b);
    }
    return fp8_to_double(*p) * (double)k->scales[r];
}

/* Random keys: f32 in [-1, 1), bf16 of those, or random finite fp8 with the
 * row scale 2^(r % 4 - 2) (`pow2_scales`) or an arbitrary one in [0.01, 0.5). */
static HKeys hkeys_random(FmKeyDtype dt, size_t n, uint32_t dim, size_t stride_arg, bool pow2_scales) {
    HKeys k = hkeys_new(dt, n, dim, stride_arg);
    for (size_t r = 0; r < n; r++) {
        if (dt == FM_KEYS_FP8_E4M3) {
            for (uint32_t d = 0; d < dim; d++) {
                uint8_t b = (uint8_t)(fm_rand_u32() >> 24);
                if (fp8_is_nan(b)) b ^= 1u;
                *hkeys_at(&k, r, d) = b;
            }
            k.scales[r] = pow2_scales ? (float)pow2i((int)(r % 4) - 2) : 0.01f + 0.49f * (fm_frand() + 1.0f) / 2.0f;
        } else {
            for (uint32_t d = 0; d < dim; d++) hkeys_set(&k, r, d, fm_frand());
        }
    }
    return k;
}

/* The same values in another dtype (f32 from anything; bf16 from bf16),
 * dense unless `stride_arg`. */
static HKeys hkeys_convert(const HKeys *src, FmKeyDtype dt, size_t stride_arg) {
    HKeys k = hkeys_new(dt, src->n, src->dim, stride_arg);
    for (size_t r = 0; r < src->n; r++)
        for (uint32_t d = 0; d < src->dim; d++) {
            double v = hkeys_value(src, r, d);
            if ((double)(float)v != v) FAIL("test bug: key value not exact in f32");
            hkeys_set(&k, r, d, (float)v);
            if (hkeys_value(&k, r, d) != v) FAIL("test bug: key value not exact in the new dtype");
        }
    return k;
}

/* Row r of the result is row perm[r] of `src`. */
static HKeys hkeys_permute(const HKeys *src, const uint32_t *perm) {
    HKeys k = hkeys_new(src->dtype, src->n, src->dim, src->stride_arg);
    size_t row = src->dim * key_esize(src->dtype);
    for (size_t r = 0; r < src->n; r++) {
        memcpy(hkeys_at(&k, r, 0), hkeys_at(src, perm[r], 0), row);
        if (src->scales) k.scales[r] = src->scales[perm[r]];
    }
    return k;
}

static FmKeys fmkeys_of(const void *data, const float *scales, const HKeys *k) {
    FmKeys f;
    memset(&f, 0, sizeof f);
    f.data = data;
    f.scales = scales;
    f.row_stride_bytes = k->stride_arg;
    f.dtype = k->dtype;
    return f;
}

/* ---- the reference ---- */

/* Scores of every chunk of `keys` in double precision, in the order of
 * operations of the library's CPU reference (src/scorer/reference.rs), and a
 * bound on the error of the CUDA scorer for each: q rounded to bf16 (2^-9
 * relative), f32 keys rounded to bf16, f32 accumulation; twice the sum of the
 * first-order terms, summed over the scorers. `err` may be NULL. */
static void fm_reference(const float *hidden, const HKeys *keys, uint32_t ensemble, double *score, double *err) {
    const FmRef *R = &g_fmref;
    const uint32_t nh = R->nh, hd = R->hd, hid = R->hid, ns = R->ns;
    double *q = (double *)malloc((size_t)nh * hd * sizeof(double));
    double *aq = (double *)malloc((size_t)nh * hd * sizeof(double));
    double *w = (double *)malloc(nh * sizeof(double));
    double *aw = (double *)malloc(nh * sizeof(double));
    double *key = (double *)malloc(hd * sizeof(double));
    double *si = (double *)malloc(ns * keys->n * sizeof(double));
    double *ei = (double *)malloc(ns * keys->n * sizeof(double));
    if (!q || !aq || !w || !aw || !key || !si || !ei) FAIL("out of host memory");
    const double kround = keys->dtype == FM_KEYS_F32 ? pow2i(-9) : 0.0;
    for (uint32_t i = 0; i < ns; i++) {
        const float *x = hidden + (size_t)i * hid;
        const double *wq = R->wq + (size_t)i * nh * hd * hid, *ww = R->ww + (size_t)i * nh * hid;
        for (size_t r = 0; r < (size_t)nh * hd; r++) {
            double s = 0, a = 0;
            for (uint32_t j = 0; j < hid; j++) {
                s += wq[r * hid + j] * (double)x[j];
                a += dabs(wq[r * hid + j] * (double)x[j]);
            }
            q[r] = s;
            aq[r] = a;
        }
        for (uint32_t h = 0; h < nh; h++) {
            double s = 0, a = 0;
            for (uint32_t j = 0; j < hid; j++) {
                s += ww[(size_t)h * hid + j] * (double)x[j];
                a += dabs(ww[(size_t)h * hid + j] * (double)x[j]);
            }
            w[h] = s;
            aw[h] = a;
        }
        for (size_t c = 0; c < keys->n; c++) {
            for (uint32_t d = 0; d < hd; d++) key[d] = hkeys_value(keys, c, d);
            double s = 0, e = 0;
            for (uint32_t h = 0; h < nh; h++) {
                double dot = 0, p = 0, qa = 0;
                for (uint32_t d = 0; d < hd; d++) {
                    dot += q[(size_t)h * hd + d] * key[d];
                    p += dabs(q[(size_t)h * hd + d] * key[d]);
                    qa += aq[(size_t)h * hd + d] * dabs(key[d]);
                }
                s += w[h] * (dot > 0 ? dot : 0.0);
                e += pow2i(-17) * aw[h] * dabs(dot) +
                     dabs(w[h]) * ((pow2i(-9) + kround + pow2i(-18)) * p + pow2i(-17) * qa) +
                     pow2i(-20) * dabs(w[h] * dot);
            }
            si[i * keys->n + c] = s;
            ei[i * keys->n + c] = 2 * e;
        }
    }
    for (size_t c = 0; c < keys->n; c++) {
        double s, e = 0;
        if (ensemble == KVSWAP_ENSEMBLE_MEAN) {
            s = 0;
            for (uint32_t i = 0; i < ns; i++) s += si[i * keys->n + c];
            s /= (double)ns;
        } else {
            s = si[c];
            for (uint32_t i = 1; i < ns; i++)
                if (si[i * keys->n + c] > s) s = si[i * keys->n + c];
        }
        for (uint32_t i = 0; i < ns; i++) e += ei[i * keys->n + c];
        score[c] = s;
        if (err) err[c] = e + 1e-300;
    }
    free(q);
    free(aq);
    free(w);
    free(aw);
    free(key);
    free(si);
    free(ei);
}

/* Bound scores (double, in index order: src/scorer/bounds.rs) and the error
 * bound of an f32 evaluation (products and a sum of `dim` terms, x4). */
static void bounds_reference(const float *query, const float *lo, const float *hi, uint32_t dim, size_t n, double *score,
                             double *err) {
    for (size_t c = 0; c < n; c++) {
        double s = 0, a = 0;
        for (uint32_t d = 0; d < dim; d++) {
            double x = (double)query[d] * (double)lo[c * dim + d], y = (double)query[d] * (double)hi[c * dim + d];
            s += x > y ? x : y;
            a += dabs(x) > dabs(y) ? dabs(x) : dabs(y);
        }
        score[c] = s;
        if (err) err[c] = 4.0 * (dim + 2) * pow2i(-24) * a + 1e-300;
    }
}

/* The reference top-k: score descending, ties to the lower id, -1 padded. */
static const double *g_sort_scores;
static int by_score_then_id(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    double sx = g_sort_scores[x], sy = g_sort_scores[y];
    if (sx > sy) return -1;
    if (sx < sy) return 1;
    return x < y ? -1 : x > y;
}

static void ref_topk(const double *score, size_t n, uint32_t k, int32_t *out) {
    uint32_t *ids = (uint32_t *)malloc((n ? n : 1) * sizeof(uint32_t));
    if (!ids) FAIL("out of host memory");
    for (size_t i = 0; i < n; i++) ids[i] = (uint32_t)i;
    g_sort_scores = score;
    qsort(ids, n, sizeof(uint32_t), by_score_then_id);
    for (uint32_t i = 0; i < k; i++) out[i] = i < n ? (int32_t)ids[i] : -1;
    free(ids);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Values in sorted `v` (n) that are >= x / > x. */
static size_t count_ge(const double *v, size_t n, double x) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return n - lo;
}
static size_t count_gt(const double *v, size_t n, double x) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v[mid] <= x) lo = mid + 1;
        else hi = mid;
    }
    return n - lo;
}

static void print_ids(const char *label, const int32_t *v, uint32_t k) {
    fprintf(stderr, "  %s:", label);
    for (uint32_t i = 0; i < k && i < 64; i++) fprintf(stderr, " %d", v[i]);
    if (k > 64) fprintf(stderr, " ... (%u)", k);
    fprintf(stderr, "\n");
}

/* `got` (k entries) is a well-formed top-k of n chunks: min(k, n) distinct
 * ids in [0, n), then -1. */
static void check_topk_shape_at(int line, const char *what, const int32_t *got, size_t n, uint32_t k) {
    uint32_t m = (size_t)k < n ? k : (uint32_t)n;
    uint8_t *seen = (uint8_t *)calloc(n ? n : 1, 1);
    if (!seen) FAIL("out of host memory");
    for (uint32_t i = 0; i < k; i++) {
        if (i >= m) {
            if (got[i] != -1) FAIL_AT(line, "%s: entry %u is %d, expected -1 padding (%zu chunks, k = %u)", what, i, got[i], n, k);
            continue;
        }
        if (got[i] < 0 || (size_t)got[i] >= n) FAIL_AT(line, "%s: entry %u is %d: not a chunk id of %zu", what, i, got[i], n);
        if (seen[got[i]]) FAIL_AT(line, "%s: chunk %d appears twice", what, got[i]);
        seen[got[i]] = 1;
    }
    free(seen);
}

/* Checks `got` against reference scores. On the CPU backend (`exact`) it
 * must be the reference top-k itself. Otherwise, with each score known only
 * within +-err: a chunk that is certainly among the k best must be there,
 * one that certainly is not must be absent, and the order may not put a
 * certainly lower score first. Returns the number of chunks whose place the
 * error bound leaves open. */
static size_t check_topk_at(int line, const char *what, const int32_t *got, const double *score, const double *err,
                            size_t n, uint32_t k, bool exact) {
    check_topk_shape_at(line, what, got, n, k);
    int32_t *want = (int32_t *)malloc(k * sizeof(int32_t));
    if (!want) FAIL("out of host memory");
    ref_topk(score, n, k, want);
    if (exact) {
        for (uint32_t i = 0; i < k; i++) {
            if (got[i] != want[i]) {
                print_ids("got     ", got, k);
                print_ids("expected", want, k);
                FAIL_AT(line, "%s: entry %u is chunk %d (score %.17g), the reference says chunk %d (score %.17g)", what, i,
                        got[i], got[i] >= 0 && (size_t)got[i] < n ? score[got[i]] : 0.0, want[i],
                        want[i] >= 0 ? score[want[i]] : 0.0);
            }
        }
        free(want);
        return 0;
    }
    double *lo = (double *)malloc(n * sizeof(double)), *hi = (double *)malloc(n * sizeof(double));
    uint8_t *in = (uint8_t *)calloc(n, 1);
    if (!lo || !hi || !in) FAIL("out of host memory");
    for (size_t c = 0; c < n; c++) {
        lo[c] = score[c] - err[c];
        hi[c] = score[c] + err[c];
    }
    for (uint32_t i = 0; i < k && got[i] >= 0; i++) in[got[i]] = 1;
    qsort(lo, n, sizeof(double), cmp_double);
    qsort(hi, n, sizeof(double), cmp_double);
    size_t open = 0;
    for (size_t c = 0; c < n; c++) {
        double l = score[c] - err[c], h = score[c] + err[c];
        size_t maybe_above = count_ge(hi, n, l) - 1; /* others that might score >= this one */
        size_t surely_above = count_gt(lo, n, h);    /* others that certainly score higher */
        bool sure_in = maybe_above < k, sure_out = surely_above >= k;
        if (sure_in && !in[c]) {
            print_ids("got     ", got, k);
            print_ids("expected", want, k);
            FAIL_AT(line, "%s: chunk %zu (score %.9g +- %.3g) is certainly in the top-%u but missing", what, c, score[c], err[c], k);
        }
        if (sure_out && in[c]) {
            print_ids("got     ", got, k);
            print_ids("expected", want, k);
            FAIL_AT(line, "%s: chunk %zu (score %.9g +- %.3g) is certainly not in the top-%u but present", what, c, score[c], err[c], k);
        }
        open += !sure_in && !sure_out;
    }
    for (uint32_t i = 1; i < k && got[i] >= 0; i++) {
        int32_t a = got[i - 1], b = got[i];
        if (score[a] + err[a] < score[b] - err[b])
            FAIL_AT(line, "%s: entries %u, %u: chunk %d (%.9g) before chunk %d (%.9g), certainly out of order", what, i - 1,
                    i, a, score[a], b, score[b]);
    }
    free(lo);
    free(hi);
    free(in);
    free(want);
    return open;
}
#define check_topk(what, got, score, err, n, k) check_topk_at(__LINE__, what, got, score, err, n, k, !dm_is_cuda())

static void check_same_ids_at(int line, const char *what, const int32_t *a, const int32_t *b, uint32_t k) {
    if (memcmp(a, b, k * sizeof(int32_t)) != 0) {
        print_ids("first ", a, k);
        print_ids("second", b, k);
        FAIL_AT(line, "%s: the two top-k lists differ", what);
    }
}
#define check_same_ids(what, a, b, k) check_same_ids_at(__LINE__, what, a, b, k)

static void check_same_set_at(int line, const char *what, const int32_t *a, const int32_t *b, uint32_t k) {
    for (uint32_t i = 0; i < k; i++) {
        bool found = false;
        for (uint32_t j = 0; j < k && !found; j++) found = a[i] == b[j];
        if (!found) {
            print_ids("first ", a, k);
            print_ids("second", b, k);
            FAIL_AT(line, "%s: %d is in the first top-k only", what, a[i]);
        }
    }
}
#define check_same_set(what, a, b, k) check_same_set_at(__LINE__, what, a, b, k)

static void check_all_at(int line, const char *what, const int32_t *v, uint32_t k, int32_t value) {
    for (uint32_t i = 0; i < k; i++)
        if (v[i] != value) FAIL_AT(line, "%s: entry %u is %d, expected %d", what, i, v[i], value);
}
#define check_all(what, v, k, value) check_all_at(__LINE__, what, v, k, value)

/* ---- calls with "device" copies of host data ---- */

static void fill_i32(int32_t *v, size_t n, int32_t x) {
    for (size_t i = 0; i < n; i++) v[i] = x;
}

/* fm_score_topk with exact-size device copies of `hidden` (hidden_n floats),
 * the key rows and scales of `keys` and `out` (k entries: uploaded before the
 * call, read back after it, whatever its outcome). `n_chunks` may differ
 * from keys->n (limit tests). The call's stream is `stream`. */
static enum KvswapStatus fm_topk_on(void *stream, const FmScorer *s, const float *hidden, size_t hidden_n, const HKeys *keys,
                                    size_t n_chunks, uint32_t k, int32_t *out) {
    void *dh = dev_copy(hidden, hidden_n * sizeof(float));
    void *dk = dev_copy(keys->data, hkeys_bytes(keys));
    void *ds = keys->scales ? dev_copy(keys->scales, keys->n * sizeof(float)) : NULL;
    int32_t *dout = (int32_t *)dev_copy(out, (size_t)k * sizeof(int32_t));
    FmKeys fk = fmkeys_of(dk, (const float *)ds, keys);
    before_call(stream);
    enum KvswapStatus st = fm_score_topk(s, (const float *)dh, &fk, n_chunks, k, dout, stream);
    after_call(stream);
    dm_sync();
    dm_download(out, dout, (size_t)k * sizeof(int32_t));
    dm_free(dh);
    dm_free(dk);
    dm_free(ds);
    dm_free(dout);
    return st;
}
#define fm_topk(s, hidden, hidden_n, keys, n, k, out) fm_topk_on(dm_stream(), s, hidden, hidden_n, keys, n, k, out)

/* fm_score_topk that must succeed; `out` gets the result. */
static void fm_topk_ok_at(int line, const FmScorer *s, const float *hidden, size_t hidden_n, const HKeys *keys, uint32_t k,
                          int32_t *out) {
    fill_i32(out, k, FM_SENTINEL);
    CHECK_OK_AT(line, fm_topk(s, hidden, hidden_n, keys, keys->n, k, out));
}
#define fm_topk_ok(s, hidden, hidden_n, keys, k, out) fm_topk_ok_at(__LINE__, s, hidden, hidden_n, keys, k, out)

/* A batch of `n` sequences: device copies of each hidden state, keys and
 * output (uploaded, then read back whatever the outcome). */
typedef struct HSeq {
    const float *hidden;
    size_t hidden_n;
    const HKeys *keys;
    size_t n_chunks;
    int32_t *out; /* FM_BATCH_OUT entries, host */
} HSeq;
#define FM_BATCH_OUT 16u

static enum KvswapStatus fm_batch(const FmScorer *s, const HSeq *hs, size_t n, size_t n_seqs_arg, uint32_t k, bool null_out1) {
    FmSeq seqs[4];
    void *bufs[4][4];
    CHECK(n <= 4);
    memset(seqs, 0, sizeof seqs);
    for (size_t i = 0; i < n; i++) {
        bufs[i][0] = dev_copy(hs[i].hidden, hs[i].hidden_n * sizeof(float));
        bufs[i][1] = dev_copy(hs[i].keys->data, hkeys_bytes(hs[i].keys));
        bufs[i][2] = hs[i].keys->scales ? dev_copy(hs[i].keys->scales, hs[i].keys->n * sizeof(float)) : NULL;
        bufs[i][3] = dm_alloc((size_t)k * sizeof(int32_t)); /* k may exceed FM_BATCH_OUT (refused calls) */
        dm_upload(bufs[i][3], hs[i].out, (size_t)(k < FM_BATCH_OUT ? k : FM_BATCH_OUT) * sizeof(int32_t));
        seqs[i].hidden = (const float *)bufs[i][0];
        seqs[i].keys = fmkeys_of(bufs[i][1], (const float *)bufs[i][2], hs[i].keys);
        seqs[i].n_chunks = hs[i].n_chunks;
        seqs[i].out_indices = (null_out1 && i == 1) ? NULL : (int32_t *)bufs[i][3];
    }
    enum KvswapStatus st = fm_score_topk_batch(s, n_seqs_arg, seqs, k, dm_stream());
    dm_sync();
    for (size_t i = 0; i < n; i++) {
        dm_download(hs[i].out, bufs[i][3], (size_t)(k < FM_BATCH_OUT ? k : FM_BATCH_OUT) * sizeof(int32_t));
        for (int b = 0; b < 4; b++) dm_free(bufs[i][b]);
    }
    return st;
}

/* fm_bounds_topk on `device` (-1: host memory; else device copies). `out`
 * (k entries) is uploaded first and read back after the call. */
static enum KvswapStatus bounds_topk_on(int32_t device, const float *query, const float *lo, const float *hi, uint32_t dim,
                                        size_t n, uint32_t k, int32_t *out) {
    if (device < 0) return fm_bounds_topk(device, query, lo, hi, dim, n, k, out, NULL);
    void *dq = dev_copy(query, dim * sizeof(float));
    void *dlo = dev_copy(lo, n * dim * sizeof(float));
    void *dhi = dev_copy(hi, n * dim * sizeof(float));
    int32_t *dout = (int32_t *)dev_copy(out, (size_t)k * sizeof(int32_t));
    enum KvswapStatus st = fm_bounds_topk(device, (const float *)dq, (const float *)dlo, (const float *)dhi, dim, n, k, dout,
                                          dm_stream());
    dm_sync();
    dm_download(out, dout, (size_t)k * sizeof(int32_t));
    dm_free(dq);
    dm_free(dlo);
    dm_free(dhi);
    dm_free(dout);
    return st;
}

/* ---- the groups ---- */

static FmScorer *fm_load_ok_at(int line, const char *path) {
    FmScorer *s = NULL;
    CHECK_OK_AT(line, fm_scorer_load(path, dm_is_cuda() ? 0 : -1, &s));
    CHECK_AT(line, s != NULL);
    return s;
}
#define fm_load_ok(path) fm_load_ok_at(__LINE__, path)

static FmScorer *const FM_OUT_SENTINEL = (FmScorer *)(uintptr_t)0x5EED5EEDu;

static void fm_load_refused_at(int line, const char *path, int32_t device, enum KvswapStatus want, const char *substr) {
    FmScorer *s = FM_OUT_SENTINEL;
    CHECK_ERR_AT(line, fm_scorer_load(path, device, &s), want, substr);
    CHECK_MSG_AT(line, "fm_scorer_load");
    if (s != FM_OUT_SENTINEL) FAIL_AT(line, "fm_scorer_load wrote its out-parameter on failure");
}
#define fm_load_refused(path, device, want, substr) fm_load_refused_at(__LINE__, path, device, want, substr)

/* A file of `len` bytes in $TMPDIR (or /tmp); `path` gets its name. */
static void write_temp_file(char *path, size_t cap, const void *bytes, size_t len) {
    const char *dir = getenv("TMPDIR");
    snprintf(path, cap, "%s/kvswap-test-fm-XXXXXX", dir && dir[0] ? dir : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) FAIL("mkstemp(%s) failed", path);
    FILE *f = fdopen(fd, "wb");
    if (!f) FAIL("fdopen failed");
    if (len && fwrite(bytes, 1, len, f) != len) FAIL("cannot write %s", path);
    if (fclose(f) != 0) FAIL("cannot write %s", path);
}

/* A safetensors file with only metadata: `json` is its header. */
static void write_temp_safetensors(char *path, size_t cap, const char *json) {
    size_t n = strlen(json);
    uint8_t *buf = (uint8_t *)malloc(8 + n);
    if (!buf) FAIL("out of host memory");
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(buf + 8, json, n);
    write_temp_file(path, cap, buf, 8 + n);
    free(buf);
}

static void test_fm_load_errors(const char *ckpt) {
    /* A missing file: IO, naming the path. */
    const char *missing = "/nonexistent-kvswap-test-dir/no-such-checkpoint.safetensors";
    fm_load_refused(missing, -1, KVSWAP_STATUS_IO, missing);
    fm_load_refused(missing, dm_is_cuda() ? 0 : -1, KVSWAP_STATUS_IO, missing);
    /* A directory: IO. */
    fm_load_refused("/", -1, KVSWAP_STATUS_IO, "cannot read checkpoint");

    /* Not a checkpoint: BAD_CHECKPOINT, naming the path. */
    char path[4096];
    const char garbage[] = "this is not a safetensors file\n";
    write_temp_file(path, sizeof path, garbage, sizeof garbage - 1);
    fm_load_refused(path, -1, KVSWAP_STATUS_BAD_CHECKPOINT, path);
    CHECK_MSG("safetensors");
    CHECK(remove(path) == 0);
    write_temp_file(path, sizeof path, "", 0);
    fm_load_refused(path, -1, KVSWAP_STATUS_BAD_CHECKPOINT, path);
    CHECK(remove(path) == 0);
    /* A safetensors file of another format. */
    write_temp_safetensors(path, sizeof path, "{\"__metadata__\":{\"format\":\"not-flashmemory\"}}");
    fm_load_refused(path, -1, KVSWAP_STATUS_BAD_CHECKPOINT, "format");
    CHECK_MSG("flashmemory-v1");
    CHECK(remove(path) == 0);
    /* The real checkpoint cut in half. */
    size_t len = 0;
    uint8_t *whole = read_whole_file(ckpt, &len);
    write_temp_file(path, sizeof path, whole, len / 2);
    free(whole);
    fm_load_refused(path, dm_is_cuda() ? 0 : -1, KVSWAP_STATUS_BAD_CHECKPOINT, path);
    CHECK(remove(path) == 0);

    /* Arguments. */
    fm_load_refused(NULL, -1, KVSWAP_STATUS_NULL_POINTER, "path");
    CHECK_ERR(fm_scorer_load(ckpt, -1, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    CHECK_MSG("fm_scorer_load");
    fm_load_refused("", -1, KVSWAP_STATUS_INVALID_ARGUMENT, "path is empty");
    fm_load_refused(ckpt, -5, KVSWAP_STATUS_INVALID_ARGUMENT, "device = -5");
    fm_load_refused(ckpt, -2, KVSWAP_STATUS_INVALID_ARGUMENT, "device = -2");
    if (!dm_driver_present()) {
        /* A CUDA ordinal where there is no driver. */
        fm_load_refused(ckpt, 0, KVSWAP_STATUS_NO_DEVICE, "CUDA");
    }
    group_done("fm_scorer_load: missing file / directory (IO, naming the path), garbage, empty, foreign format and "
               "truncated files (BAD_CHECKPOINT), NULL path/out, empty path, device -5; out untouched");
}

static void check_info_at(int line, const FmScorer *s, uint32_t ensemble) {
    FmScorerInfo info;
    memset(&info, 0xA5, sizeof info);
    CHECK_OK_AT(line, fm_scorer_info(s, &info));
    if (info.n_scorers != FM_WANT_SCORERS || info.hidden != FM_WANT_HIDDEN || info.n_heads != FM_WANT_HEADS ||
        info.head_dim != FM_WANT_HEAD_DIM)
        FAIL_AT(line, "fm_scorer_info: %u scorers, hidden %u, %u heads x %u: expected the checkpoint of `" FM_INIT_CMD "`",
                info.n_scorers, info.hidden, info.n_heads, info.head_dim);
    CHECK_AT(line, info.ensemble == ensemble);
    CHECK_AT(line, info.device == (dm_is_cuda() ? 0 : -1));
    CHECK_AT(line, info.query == KVSWAP_FM_QUERY_AUTO || info.query == KVSWAP_FM_QUERY_WIDE);
    CHECK_AT(line, info.reserved == 0);
    /* bf16 weights: 2 bytes per element of every wq and ww. */
    uint64_t elems = (uint64_t)info.n_scorers * info.n_heads * (info.head_dim + 1) * info.hidden;
    CHECK_AT(line, info.weight_bytes > 0);
    if (info.weight_bytes != 2 * elems)
        FAIL_AT(line, "fm_scorer_info: weight_bytes = %llu, expected %llu (bf16)", (unsigned long long)info.weight_bytes,
                (unsigned long long)(2 * elems));
}
#define check_info(s, ensemble) check_info_at(__LINE__, s, ensemble)

static float *random_hidden(size_t n) {
    float *h = (float *)malloc(n * sizeof(float));
    if (!h) FAIL("out of host memory");
    for (size_t i = 0; i < n; i++) h[i] = fm_frand();
    return h;
}

/* Top-k of `keys` against the reference (exact on CPU, within bounds on CUDA). */
static void fm_topk_vs_ref_at(int line, const char *what, const FmScorer *s, const float *hidden, size_t hn,
                              const HKeys *keys, uint32_t k, uint32_t ensemble, int32_t *out) {
    double *sc = (double *)malloc(keys->n * sizeof(double)), *er = (double *)malloc(keys->n * sizeof(double));
    if (!sc || !er) FAIL("out of host memory");
    fm_topk_ok_at(line, s, hidden, hn, keys, k, out);
    fm_reference(hidden, keys, ensemble, sc, er);
    check_topk_at(line, what, out, sc, er, keys->n, k, !dm_is_cuda());
    free(sc);
    free(er);
}
#define fm_topk_vs_ref(what, s, hidden, hn, keys, k, ensemble, out) \
    fm_topk_vs_ref_at(__LINE__, what, s, hidden, hn, keys, k, ensemble, out)

/* Values the header says are refused on every backend: a NaN or Inf fp8
 * scale ("A NaN or Inf in hidden, the keys or the scales is
 * KVSWAP_STATUS_INVALID_ARGUMENT") and, for fm_bounds_topk on CUDA, NaN/Inf
 * bounds and a minimum above its maximum ("NaN/Inf values, or a minimum
 * above its maximum, are KVSWAP_STATUS_INVALID_ARGUMENT"). Every case is
 * tried and every broken one printed before the group fails. */
static void test_fm_value_contract(const FmScorer *s, const float *hidden, size_t hn, int32_t after_bad) {
    int broken = 0;
    int32_t out[16];
    FmScorerInfo info;
    CHECK_OK(fm_scorer_info(s, &info));
    const uint32_t bad_bits[3] = {0x7FC00000u, 0xFF800000u, 0x7F800000u};
    const char *names[3] = {"NaN", "-inf", "+inf"};
    HKeys k8s = hkeys_random(FM_KEYS_FP8_E4M3, 50, info.head_dim, 0, false);
    for (int b = 0; b < 3; b++) {
        k8s.scales[40] = f32_of_bits(bad_bits[b]);
        fill_i32(out, 16, FM_SENTINEL);
        enum KvswapStatus st = fm_topk(s, hidden, hn, &k8s, 50, 16, out);
        if (st == KVSWAP_STATUS_INVALID_ARGUMENT) {
            CHECK_MSG("chunk 40");
            CHECK_MSG("fm_score_topk");
            check_all("non-finite fp8 scale", out, 16, after_bad);
        } else {
            print_ids("out", out, 16);
            fprintf(stderr, "%s:%d: BROKEN: fm_score_topk with a %s fp8 scale (chunk 40) returned %s, expected "
                            "KVSWAP_STATUS_INVALID_ARGUMENT (every backend checks each chunk's scale for finiteness)\n",
                    __FILE__, __LINE__, names[b], sname(st));
            broken++;
        }
        CHECK_OK(fm_scorer_sync(s, dm_stream()));
    }
    hkeys_free(&k8s);
    /* Bounds on this backend's device: min > max, NaN and +inf bounds. */
    const int32_t dev = dm_is_cuda() ? 0 : -1;
    const uint32_t dim = 64;
    const size_t nc = 10;
    float *q = random_hidden(dim), *lo = random_hidden(nc * dim), *hi = random_hidden(nc * dim);
    for (size_t i = 0; i < nc * dim; i++) {
        if (lo[i] > hi[i]) {
            float t = lo[i];
            lo[i] = hi[i];
            hi[i] = t;
        }
    }
    struct {
        const char *what, *substr;
        float *arr;
        float value;
    } bcases[3] = {
        {"bounds_min[3][5] above bounds_max[3][5]", "chunk 3", lo, 0},
        {"a NaN in bounds_max[3][5]", "chunk 3", hi, f32_of_bits(0x7FC00000u)},
        {"+inf in bounds_min[3][5]", "chunk 3", lo, f32_of_bits(0x7F800000u)},
    };
    bcases[0].value = hi[3 * dim + 5] + 1.0f;
    for (int c = 0; c < 3; c++) {
        float keep = bcases[c].arr[3 * dim + 5];
        bcases[c].arr[3 * dim + 5] = bcases[c].value;
        fill_i32(out, 8, FM_SENTINEL);
        enum KvswapStatus st = bounds_topk_on(dev, q, lo, hi, dim, nc, 8, out);
        bcases[c].arr[3 * dim + 5] = keep;
        if (st == KVSWAP_STATUS_INVALID_ARGUMENT) {
            CHECK_MSG("fm_bounds_topk");
            CHECK_MSG(bcases[c].substr);
        } else {
            print_ids("out", out, 8);
            fprintf(stderr, "%s:%d: BROKEN: fm_bounds_topk(device %d) with %s returned %s, expected "
                            "KVSWAP_STATUS_INVALID_ARGUMENT\n",
                    __FILE__, __LINE__, dev, bcases[c].what, sname(st));
            broken++;
        }
    }
    free(q);
    free(lo);
    free(hi);
    if (broken) FAIL("%d value check(s) above: the library does not refuse what include/kvswap.h says it refuses", broken);
    group_done("fm_score_topk: NaN / -inf / +inf fp8 scales, fm_bounds_topk: min > max, NaN and Inf bounds on this "
               "backend -> INVALID_ARGUMENT naming the chunk");
}

static void test_fm_scoring(const char *ckpt) {
    FmScorer *s = fm_load_ok(ckpt);
    FmScorerInfo info;
    CHECK_OK(fm_scorer_info(s, &info));
    check_info(s, KVSWAP_ENSEMBLE_MAX);
    fmref_load(ckpt, &info);
    const uint32_t hd = info.head_dim;
    const size_t hn = (size_t)info.n_scorers * info.hidden;

    /* info / set_ensemble / sync arguments. */
    CHECK_ERR(fm_scorer_info(NULL, &info), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_MSG("fm_scorer_info");
    CHECK_ERR(fm_scorer_info(s, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MEAN));
    check_info(s, KVSWAP_ENSEMBLE_MEAN);
    CHECK_ERR(fm_scorer_set_ensemble(s, 2), KVSWAP_STATUS_INVALID_ARGUMENT, "ensemble = 2");
    CHECK_MSG("fm_scorer_set_ensemble");
    check_info(s, KVSWAP_ENSEMBLE_MEAN); /* unchanged by the refusal */
    CHECK_ERR(fm_scorer_set_ensemble(NULL, KVSWAP_ENSEMBLE_MAX), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MAX));
    check_info(s, KVSWAP_ENSEMBLE_MAX);
    CHECK_OK(fm_scorer_sync(s, dm_stream()));
    CHECK_ERR(fm_scorer_sync(NULL, dm_stream()), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_MSG("fm_scorer_sync");
    group_done("fm_scorer_info (2 scorers, hidden 64, 16 heads x 64, max, bf16 weight_bytes), set_ensemble max/mean "
               "and a bad value (refused, unchanged), fm_scorer_sync, NULL handles");

    /* The query: auto (the fp8 query for fp8 keys) by default, wide on
     * request, anything else refused with the setting unchanged. This
     * file's reference (fmref) scores with the wide query, so the rest of
     * this test sets it; the fp8 query is checked against the Rust
     * reference (tests/scorer.rs, tests/scorer_gpu.rs). */
    CHECK_OK(fm_scorer_info(s, &info));
    CHECK(info.query == KVSWAP_FM_QUERY_AUTO);
    CHECK_ERR(fm_scorer_set_query(s, 2), KVSWAP_STATUS_INVALID_ARGUMENT, "query = 2");
    CHECK_MSG("fm_scorer_set_query");
    CHECK_ERR(fm_scorer_set_query(NULL, KVSWAP_FM_QUERY_WIDE), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_OK(fm_scorer_info(s, &info));
    CHECK(info.query == KVSWAP_FM_QUERY_AUTO);
    CHECK_OK(fm_scorer_set_query(s, KVSWAP_FM_QUERY_WIDE));
    CHECK_OK(fm_scorer_info(s, &info));
    CHECK(info.query == KVSWAP_FM_QUERY_WIDE);
    group_done("fm_scorer_set_query: auto by default, wide on request, a bad value and NULL refused (unchanged)");

    /* fm_scorer_set_sync's arguments: 0 or 1; anything else and NULL
     * refused (what it does: with the NaN tests below). */
    CHECK_ERR(fm_scorer_set_sync(s, 2), KVSWAP_STATUS_INVALID_ARGUMENT, "sync = 2: expected 0 or 1");
    CHECK_MSG("fm_scorer_set_sync");
    CHECK_ERR(fm_scorer_set_sync(NULL, 0), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_OK(fm_scorer_set_sync(s, 0));
    CHECK_OK(fm_scorer_set_sync(s, 1));
    group_done("fm_scorer_set_sync: 0 and 1 accepted, a bad value and NULL refused");

    /* fm_scorer_reserve: the limits of a batch, the stream's checks on CUDA;
     * a valid reservation is OK (twice: the second changes nothing). */
    CHECK_ERR(fm_scorer_reserve(NULL, 1, 100, dm_stream()), KVSWAP_STATUS_NULL_POINTER, "scorer");
    CHECK_ERR(fm_scorer_reserve(s, 0, 100, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "n_seqs is 0");
    CHECK_MSG("fm_scorer_reserve");
    CHECK_ERR(fm_scorer_reserve(s, 1, 0, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "n_chunks is 0");
    CHECK_ERR(fm_scorer_reserve(s, FM_MAX_SEQS + 1, 100, dm_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_SEQS");
    CHECK_ERR(fm_scorer_reserve(s, 1, FM_MAX_CHUNKS + 1, dm_stream()), KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_CHUNKS");
    if (dm_is_cuda()) CHECK_ERR(fm_scorer_reserve(s, 1, 100, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
    CHECK_OK(fm_scorer_reserve(s, 3, 5000, dm_stream()));
    CHECK_OK(fm_scorer_reserve(s, 1, 100, dm_stream()));
    group_done("fm_scorer_reserve: NULL, 0 and over-limit sizes (and on CUDA the NULL stream) refused; a reservation OK");

    /* KVSWAP_FM_QUERY, read by fm_scorer_load: a bad value is refused
     * naming it (out untouched), `wide` is the loaded scorer's default. */
    CHECK(setenv("KVSWAP_FM_QUERY", "bogus", 1) == 0);
    fm_load_refused(ckpt, dm_is_cuda() ? 0 : -1, KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_FM_QUERY=bogus");
    CHECK(setenv("KVSWAP_FM_QUERY", "Wide", 1) == 0);
    {
        FmScorer *w = fm_load_ok(ckpt);
        FmScorerInfo wi;
        CHECK_OK(fm_scorer_info(w, &wi));
        CHECK(wi.query == KVSWAP_FM_QUERY_WIDE);
        fm_scorer_free(w);
    }
    CHECK(unsetenv("KVSWAP_FM_QUERY") == 0);
    group_done("KVSWAP_FM_QUERY: a bad value refused by fm_scorer_load, `Wide` loads a wide-query scorer");

    /* KVSWAP_FM_ENSEMBLE (or the original engine's name), read by
     * fm_scorer_load: a bad value is refused naming it (out untouched), a
     * set value overrides the checkpoint's max, a blank one does not. */
    CHECK(setenv("KVSWAP_FM_ENSEMBLE", "median", 1) == 0);
    fm_load_refused(ckpt, dm_is_cuda() ? 0 : -1, KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_FM_ENSEMBLE");
    CHECK(setenv("KVSWAP_FM_ENSEMBLE", " ", 1) == 0);
    CHECK(setenv("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE", "Mean", 1) == 0);
    {
        FmScorer *m = fm_load_ok(ckpt);
        check_info(m, KVSWAP_ENSEMBLE_MEAN);
        fm_scorer_free(m);
    }
    CHECK(unsetenv("POCKETLLM_GGUF_FLASHMEMORY_ENSEMBLE") == 0);
    {
        FmScorer *m = fm_load_ok(ckpt);
        check_info(m, KVSWAP_ENSEMBLE_MAX);
        fm_scorer_free(m);
    }
    CHECK(unsetenv("KVSWAP_FM_ENSEMBLE") == 0);
    group_done("KVSWAP_FM_ENSEMBLE: a bad value refused by fm_scorer_load, the alias's `Mean` overrides the "
               "checkpoint's max, a blank value keeps it");

    /* KVSWAP_MEM_PROFILE (or its alias), read by fm_scorer_load: a bad
     * value is refused naming it (out untouched) on every backend. */
    CHECK(setenv("KVSWAP_MEM_PROFILE", "maybe", 1) == 0);
    fm_load_refused(ckpt, -1, KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_MEM_PROFILE");
    CHECK(unsetenv("KVSWAP_MEM_PROFILE") == 0);
    CHECK(setenv("POCKETLLM_GGUF_MEM_PROFILE", "maybe", 1) == 0);
    fm_load_refused(ckpt, dm_is_cuda() ? 0 : -1, KVSWAP_STATUS_INVALID_ARGUMENT, "POCKETLLM_GGUF_MEM_PROFILE");
    CHECK(unsetenv("POCKETLLM_GGUF_MEM_PROFILE") == 0);
    group_done("KVSWAP_MEM_PROFILE: a bad value (or the alias's) refused by fm_scorer_load");

    /* KVSWAP_SYNC, read by fm_scorer_load: a bad value is refused on the
     * CPU too (where it changes nothing), so it cannot pass CPU tests only. */
    {
        const char *old_sync = getenv("KVSWAP_SYNC");
        char *saved = old_sync ? strdup(old_sync) : NULL;
        CHECK(setenv("KVSWAP_SYNC", "7", 1) == 0);
        fm_load_refused(ckpt, -1, KVSWAP_STATUS_INVALID_ARGUMENT, "KVSWAP_SYNC");
        if (saved) {
            CHECK(setenv("KVSWAP_SYNC", saved, 1) == 0);
            free(saved);
        } else {
            CHECK(unsetenv("KVSWAP_SYNC") == 0);
        }
    }
    group_done("KVSWAP_SYNC: a bad value refused by fm_scorer_load on the CPU too");

    /* Random inputs against the reference, every key type, both ensembles. */
    int32_t out[FM_MAX_TOPK], out2[FM_MAX_TOPK];
    float *hidden = random_hidden(hn);
    const size_t n = 160;
    HKeys kb = hkeys_random(FM_KEYS_BF16, n, hd, 0, false);
    HKeys kf = hkeys_random(FM_KEYS_F32, n, hd, 0, false);
    HKeys k8 = hkeys_random(FM_KEYS_FP8_E4M3, n, hd, 0, false);
    fm_topk_vs_ref("bf16 keys, k 16", s, hidden, hn, &kb, 16, KVSWAP_ENSEMBLE_MAX, out);
    fm_topk_vs_ref("bf16 keys, k 1", s, hidden, hn, &kb, 1, KVSWAP_ENSEMBLE_MAX, out);
    fm_topk_vs_ref("bf16 keys, k = n", s, hidden, hn, &kb, (uint32_t)n, KVSWAP_ENSEMBLE_MAX, out);
    fm_topk_vs_ref("f32 keys", s, hidden, hn, &kf, 32, KVSWAP_ENSEMBLE_MAX, out);
    fm_topk_vs_ref("fp8 keys", s, hidden, hn, &k8, 32, KVSWAP_ENSEMBLE_MAX, out);
    CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MEAN));
    fm_topk_vs_ref("bf16 keys, mean", s, hidden, hn, &kb, 16, KVSWAP_ENSEMBLE_MEAN, out);
    fm_topk_vs_ref("fp8 keys, mean", s, hidden, hn, &k8, 16, KVSWAP_ENSEMBLE_MEAN, out);
    CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MAX));
    {
        /* Many chunks (several selection blocks on CUDA) and the largest k. */
        const size_t big = dm_is_cuda() ? 70000 : 2100;
        HKeys kbig = hkeys_random(FM_KEYS_BF16, big, hd, 0, false);
        fm_topk_vs_ref("bf16 keys, many chunks, k 2048", s, hidden, hn, &kbig, FM_MAX_TOPK, KVSWAP_ENSEMBLE_MAX, out);
        hkeys_free(&kbig);
    }
    /* Fewer chunks than k: -1 padding. */
    HKeys kfew = hkeys_random(FM_KEYS_BF16, 5, hd, 0, false);
    fm_topk_vs_ref("5 chunks, k 9", s, hidden, hn, &kfew, 9, KVSWAP_ENSEMBLE_MAX, out);
    for (int i = 5; i < 9; i++) CHECK_EQ(out[i], -1);
    group_done(dm_is_cuda() ? "fm_score_topk: bf16 / f32 / fp8 keys, max and mean, k 1..2048, 5..70000 chunks, -1 "
                              "padding: within the error bound of the double-precision reference"
                            : "fm_score_topk: bf16 / f32 / fp8 keys, max and mean, k 1..2048, 5..2100 chunks, -1 "
                              "padding: exactly the double-precision reference (tie order included)");

    /* Relations that need no weights. */
    /* (1) Ties: every key the same (random, then zero): ids 0..k-1. */
    HKeys same = hkeys_new(FM_KEYS_BF16, 37, hd, 0);
    for (uint32_t d = 0; d < hd; d++) {
        float v = fm_frand();
        for (size_t r = 0; r < same.n; r++) hkeys_set(&same, r, d, v);
    }
    fm_topk_ok(s, hidden, hn, &same, 10, out);
    for (int32_t i = 0; i < 10; i++) CHECK_EQ(out[i], i);
    /* (2) k > n_chunks: 0..n-1, then -1. */
    fm_topk_ok(s, hidden, hn, &same, 50, out);
    for (int32_t i = 0; i < 50; i++) CHECK_EQ(out[i], i < 37 ? i : -1);
    HKeys zero = hkeys_new(FM_KEYS_F32, 20, hd, 0);
    for (size_t r = 0; r < zero.n; r++)
        for (uint32_t d = 0; d < hd; d++) hkeys_set(&zero, r, d, 0.0f);
    fm_topk_ok(s, hidden, hn, &zero, 7, out);
    for (int32_t i = 0; i < 7; i++) CHECK_EQ(out[i], i);
    /* (3) f32 keys holding the bf16 values: the same top-k. */
    HKeys kb_as_f32 = hkeys_convert(&kb, FM_KEYS_F32, 0);
    fm_topk_ok(s, hidden, hn, &kb, 40, out);
    fm_topk_ok(s, hidden, hn, &kb_as_f32, 40, out2);
    check_same_ids("bf16 keys vs f32 keys holding them", out, out2, 40);
    /* ... fp8 keys with power-of-two scales vs f32 keys holding fp8 x scale. */
    HKeys k8p = hkeys_random(FM_KEYS_FP8_E4M3, n, hd, 0, true);
    HKeys k8p_as_f32 = hkeys_convert(&k8p, FM_KEYS_F32, 0);
    fm_topk_ok(s, hidden, hn, &k8p, 40, out);
    fm_topk_ok(s, hidden, hn, &k8p_as_f32, 40, out2);
    check_same_ids("fp8 keys (power-of-two scales) vs f32 keys holding fp8 x scale", out, out2, 40);
    /* ... and strided rows (padding bytes are NaN: never read). */
    HKeys kb_strided = hkeys_convert(&kb, FM_KEYS_BF16, (size_t)hd * 2 + 48);
    HKeys kf_strided = hkeys_convert(&kf, FM_KEYS_F32, (size_t)hd * 4 + 16);
    fm_topk_ok(s, hidden, hn, &kb, 40, out);
    fm_topk_ok(s, hidden, hn, &kb_strided, 40, out2);
    check_same_ids("dense vs strided bf16 keys", out, out2, 40);
    fm_topk_ok(s, hidden, hn, &kf, 40, out);
    fm_topk_ok(s, hidden, hn, &kf_strided, 40, out2);
    check_same_ids("dense vs strided f32 keys", out, out2, 40);
    /* (4) Permuted key rows permute the ids. */
    uint32_t *perm = (uint32_t *)malloc(n * sizeof(uint32_t));
    CHECK(perm != NULL);
    for (uint32_t i = 0; i < n; i++) perm[i] = i;
    for (uint32_t i = (uint32_t)n - 1; i > 0; i--) {
        uint32_t j = fm_rand_u32() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    HKeys kb_perm = hkeys_permute(&kb, perm);
    fm_topk_ok(s, hidden, hn, &kb, 24, out);
    fm_topk_ok(s, hidden, hn, &kb_perm, 24, out2);
    for (int i = 0; i < 24; i++) out2[i] = (int32_t)perm[out2[i]];
    if (dm_is_cuda()) check_same_set("permuted key rows (ids mapped back)", out, out2, 24);
    else check_same_ids("permuted key rows (ids mapped back)", out, out2, 24);
    /* (5) hidden x 2 scales every score by 4: the same top-k. */
    float *hidden2 = (float *)malloc(hn * sizeof(float));
    CHECK(hidden2 != NULL);
    for (size_t i = 0; i < hn; i++) hidden2[i] = 2.0f * hidden[i];
    fm_topk_ok(s, hidden, hn, &kb, 64, out);
    fm_topk_ok(s, hidden2, hn, &kb, 64, out2);
    check_same_ids("hidden vs 2 x hidden", out, out2, 64);
    /* (6) Scorer 1's input zero: s_1 = 0, so the mean ranks by s_0 and the
     * max puts the chunks with s_0 > 0 first in the same order, then every
     * other chunk (score 0) by id. The relation tests something only when
     * some but not all chunks have s_0 > 0: with some seeds every one of 40
     * chunks scores above 0 (the head weights w = W_w h can all lean one
     * way), so scorer 0's input and the keys are drawn again until a draw
     * splits them (each draw checked); 64 draws that never split fail. */
    float *half_zero = (float *)malloc(hn * sizeof(float));
    CHECK(half_zero != NULL);
    for (size_t i = 0; i < hn; i++) half_zero[i] = i < info.hidden ? hidden[i] : 0.0f;
    const uint32_t nz = 40;
    uint32_t m = 0, p = 0, draws = 0;
    double zscore[40], zerr[40];
    for (; draws < 64 && (p == 0 || p >= nz); draws++) {
        if (draws > 0)
            for (size_t i = 0; i < info.hidden; i++) half_zero[i] = fm_frand();
        HKeys kz = hkeys_random(FM_KEYS_BF16, nz, hd, 0, false);
        CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MEAN));
        fm_topk_ok(s, half_zero, hn, &kz, nz, out);
        CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MAX));
        fm_topk_ok(s, half_zero, hn, &kz, nz, out2);
        for (uint32_t i = 0; i < nz; i++) {
            CHECK(out[i] >= 0 && out[i] < (int32_t)nz);
            CHECK(out2[i] >= 0 && out2[i] < (int32_t)nz);
        }
        /* p: the chunks with s_0 > 0 beyond the error bound (max(s_0, 0) is
         * the max ensemble's score); the prefix m on which mean and max agree
         * holds at least them. */
        fm_reference(half_zero, &kz, KVSWAP_ENSEMBLE_MAX, zscore, zerr);
        p = 0;
        for (uint32_t c = 0; c < nz; c++) p += zscore[c] > zerr[c];
        m = 0;
        while (m < nz && out2[m] == out[m]) m++;
        if (m < p)
            FAIL("ensemble with scorer 1's input zero (draw %u): mean and max agree on %u entries, %u chunks have s_0 > 0", draws,
                 m, p);
        /* out2[m..) must be the ids outside out[0..m), ascending. */
        bool is_pos[64] = {false};
        for (uint32_t i = 0; i < m; i++) is_pos[out[i]] = true;
        for (uint32_t i = m, id = 0; i < nz; i++, id++) {
            while (id < nz && is_pos[id]) id++;
            if (out2[i] != (int32_t)id) {
                print_ids("mean", out, nz);
                print_ids("max ", out2, nz);
                FAIL("ensemble with scorer 1's input zero (draw %u): entry %u of max is %d, expected %u (after %u chunks "
                     "with s_0 > 0)",
                     draws, i, out2[i], id, m);
            }
        }
        hkeys_free(&kz);
    }
    if (p == 0 || p >= nz)
        FAIL("ensemble relation: in %u draws, %u of %u chunks scored above 0 in the last: the check tests nothing", draws,
             p, nz);
    group_done("fm_score_topk relations: equal keys -> 0..k-1; -1 padding; f32 keys holding bf16 (and fp8 x 2^e) "
               "values and strided rows give the same top-k; permuted rows permute the ids; 2 x hidden; the "
               "ensemble with one scorer's input zero (max vs mean)");

    /* The decode-step pipeline: fm_score_topk writes straight into the index
     * buffer of kvswap_swap_in_selected (out = indices + window_len, count =
     * k), which turns the selected ids into physical ids window_len + slot;
     * with fewer chunks than k the -1 padding stays -1. */
    {
        enum { WIN = 5, KK = 16, NN = 12, CB = 64 };
        HKeys kp = hkeys_random(FM_KEYS_BF16, NN, hd, 0, false);
        int32_t want[KK];
        fm_topk_ok(s, hidden, hn, &kp, KK, want); /* the ids, by the same scorer */
        KvswapConfig pcfg = test_config(1, KK, KK);
        KvswapLayerSpec pspec = layer_spec(NN + 20, CB); /* NN + 20 > KK: swap on */
        KvswapContext *pctx = create_ok(&pcfg, &pspec, 1);
        Layer PL;
        layer_init(&PL, pctx, 0, NN + 20, KK, CB);
        for (uint32_t id = 0; id < NN + 20; id++) store_one(&PL, id);
        int32_t hidx[WIN + KK];
        for (int i = 0; i < WIN + KK; i++) hidx[i] = i < WIN ? 1000 + i : FM_SENTINEL;
        int32_t *didx = (int32_t *)dev_copy(hidx, sizeof hidx);
        void *dh = dev_copy(hidden, hn * sizeof(float));
        void *dk = dev_copy(kp.data, hkeys_bytes(&kp));
        FmKeys fk = fmkeys_of(dk, NULL, &kp);
        CHECK_OK(fm_score_topk(s, (const float *)dh, &fk, NN, KK, didx + WIN, dm_stream()));
        CHECK_OK(kvswap_swap_in_selected(pctx, 0, didx, WIN, KK, dm_stream()));
        dm_sync();
        dm_download(hidx, didx, sizeof hidx);
        void *stg = NULL;
        size_t stride = 0;
        uint32_t rows = 0;
        CHECK_OK(kvswap_layer_staging(pctx, 0, &stg, &stride, &rows));
        for (int i = 0; i < WIN; i++) CHECK_EQ(hidx[i], 1000 + i);
        for (int i = 0; i < KK; i++) {
            const int32_t p = hidx[WIN + i];
            if (want[i] == -1) {
                CHECK_EQ(p, -1);
                continue;
            }
            CHECK(p >= WIN && p < WIN + (int32_t)rows);
            uint8_t row[CB];
            dm_download(row, (uint8_t *)stg + (size_t)(p - WIN) * stride, CB);
            if (!chunk_is(row, CB, 0, (uint32_t)want[i], PL.version[want[i]]))
                FAIL("pipeline entry %d: slot %d does not hold chunk %d", i, p - WIN, want[i]);
        }
        CHECK_EQ(want[NN], -1); /* the padding was exercised */
        kvswap_destroy(pctx);
        dm_free(dh);
        dm_free(dk);
        dm_free(didx);
        hkeys_free(&kp);
        group_done("scorer -> swap-in pipeline: fm_score_topk into indices + window_len, then kvswap_swap_in_selected: "
                   "window untouched, every selected chunk staged in the slot its physical id names, -1 padding kept");
    }

    /* NaN / Inf: INVALID_ARGUMENT. CPU: out untouched; CUDA (KVSWAP_SYNC=1):
     * out written as -1, and fm_scorer_sync has nothing left to report. */
    float *bad = (float *)malloc(hn * sizeof(float));
    CHECK(bad != NULL);
    memcpy(bad, hidden, hn * sizeof(float));
    bad[info.hidden + 5] = f32_of_bits(0x7FC00000u);
    const int32_t after_bad = dm_is_cuda() ? -1 : FM_SENTINEL;
    fill_i32(out, 16, FM_SENTINEL);
    CHECK_ERR(fm_topk(s, bad, hn, &kb, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
    CHECK_MSG("fm_score_topk");
    CHECK_MSG(dm_is_cuda() ? "scorer 1's input at position 5" : "scorer 1, position 5");
    check_all("NaN hidden", out, 16, after_bad);
    CHECK_OK(fm_scorer_sync(s, dm_stream()));
    bad[info.hidden + 5] = f32_of_bits(0xFF800000u); /* -inf */
    CHECK_ERR(fm_topk(s, bad, hn, &kb, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
    CHECK_OK(fm_scorer_sync(s, dm_stream()));
    /* The scorer is still good afterwards. */
    fm_topk_vs_ref("after NaN", s, hidden, hn, &kb, 16, KVSWAP_ENSEMBLE_MAX, out);
    HKeys kbad = hkeys_convert(&kf, FM_KEYS_F32, 0);
    float inf = f32_of_bits(0x7F800000u);
    memcpy(hkeys_at(&kbad, 123, 7), &inf, 4);
    fill_i32(out, 16, FM_SENTINEL);
    CHECK_ERR(fm_topk(s, hidden, hn, &kbad, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "chunk 123");
    if (!dm_is_cuda()) CHECK_MSG("element 7");
    check_all("Inf key", out, 16, after_bad);
    CHECK_OK(fm_scorer_sync(s, dm_stream()));
    HKeys k8bad = hkeys_random(FM_KEYS_FP8_E4M3, 50, hd, 0, false);
    *hkeys_at(&k8bad, 31, 2) = 0x7F; /* fp8 NaN */
    fill_i32(out, 16, FM_SENTINEL);
    CHECK_ERR(fm_topk(s, hidden, hn, &k8bad, 50, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "chunk 31");
    check_all("fp8 NaN key", out, 16, after_bad);
    CHECK_OK(fm_scorer_sync(s, dm_stream()));
    hkeys_free(&k8bad);
    hkeys_free(&kbad);

    /* KVSWAP_SYNC=0 (read at load): on CUDA the call does not wait, writes
     * -1 and leaves the error to fm_scorer_sync; the CPU reports it at once. */
    CHECK(setenv("KVSWAP_SYNC", "0", 1) == 0);
    FmScorer *async = fm_load_ok(ckpt);
    CHECK(unsetenv("KVSWAP_SYNC") == 0);
    fill_i32(out, 16, FM_SENTINEL);
    bad[info.hidden + 5] = f32_of_bits(0x7FC00000u);
    if (dm_is_cuda()) {
        CHECK_OK(fm_topk(async, bad, hn, &kb, n, 16, out)); /* read back after the stream: -1 */
        check_all("NaN hidden, KVSWAP_SYNC=0", out, 16, -1);
        CHECK_ERR(fm_scorer_sync(async, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
        CHECK_MSG("fm_scorer_sync");
    } else {
        CHECK_ERR(fm_topk(async, bad, hn, &kb, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
        check_all("NaN hidden, KVSWAP_SYNC=0", out, 16, FM_SENTINEL);
    }
    CHECK_OK(fm_scorer_sync(async, dm_stream())); /* reported once */
    fm_topk_vs_ref("KVSWAP_SYNC=0", async, hidden, hn, &kb, 16, KVSWAP_ENSEMBLE_MAX, out);
    CHECK_OK(fm_scorer_sync(async, dm_stream()));
    /* fm_scorer_set_sync on that scorer: 1 returns the error from the call
     * (-1 written on CUDA), 0 defers it to fm_scorer_sync again; the CPU
     * reports at once either way. */
    CHECK_OK(fm_scorer_set_sync(async, 1));
    fill_i32(out, 16, FM_SENTINEL);
    CHECK_ERR(fm_topk(async, bad, hn, &kb, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
    check_all("NaN hidden, fm_scorer_set_sync(1)", out, 16, after_bad);
    CHECK_OK(fm_scorer_sync(async, dm_stream()));
    CHECK_OK(fm_scorer_set_sync(async, 0));
    fill_i32(out, 16, FM_SENTINEL);
    if (dm_is_cuda()) {
        CHECK_OK(fm_topk(async, bad, hn, &kb, n, 16, out));
        check_all("NaN hidden, fm_scorer_set_sync(0)", out, 16, -1);
        CHECK_ERR(fm_scorer_sync(async, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
    } else {
        CHECK_ERR(fm_topk(async, bad, hn, &kb, n, 16, out), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
        check_all("NaN hidden, fm_scorer_set_sync(0)", out, 16, FM_SENTINEL);
    }
    CHECK_OK(fm_scorer_sync(async, dm_stream())); /* reported once */
    fm_scorer_free(async);
    group_done(dm_is_cuda() ? "fm_score_topk: NaN/Inf hidden, Inf key, fp8 NaN key -> INVALID_ARGUMENT "
                              "naming scorer/chunk, top-k written as -1, fm_scorer_sync OK after; KVSWAP_SYNC=0: the "
                              "call returns OK and fm_scorer_sync reports the error once; so does "
                              "fm_scorer_set_sync(0), and (1) returns it from the call"
                            : "fm_score_topk: NaN/Inf hidden, Inf key, fp8 NaN key -> INVALID_ARGUMENT "
                              "naming scorer/chunk and position, out untouched; fm_scorer_sync OK; KVSWAP_SYNC=0 "
                              "and fm_scorer_set_sync change nothing on the CPU");

    /* Arguments: refused before anything is scored; out untouched. */
    {
        struct {
            size_t n_chunks;
            uint32_t k;
            enum KvswapStatus want;
            const char *substr;
        } cases[] = {
            {n, 0, KVSWAP_STATUS_INVALID_ARGUMENT, "k is 0"},
            {n, FM_MAX_TOPK + 1, KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_TOPK = 2048"},
            {0, 16, KVSWAP_STATUS_INVALID_ARGUMENT, "n_chunks is 0"},
            {(size_t)FM_MAX_CHUNKS + 1, 16, KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_CHUNKS"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            int32_t *o = (int32_t *)malloc(((size_t)cases[i].k + 1) * sizeof(int32_t));
            CHECK(o != NULL);
            fill_i32(o, cases[i].k + 1, FM_SENTINEL);
            CHECK_ERR(fm_topk(s, hidden, hn, &kb, cases[i].n_chunks, cases[i].k, o), cases[i].want, cases[i].substr);
            CHECK_MSG("fm_score_topk");
            check_all("refused call", o, cases[i].k, FM_SENTINEL);
            free(o);
        }
        /* NULL and misaligned pointers, bad dtype and stride (no device copy
         * needed: refused before any pointer is used). */
        void *dh = dev_copy(hidden, hn * sizeof(float));
        void *dk = dev_copy(kb.data, hkeys_bytes(&kb));
        int32_t *dout = (int32_t *)dev_copy(out, 16 * sizeof(int32_t));
        FmKeys fk = fmkeys_of(dk, NULL, &kb);
        void *st = dm_stream();
        CHECK_ERR(fm_score_topk(NULL, (const float *)dh, &fk, n, 16, dout, st), KVSWAP_STATUS_NULL_POINTER, "scorer");
        CHECK_ERR(fm_score_topk(s, NULL, &fk, n, 16, dout, st), KVSWAP_STATUS_NULL_POINTER, "hidden");
        CHECK_ERR(fm_score_topk(s, (const float *)dh, NULL, n, 16, dout, st), KVSWAP_STATUS_NULL_POINTER, "keys");
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &fk, n, 16, NULL, st), KVSWAP_STATUS_NULL_POINTER, "out_indices");
        CHECK_ERR(fm_score_topk(s, (const float *)((const char *)dh + 2), &fk, n, 16, dout, st),
                  KVSWAP_STATUS_INVALID_ARGUMENT, "aligned");
        CHECK_MSG("hidden");
        FmKeys bad_keys = fk;
        bad_keys.data = NULL;
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &bad_keys, n, 16, dout, st), KVSWAP_STATUS_NULL_POINTER, "keys.data");
        bad_keys = fk;
        bad_keys.dtype = 7;
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &bad_keys, n, 16, dout, st), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "keys.dtype = 7");
        bad_keys = fk;
        bad_keys.row_stride_bytes = (size_t)hd * 2 - 2; /* shorter than a row */
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &bad_keys, n, 16, dout, st), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "row_stride_bytes");
        bad_keys = fk;
        bad_keys.row_stride_bytes = (size_t)hd * 2 + 1; /* not a multiple of 2 */
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &bad_keys, n, 16, dout, st), KVSWAP_STATUS_INVALID_ARGUMENT,
                  "row_stride_bytes");
        bad_keys = fk;
        bad_keys.dtype = FM_KEYS_FP8_E4M3; /* fp8 without scales */
        CHECK_ERR(fm_score_topk(s, (const float *)dh, &bad_keys, n, 16, dout, st), KVSWAP_STATUS_NULL_POINTER,
                  "keys.scales");
        if (dm_is_cuda()) {
            /* Host memory and the legacy stream are refused on CUDA. */
            CHECK_ERR(fm_score_topk(s, hidden, &fk, n, 16, dout, st), KVSWAP_STATUS_INVALID_ARGUMENT, "not CUDA memory");
            CHECK_MSG("hidden");
            FmKeys host_keys = fmkeys_of(kb.data, NULL, &kb);
            CHECK_ERR(fm_score_topk(s, (const float *)dh, &host_keys, n, 16, dout, st), KVSWAP_STATUS_INVALID_ARGUMENT,
                      "not CUDA memory");
            CHECK_MSG("keys.data");
            CHECK_ERR(fm_score_topk(s, (const float *)dh, &fk, n, 16, out, st), KVSWAP_STATUS_INVALID_ARGUMENT,
                      "not CUDA memory");
            CHECK_MSG("out_indices");
            CHECK_ERR(fm_score_topk(s, (const float *)dh, &fk, n, 16, dout, NULL), KVSWAP_STATUS_INVALID_ARGUMENT,
                      "legacy default stream");
            CHECK_ERR(fm_scorer_sync(s, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
            /* More chunks than the key buffer holds. */
            CHECK_ERR(fm_score_topk(s, (const float *)dh, &fk, n * 64, 16, dout, st), KVSWAP_STATUS_OUT_OF_RANGE,
                      "runs past the end");
        }
        int32_t back[16];
        dm_sync();
        dm_download(back, dout, sizeof back);
        CHECK(memcmp(back, out, sizeof back) == 0);
        dm_free(dh);
        dm_free(dk);
        dm_free(dout);
    }
    group_done(dm_is_cuda() ? "fm_score_topk refusals: k 0 / 2049, n_chunks 0 / 4M+1, NULL scorer/hidden/keys/"
                              "keys.data/out/scales, misaligned hidden, bad dtype and strides, host pointers, the "
                              "legacy stream, keys past their allocation; out untouched"
                            : "fm_score_topk refusals: k 0 / 2049, n_chunks 0 / 4M+1, NULL scorer/hidden/keys/"
                              "keys.data/out/scales, misaligned hidden, bad dtype and strides; out untouched");

    /* Batches: the same as single calls, mixed key types and lengths. */
    {
        float *h1 = random_hidden(hn), *h2 = random_hidden(hn);
        HKeys kshort = hkeys_random(FM_KEYS_F32, 7, hd, 0, false);
        int32_t bo[3][FM_BATCH_OUT], so[3][FM_BATCH_OUT];
        const uint32_t k = FM_BATCH_OUT;
        HSeq hs[3] = {
            {hidden, hn, &kb, kb.n, bo[0]},
            {h1, hn, &kshort, kshort.n, bo[1]},
            {h2, hn, &k8, k8.n, bo[2]},
        };
        for (int r = 0; r < 2; r++) {
            uint32_t e = r ? KVSWAP_ENSEMBLE_MEAN : KVSWAP_ENSEMBLE_MAX;
            CHECK_OK(fm_scorer_set_ensemble(s, e));
            for (int i = 0; i < 3; i++) fill_i32(bo[i], k, FM_SENTINEL);
            CHECK_OK(fm_batch(s, hs, 3, 3, k, false));
            for (int i = 0; i < 3; i++) {
                fm_topk_vs_ref(i == 0 ? "batch seq 0 (single)" : i == 1 ? "batch seq 1 (single)" : "batch seq 2 (single)",
                               s, hs[i].hidden, hn, hs[i].keys, k, e, so[i]);
                check_same_ids(i == 0 ? "batch vs single, seq 0" : i == 1 ? "batch vs single, seq 1" : "batch vs single, seq 2",
                               bo[i], so[i], k);
            }
            for (int i = 7; i < 16; i++) CHECK_EQ(bo[1][i], -1);
        }
        CHECK_OK(fm_scorer_set_ensemble(s, KVSWAP_ENSEMBLE_MAX));
        /* A batch of one bf16 sequence three times (one launch on CUDA). */
        HSeq same3[3] = {{hidden, hn, &kb, kb.n, bo[0]}, {h1, hn, &kb, kb.n, bo[1]}, {h2, hn, &kb, kb.n, bo[2]}};
        CHECK_OK(fm_batch(s, same3, 3, 3, k, false));
        for (int i = 0; i < 3; i++) {
            fm_topk_ok(s, same3[i].hidden, hn, &kb, k, so[i]);
            check_same_ids("bf16 batch vs single", bo[i], so[i], k);
        }
        /* Refusals before anything is scored: nothing written. */
        for (int i = 0; i < 3; i++) fill_i32(bo[i], k, FM_SENTINEL);
        same3[2].n_chunks = 0;
        CHECK_ERR(fm_batch(s, same3, 3, 3, k, false), KVSWAP_STATUS_INVALID_ARGUMENT, "seqs[2]");
        CHECK_MSG("fm_score_topk_batch");
        CHECK_MSG("n_chunks is 0");
        same3[2].n_chunks = kb.n;
        CHECK_ERR(fm_batch(s, same3, 3, 3, k, true), KVSWAP_STATUS_NULL_POINTER, "seqs[1].out_indices");
        CHECK_ERR(fm_batch(s, same3, 3, 3, 0, false), KVSWAP_STATUS_INVALID_ARGUMENT, "k is 0");
        CHECK_ERR(fm_batch(s, same3, 3, 3, FM_MAX_TOPK + 1, false), KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_TOPK");
        CHECK_ERR(fm_batch(s, same3, 3, 0, k, false), KVSWAP_STATUS_INVALID_ARGUMENT, "n_seqs is 0");
        CHECK_ERR(fm_batch(s, same3, 3, (size_t)FM_MAX_SEQS + 1, k, false), KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_SEQS");
        for (int i = 0; i < 3; i++) check_all("refused batch", bo[i], k, FM_SENTINEL);
        CHECK_ERR(fm_score_topk_batch(s, 3, NULL, k, dm_stream()), KVSWAP_STATUS_NULL_POINTER, "seqs");
        FmSeq one;
        memset(&one, 0, sizeof one);
        CHECK_ERR(fm_score_topk_batch(NULL, 1, &one, k, dm_stream()), KVSWAP_STATUS_NULL_POINTER, "scorer");
        /* A NaN in sequence 1: INVALID_ARGUMENT; the CPU writes nothing, CUDA
         * writes -1 to the whole (single-launch) batch. */
        same3[1].hidden = bad;
        CHECK_ERR(fm_batch(s, same3, 3, 3, k, false), KVSWAP_STATUS_INVALID_ARGUMENT, "hidden");
        CHECK_MSG(dm_is_cuda() ? "sequence 1" : "seqs[1]");
        for (int i = 0; i < 3; i++) check_all("batch with a NaN", bo[i], k, after_bad);
        CHECK_OK(fm_scorer_sync(s, dm_stream()));
        same3[1].hidden = h1;
        CHECK_OK(fm_batch(s, same3, 3, 3, k, false));
        for (int i = 0; i < 3; i++) check_same_ids("batch after a refused one", bo[i], so[i], k);
        hkeys_free(&kshort);
        free(h1);
        free(h2);
    }
    group_done("fm_score_topk_batch: 3 sequences (bf16 / f32 with padding / fp8; max and mean) equal single calls; "
               "refusals (seqs[i] named, nothing written), n_seqs 0 / 4097, NULL seqs/scorer, a NaN sequence");

    /* Last, so that a failure here hides no other check. */
    test_fm_value_contract(s, hidden, hn, after_bad);

    free(bad);
    free(half_zero);
    free(hidden2);
    free(perm);
    hkeys_free(&kb_perm);
    hkeys_free(&kb_strided);
    hkeys_free(&kf_strided);
    hkeys_free(&k8p);
    hkeys_free(&k8p_as_f32);
    hkeys_free(&kb_as_f32);
    hkeys_free(&zero);
    hkeys_free(&same);
    hkeys_free(&kfew);
    hkeys_free(&kb);
    hkeys_free(&kf);
    hkeys_free(&k8);
    free(hidden);
    fmref_free();
    fm_scorer_free(s);
}

/* The next f32 above / below a finite `f`. */
static float f32_next_up(float f) {
    uint32_t u = bits_of_f32(f);
    if ((u & 0x7FFFFFFFu) == 0) return f32_of_bits(1u);
    return f32_of_bits((u & 0x80000000u) ? u - 1 : u + 1);
}
static float f32_next_down(float f) { return -f32_next_up(-f); }

/* fm_bounds_build over `keys` (host memory on every backend), checked
 * element by element: f32 and bf16 keys give the exact minimum and maximum;
 * fp8 x scale gives the nearest f32 at or outside them. */
static void bounds_build_check_at(int line, const HKeys *keys, uint32_t chunk_tokens, float **out_lo, float **out_hi) {
    const uint32_t dim = keys->dim;
    const size_t nc = (keys->n + chunk_tokens - 1) / chunk_tokens;
    float *lo = (float *)malloc(nc * dim * sizeof(float)), *hi = (float *)malloc(nc * dim * sizeof(float));
    CHECK_AT(line, lo != NULL && hi != NULL);
    for (size_t i = 0; i < nc * dim; i++) lo[i] = hi[i] = 12345.0f;
    FmKeys fk = fmkeys_of(keys->data, keys->scales, keys);
    CHECK_OK_AT(line, fm_bounds_build(&fk, keys->n, dim, chunk_tokens, lo, hi));
    for (size_t c = 0; c < nc; c++) {
        for (uint32_t d = 0; d < dim; d++) {
            double mn = 1e300, mx = -1e300;
            for (size_t t = c * chunk_tokens; t < (c + 1) * chunk_tokens && t < keys->n; t++) {
                double v = hkeys_value(keys, t, d);
                if (v < mn) mn = v;
                if (v > mx) mx = v;
            }
            float l = lo[c * dim + d], h = hi[c * dim + d];
            bool ok = keys->dtype == FM_KEYS_FP8_E4M3
                          ? (double)l <= mn && (double)f32_next_up(l) > mn && (double)h >= mx && (double)f32_next_down(h) < mx
                          : (double)l == mn && (double)h == mx;
            if (!ok)
                FAIL_AT(line, "fm_bounds_build (dtype %u): chunk %zu element %u: [%.9g, %.9g], keys span [%.17g, %.17g]",
                        keys->dtype, c, d, (double)l, (double)h, mn, mx);
        }
    }
    *out_lo = lo;
    *out_hi = hi;
}
#define bounds_build_check(keys, ct, lo, hi) bounds_build_check_at(__LINE__, keys, ct, lo, hi)

/* fm_bounds_topk on `device` against the reference: exact on the CPU
 * (device -1), within the f32 error bound on CUDA. */
static void bounds_vs_ref_at(int line, const char *what, int32_t device, const float *q, const float *lo, const float *hi,
                             uint32_t dim, size_t n, uint32_t k) {
    int32_t *out = (int32_t *)malloc(k * sizeof(int32_t));
    double *sc = (double *)malloc(n * sizeof(double)), *er = (double *)malloc(n * sizeof(double));
    CHECK_AT(line, out && sc && er);
    fill_i32(out, k, FM_SENTINEL);
    CHECK_OK_AT(line, bounds_topk_on(device, q, lo, hi, dim, n, k, out));
    bounds_reference(q, lo, hi, dim, n, sc, er);
    check_topk_at(line, what, out, sc, er, n, k, device < 0);
    free(out);
    free(sc);
    free(er);
}
#define bounds_vs_ref(what, device, q, lo, hi, dim, n, k) bounds_vs_ref_at(__LINE__, what, device, q, lo, hi, dim, n, k)

static void bounds_refused_at(int line, int32_t device, const float *q, const float *lo, const float *hi, uint32_t dim,
                              size_t n, uint32_t k, enum KvswapStatus want, const char *substr) {
    int32_t out[8];
    fill_i32(out, 8, FM_SENTINEL);
    /* k above 8 is refused before `out` is used; bounds_topk_on copies k entries. */
    CHECK_AT(line, k <= 8 || want != KVSWAP_STATUS_OK);
    enum KvswapStatus st = k <= 8 ? bounds_topk_on(device, q, lo, hi, dim, n, k, out)
                                  : fm_bounds_topk(device, q, lo, hi, dim, n, k, out, device < 0 ? NULL : dm_stream());
    if (st != want) FAIL_AT(line, "fm_bounds_topk returned %s, expected %s", sname(st), sname(want));
    CHECK_MSG_AT(line, substr);
    CHECK_MSG_AT(line, "fm_bounds_topk");
    check_all_at(line, "refused fm_bounds_topk", out, 8, FM_SENTINEL);
}
#define bounds_refused(device, q, lo, hi, dim, n, k, want, substr) \
    bounds_refused_at(__LINE__, device, q, lo, hi, dim, n, k, want, substr)

static void test_fm_bounds(void) {
    const uint32_t dim = 128, ct = 16;
    const size_t tokens = 1000, nc = (tokens + ct - 1) / ct; /* 63 chunks, the last of 8 tokens */
    float *q = random_hidden(dim);
    float *lo = NULL, *hi = NULL;

    /* fm_bounds_build: every key type, a strided one. */
    HKeys kf = hkeys_random(FM_KEYS_F32, tokens, dim, 0, false);
    HKeys kb = hkeys_random(FM_KEYS_BF16, tokens, dim, (size_t)dim * 2 + 64, false);
    HKeys k8 = hkeys_random(FM_KEYS_FP8_E4M3, tokens, dim, 0, false);
    const HKeys *all[3] = {&kb, &k8, &kf};
    for (int i = 0; i < 3; i++) {
        bounds_build_check(all[i], ct, &lo, &hi);
        /* The CPU bounds scorer: exactly the reference. */
        bounds_vs_ref("bounds, k 8", -1, q, lo, hi, dim, nc, 8);
        bounds_vs_ref("bounds, k = n", -1, q, lo, hi, dim, nc, (uint32_t)nc);
        bounds_vs_ref("bounds, k 70 > n", -1, q, lo, hi, dim, nc, 70);
        if (dm_is_cuda()) {
            bounds_vs_ref("CUDA bounds, k 8", 0, q, lo, hi, dim, nc, 8);
            bounds_vs_ref("CUDA bounds, k 70 > n", 0, q, lo, hi, dim, nc, 70);
        }
        if (i < 2) {
            free(lo);
            free(hi);
        }
    }
    /* One token per chunk (the bounds are the keys) and a chunk as long as everything. */
    {
        float *l1, *h1;
        bounds_build_check(&kb, 1, &l1, &h1);
        bounds_vs_ref("bounds of single tokens", -1, q, l1, h1, dim, tokens, 32);
        if (dm_is_cuda()) bounds_vs_ref("CUDA bounds of single tokens", 0, q, l1, h1, dim, tokens, 32);
        free(l1);
        free(h1);
        bounds_build_check(&kf, (uint32_t)tokens * 2, &l1, &h1);
        free(l1);
        free(h1);
    }
    /* Ties: every chunk the same -> 0..k-1. */
    {
        float *tl = (float *)malloc(nc * dim * sizeof(float)), *th = (float *)malloc(nc * dim * sizeof(float));
        CHECK(tl && th);
        for (size_t c = 0; c < nc; c++) {
            memcpy(tl + c * dim, lo, dim * sizeof(float));
            memcpy(th + c * dim, hi, dim * sizeof(float));
        }
        int32_t out[80];
        for (int dev = -1; dev <= (dm_is_cuda() ? 0 : -1); dev++) {
            fill_i32(out, 80, FM_SENTINEL);
            CHECK_OK(bounds_topk_on(dev, q, tl, th, dim, nc, 10, out));
            for (int32_t i = 0; i < 10; i++) CHECK_EQ(out[i], i);
            CHECK_OK(bounds_topk_on(dev, q, tl, th, dim, nc, 80, out));
            for (int32_t i = 0; i < 80; i++) CHECK_EQ(out[i], i < (int32_t)nc ? i : -1);
        }
        free(tl);
        free(th);
    }
    group_done(dm_is_cuda() ? "fm_bounds_build (f32, strided bf16: exact; fp8 x scale: nearest f32 outside) + "
                              "fm_bounds_topk on the CPU (exactly the double-precision reference) and on CUDA (within "
                              "the f32 error bound); ties -> 0..k-1; -1 padding"
                            : "fm_bounds_build (f32, strided bf16: exact; fp8 x scale: nearest f32 outside) + "
                              "fm_bounds_topk (exactly the double-precision reference, ties -> 0..k-1, -1 padding)");

    /* fm_bounds_topk refusals (lo/hi: the bounds of kf, nc chunks). */
    for (int dev = -1; dev <= (dm_is_cuda() ? 0 : -1); dev++) {
        bounds_refused(dev, q, lo, hi, dim, nc, 0, KVSWAP_STATUS_INVALID_ARGUMENT, "k is 0");
        bounds_refused(dev, q, lo, hi, dim, nc, FM_MAX_TOPK + 1, KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_TOPK");
        bounds_refused(dev, q, lo, hi, 0, nc, 8, KVSWAP_STATUS_INVALID_ARGUMENT, "dim = 0");
        bounds_refused(dev, q, lo, hi, dim, 0, 8, KVSWAP_STATUS_INVALID_ARGUMENT, "n_chunks is 0");
    }
    int32_t out[8];
    CHECK_ERR(fm_bounds_topk(-1, q, lo, hi, 65537, 1, 8, out, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "dim = 65537");
    CHECK_ERR(fm_bounds_topk(-2, q, lo, hi, dim, nc, 8, out, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "device = -2");
    CHECK_ERR(fm_bounds_topk(-1, NULL, lo, hi, dim, nc, 8, out, NULL), KVSWAP_STATUS_NULL_POINTER, "query");
    CHECK_ERR(fm_bounds_topk(-1, q, NULL, hi, dim, nc, 8, out, NULL), KVSWAP_STATUS_NULL_POINTER, "bounds_min");
    CHECK_ERR(fm_bounds_topk(-1, q, lo, NULL, dim, nc, 8, out, NULL), KVSWAP_STATUS_NULL_POINTER, "bounds_max");
    CHECK_ERR(fm_bounds_topk(-1, q, lo, hi, dim, nc, 8, NULL, NULL), KVSWAP_STATUS_NULL_POINTER, "out_indices");
    if (!dm_driver_present()) {
        CHECK_ERR(fm_bounds_topk(0, q, lo, hi, dim, nc, 8, out, NULL), KVSWAP_STATUS_NO_DEVICE, "CUDA");
        CHECK_MSG("fm_bounds_topk");
    }
    /* fm_bounds_set_sync: 0 or 1; -1 (the CPU) accepted; the device is not
     * opened by it (a CUDA build stores the setting for device 5 whether or
     * not there is one; 1 is what an unset KVSWAP_SYNC gives). */
    CHECK_ERR(fm_bounds_set_sync(-1, 3), KVSWAP_STATUS_INVALID_ARGUMENT, "sync = 3: expected 0, 1 or 2");
    CHECK_MSG("fm_bounds_set_sync");
    CHECK_ERR(fm_bounds_set_sync(-2, 1), KVSWAP_STATUS_INVALID_ARGUMENT, "device = -2");
    CHECK_OK(fm_bounds_set_sync(-1, 0));
    CHECK_OK(fm_bounds_set_sync(5, 1));
    CHECK_OK(fm_bounds_set_sync(5, 2)); /* back to KVSWAP_SYNC */
    /* fm_bounds_reserve: device and size checks; the CPU has no workspace. */
    CHECK_ERR(fm_bounds_reserve(-2, 10, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "device = -2");
    CHECK_MSG("fm_bounds_reserve");
    CHECK_ERR(fm_bounds_reserve(-1, 0, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "n_chunks is 0");
    CHECK_ERR(fm_bounds_reserve(-1, FM_MAX_CHUNKS + 1, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "FM_MAX_CHUNKS");
    CHECK_OK(fm_bounds_reserve(-1, 1000, NULL));
    if (!dm_driver_present()) CHECK_ERR(fm_bounds_reserve(0, 1000, NULL), KVSWAP_STATUS_NO_DEVICE, "CUDA");
    if (dm_is_cuda()) {
        CHECK_ERR(fm_bounds_reserve(0, 1000, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
        CHECK_OK(fm_bounds_reserve(0, 1000, dm_stream()));
    }
    /* Values: NaN query, Inf bound, min above max (the CPU checks them all first). */
    float *q_bad = (float *)malloc(dim * sizeof(float)), *lo_bad = (float *)malloc(nc * dim * sizeof(float));
    CHECK(q_bad && lo_bad);
    memcpy(q_bad, q, dim * sizeof(float));
    q_bad[3] = f32_of_bits(0x7FC00000u);
    bounds_refused(-1, q_bad, lo, hi, dim, nc, 8, KVSWAP_STATUS_INVALID_ARGUMENT, "query: element 3");
    memcpy(lo_bad, lo, nc * dim * sizeof(float));
    lo_bad[5 * dim + 9] = hi[5 * dim + 9] + 1.0f;
    bounds_refused(-1, q, lo_bad, hi, dim, nc, 8, KVSWAP_STATUS_INVALID_ARGUMENT, "chunk 5, element 9");
    memcpy(lo_bad, lo, nc * dim * sizeof(float));
    lo_bad[7 * dim + 2] = f32_of_bits(0xFF800000u);
    bounds_refused(-1, q, lo_bad, hi, dim, nc, 8, KVSWAP_STATUS_INVALID_ARGUMENT, "bounds_min: chunk 7, element 2");
    if (dm_is_cuda()) {
        /* CUDA: host pointers refused; a NaN query makes every score NaN:
         * INVALID_ARGUMENT with the top-k written as -1. */
        void *dq = dev_copy(q, dim * sizeof(float));
        void *dlo = dev_copy(lo, nc * dim * sizeof(float)), *dhi = dev_copy(hi, nc * dim * sizeof(float));
        int32_t *dout = (int32_t *)dm_alloc(8 * sizeof(int32_t));
        CHECK_ERR(fm_bounds_topk(0, q, (const float *)dlo, (const float *)dhi, dim, nc, 8, dout, dm_stream()),
                  KVSWAP_STATUS_INVALID_ARGUMENT, "not CUDA memory");
        CHECK_MSG("query");
        CHECK_ERR(fm_bounds_topk(0, (const float *)dq, (const float *)dlo, (const float *)dhi, dim, nc, 8, out, dm_stream()),
                  KVSWAP_STATUS_INVALID_ARGUMENT, "not CUDA memory");
        CHECK_MSG("out_indices");
        CHECK_ERR(fm_bounds_topk(0, (const float *)dq, (const float *)dlo, (const float *)dhi, dim, nc, 8, dout, NULL),
                  KVSWAP_STATUS_INVALID_ARGUMENT, "legacy default stream");
        dm_free(dq);
        dm_free(dlo);
        dm_free(dhi);
        dm_free(dout);
        fill_i32(out, 8, FM_SENTINEL);
        CHECK_ERR(bounds_topk_on(0, q_bad, lo, hi, dim, nc, 8, out), KVSWAP_STATUS_INVALID_ARGUMENT, "non-finite");
        check_all("CUDA bounds with a NaN query", out, 8, -1);
        CHECK_OK(fm_bounds_sync(0, dm_stream())); /* KVSWAP_SYNC=1: reported by the call */
        bounds_vs_ref("CUDA bounds after a NaN query", 0, q, lo, hi, dim, nc, 8);
        /* KVSWAP_SYNC=0: the call returns OK with -1, fm_bounds_sync reports
         * the error once, and later calls are good again. */
        CHECK(setenv("KVSWAP_SYNC", "0", 1) == 0);
        fill_i32(out, 8, FM_SENTINEL);
        CHECK_OK(bounds_topk_on(0, q_bad, lo, hi, dim, nc, 8, out));
        check_all("CUDA bounds with a NaN query, KVSWAP_SYNC=0", out, 8, -1);
        CHECK_ERR(fm_bounds_sync(0, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "non-finite");
        CHECK_MSG("fm_bounds_sync");
        CHECK_OK(fm_bounds_sync(0, dm_stream()));
        bounds_vs_ref("CUDA bounds, KVSWAP_SYNC=0, after fm_bounds_sync", 0, q, lo, hi, dim, nc, 8);
        CHECK(unsetenv("KVSWAP_SYNC") == 0);
        /* The same by fm_bounds_set_sync, with KVSWAP_SYNC unset (1): 0
         * defers the error to fm_bounds_sync, then 1 returns it from the
         * call (the setting stays 1, as an unset KVSWAP_SYNC). */
        CHECK_OK(fm_bounds_set_sync(0, 0));
        fill_i32(out, 8, FM_SENTINEL);
        CHECK_OK(bounds_topk_on(0, q_bad, lo, hi, dim, nc, 8, out));
        check_all("CUDA bounds with a NaN query, fm_bounds_set_sync(0, 0)", out, 8, -1);
        CHECK_ERR(fm_bounds_sync(0, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "non-finite");
        CHECK_OK(fm_bounds_set_sync(0, 1));
        fill_i32(out, 8, FM_SENTINEL);
        CHECK_ERR(bounds_topk_on(0, q_bad, lo, hi, dim, nc, 8, out), KVSWAP_STATUS_INVALID_ARGUMENT, "non-finite");
        check_all("CUDA bounds with a NaN query, fm_bounds_set_sync(0, 1)", out, 8, -1);
        CHECK_OK(fm_bounds_sync(0, dm_stream())); /* reported by the call */
        bounds_vs_ref("CUDA bounds, fm_bounds_set_sync(0, 1)", 0, q, lo, hi, dim, nc, 8);
        /* 2: back to KVSWAP_SYNC, here 0 again: the call defers. */
        CHECK_OK(fm_bounds_set_sync(0, 2));
        CHECK(setenv("KVSWAP_SYNC", "0", 1) == 0);
        CHECK_OK(bounds_topk_on(0, q_bad, lo, hi, dim, nc, 8, out));
        CHECK_ERR(fm_bounds_sync(0, dm_stream()), KVSWAP_STATUS_INVALID_ARGUMENT, "non-finite");
        CHECK(unsetenv("KVSWAP_SYNC") == 0);
    }
    CHECK_OK(fm_bounds_sync(-1, NULL)); /* the CPU reports at once */

    /* fm_bounds_build refusals: outputs untouched. */
    {
        float *l2 = (float *)malloc(nc * dim * sizeof(float)), *h2 = (float *)malloc(nc * dim * sizeof(float));
        CHECK(l2 && h2);
        for (size_t i = 0; i < nc * dim; i++) l2[i] = h2[i] = 777.0f;
        FmKeys fk = fmkeys_of(kf.data, NULL, &kf);
        CHECK_ERR(fm_bounds_build(NULL, tokens, dim, ct, l2, h2), KVSWAP_STATUS_NULL_POINTER, "keys");
        CHECK_MSG("fm_bounds_build");
        CHECK_ERR(fm_bounds_build(&fk, tokens, dim, ct, NULL, h2), KVSWAP_STATUS_NULL_POINTER, "out_min");
        CHECK_ERR(fm_bounds_build(&fk, tokens, dim, ct, l2, NULL), KVSWAP_STATUS_NULL_POINTER, "out_max");
        CHECK_ERR(fm_bounds_build(&fk, 0, dim, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "n_tokens = 0");
        CHECK_ERR(fm_bounds_build(&fk, tokens, dim, 0, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "chunk_tokens = 0");
        CHECK_ERR(fm_bounds_build(&fk, tokens, 0, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "dim = 0");
        CHECK_ERR(fm_bounds_build(&fk, 1, 65537, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "dim = 65537");
        FmKeys f2 = fk;
        f2.dtype = 9;
        CHECK_ERR(fm_bounds_build(&f2, tokens, dim, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "keys.dtype = 9");
        f2 = fmkeys_of(k8.data, NULL, &k8);
        CHECK_ERR(fm_bounds_build(&f2, tokens, dim, ct, l2, h2), KVSWAP_STATUS_NULL_POINTER, "keys.scales");
        f2 = fk;
        f2.row_stride_bytes = 4 * dim - 4;
        CHECK_ERR(fm_bounds_build(&f2, tokens, dim, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "row_stride_bytes");
        HKeys kn = hkeys_convert(&kf, FM_KEYS_F32, 0);
        float nan = f32_of_bits(0x7FC00000u);
        memcpy(hkeys_at(&kn, 17, 3), &nan, 4);
        FmKeys fn = fmkeys_of(kn.data, NULL, &kn);
        CHECK_ERR(fm_bounds_build(&fn, tokens, dim, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "token 17, element 3");
        HKeys k8n = hkeys_random(FM_KEYS_FP8_E4M3, 40, dim, 0, false);
        k8n.scales[33] = f32_of_bits(0x7F800000u);
        FmKeys f8 = fmkeys_of(k8n.data, k8n.scales, &k8n);
        CHECK_ERR(fm_bounds_build(&f8, 40, dim, ct, l2, h2), KVSWAP_STATUS_INVALID_ARGUMENT, "scale of token 33");
        for (size_t i = 0; i < nc * dim; i++) CHECK(l2[i] == 777.0f && h2[i] == 777.0f);
        hkeys_free(&kn);
        hkeys_free(&k8n);
        free(l2);
        free(h2);
    }
    fm_scorer_free(NULL); /* a no-op */
    group_done("fm_bounds_topk / fm_bounds_build refusals: k 0 / 2049, dim 0 / 65537, n_chunks 0, n_tokens 0, "
               "chunk_tokens 0, device -2, NULL pointers, bad dtype / stride / scales, NaN query, Inf bound, "
               "min > max, NaN key, Inf scale: named, outputs untouched; fm_scorer_free(NULL); fm_bounds_set_sync 0 / 1 / 2 / a bad value / device -2");
    free(q_bad);
    free(lo_bad);
    free(lo);
    free(hi);
    free(q);
    hkeys_free(&kf);
    hkeys_free(&kb);
    hkeys_free(&k8);
}

/* The scorer groups. Returns false when they were skipped (no checkpoint). */
static bool test_fm_scorer(void) {
    test_fm_bounds(); /* needs no checkpoint */
    const char *ckpt = getenv("KVSWAP_TEST_FM_CKPT");
    if (!ckpt || !ckpt[0]) {
        const char *req = getenv("KVSWAP_TEST_REQUIRE_FM_CKPT");
        fprintf(stderr,
                "\n"
                "**********************************************************************\n"
                "* NOTE: KVSWAP_TEST_FM_CKPT is not set: the FlashMemory scorer group *\n"
                "* (fm_scorer_load, fm_score_topk, fm_score_topk_batch, ...) is       *\n"
                "* SKIPPED. Make a checkpoint and name it, e.g.                       *\n"
                "*   kvswap fm init --hidden 64 --heads 16 --head-dim 64 --scorers 2 \\ *\n"
                "*     --dtype bf16 --seed 7 --out /tmp/fm.safetensors                *\n"
                "*   KVSWAP_TEST_FM_CKPT=/tmp/fm.safetensors ./test_abi               *\n"
                "**********************************************************************\n\n");
        fflush(stderr);
        printf("SKIP fm scorer: KVSWAP_TEST_FM_CKPT is not set\n");
        fflush(stdout);
        if (req && strcmp(req, "1") == 0) FAIL("KVSWAP_TEST_REQUIRE_FM_CKPT=1, but KVSWAP_TEST_FM_CKPT is not set");
        return false;
    }
    test_fm_load_errors(ckpt);
    test_fm_scoring(ckpt);
    return true;
}

int main(void) {
    dm_init(); /* KVSWAP_TEST_BACKEND: cpu (default) or cuda */
    const uint32_t seed = test_seed();
    rng_state = seed | 1u;                     /* xorshift state: never 0 */
    fm_rng = (seed * 2654435761u) | 1u;
    printf("backend: %s, seed %u (KVSWAP_SEED=%u replays it)\n", dm_backend_name(), seed, seed);
    /* Nothing failed yet on this thread. */
    CHECK(kvswap_last_error() != NULL);
    CHECK(strcmp(kvswap_last_error(), "") == 0);

    test_version_and_status_names();
    test_config_default();
    test_config_from_env();
    test_logging();
    test_create_destroy_info();
    test_store_and_staging();
    test_lru_script();
    test_forget();
    test_guards();
    test_async();
    test_swap_in_layers();
    test_disabled();
    test_validate();
    test_streams_and_pointers();
    /* Last: refusals on paths where a mistake could leave the device (or
     * the CUDA context) in a bad state, so that a failure there cannot hide
     * the result of another group. */
    test_validate_refused();
    test_legacy_stream_fresh_layer();
    /* The FlashMemory scorer (KVSWAP_TEST_FM_CKPT names its checkpoint). */
    bool fm_ran = test_fm_scorer();

    CHECK_OK(kvswap_set_log_callback(NULL, NULL));
    scratch_release(&g_idx);
    scratch_release(&g_src);
    dm_fini();
    if (fm_ran)
        printf("test_abi (C11, %s backend): all groups passed\n", dm_backend_name());
    else
        printf("test_abi (C11, %s backend): all groups run passed, but the FlashMemory scorer group was SKIPPED "
               "(KVSWAP_TEST_FM_CKPT is not set)\n",
               dm_backend_name());
    return 0;
}
