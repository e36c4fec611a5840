/*
 * C11 test of the kvswap C ABI (include/kvswap.h), on the CPU backend.
 *
 * Every function of the header is called; the residency rules of DESIGN.md
 * are checked slot by slot over a hand-derived script and then against a
 * small reference model; every guard is checked for its status, a useful
 * kvswap_last_error() and an unchanged state afterwards.
 *
 * Prints one line per test group; exits 1 at the first failure with
 * file:line and the text of kvswap_last_error().
 */
#define _POSIX_C_SOURCE 200809L

#include "kvswap.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    uint32_t version[MAX_CAP]; /* 0: never stored; else the version last stored */
    uint64_t stores, swap_calls;
} Layer;

static KvswapConfig cpu_config(uint32_t enable, uint32_t gpu_chunks, uint32_t index_topk) {
    KvswapConfig c;
    CHECK_OK(kvswap_config_default(&c));
    c.backend = KVSWAP_BACKEND_CPU;
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
    uint32_t v = L->version[id] + 1;
    fill_chunk(buf, L->chunk_bytes, L->layer, id, v);
    CHECK_OK_AT(line, kvswap_store(L->ctx, L->layer, (int32_t)id, buf, NULL));
    L->version[id] = v;
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
    for (uint32_t s = 0; s < L->slots; s++) {
        int32_t id = L->model.slot_chunk[s];
        if (id < 0) continue;
        const uint8_t *row = (const uint8_t *)ptr + (size_t)s * stride;
        if (!chunk_is(row, L->chunk_bytes, L->layer, (uint32_t)id, L->version[id]))
            FAIL_AT(line, "layer %u slot %u: staged bytes are not chunk %d version %u", L->layer, s, id,
                    L->version[id]);
    }
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
    CHECK_OK_AT(line, kvswap_swap_in_selected(L->ctx, L->layer, buf, window, count, NULL));
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

static uint32_t rng_state = 12345u;
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
static void swap_refused_at(int line, Layer *L, KvswapContext *ctx, uint32_t layer, int32_t *indices_or_null,
                            const int32_t *sel, uint32_t window, uint32_t count, enum KvswapStatus want,
                            const char *substr, uint32_t n_layers) {
    int32_t buf[128], copy[128];
    uint32_t n = window + count + 1;
    int32_t *ind = NULL;
    if (indices_or_null) {
        CHECK_AT(line, n <= 128);
        for (uint32_t i = 0; i < window; i++) buf[i] = WIN_SENTINEL(i);
        for (uint32_t i = 0; i < count; i++) buf[window + i] = resolve_pick(L, sel[i]);
        buf[window + count] = TAIL_SENTINEL;
        memcpy(copy, buf, n * sizeof(int32_t));
        ind = buf;
    }
    Snapshot before = snapshot_at(line, L->ctx, n_layers);
    enum KvswapStatus s = kvswap_swap_in_selected(ctx, layer, ind, window, count, NULL);
    if (s != want) FAIL_AT(line, "swap_in_selected returned %s, expected %s", sname(s), sname(want));
    CHECK_MSG_AT(line, substr);
    CHECK_MSG_AT(line, "kvswap_swap_in_selected");
    if (ind && memcmp(copy, buf, n * sizeof(int32_t)) != 0) FAIL_AT(line, "a refused swap-in changed the index buffer");
    same_snapshot_at(line, L->ctx, &before);
    check_staged_at(line, L);
    /* The LRU order is undisturbed: a full probe gives the model's slots. */
    probe_lru_at(line, L, rnd(L->cap));
}
#define swap_refused(L, ctx, layer, ind, sel, window, count, want, substr, nl) \
    swap_refused_at(__LINE__, L, ctx, layer, ind, sel, window, count, want, substr, nl)

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
    KvswapConfig cfg = cpu_config(1, 4, 4);
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
    CHECK_LOG("swap off");
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

    KvswapConfig cfg = cpu_config(1, 4, 4);
    uint8_t engine_staging[4 * 96];
    KvswapLayerSpec specs[3] = {layer_spec(16, 64), layer_spec(3, 32), layer_spec(100, 80)};
    specs[2].staging = engine_staging;
    specs[2].staging_stride = 96;
    KvswapContext *ctx = create_ok(&cfg, specs, 3);

    KvswapContextInfo info;
    memset(&info, 0xA5, sizeof info);
    CHECK_OK(kvswap_context_info(ctx, &info));
    CHECK_EQ(info.backend, KVSWAP_BACKEND_CPU);
    CHECK_EQ(info.device, -1);
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
    CHECK(ptr == (void *)engine_staging);
    CHECK_EQ(stride, 96);
    CHECK_EQ(rows, 4);
    CHECK_OK(kvswap_layer_staging(ctx, 1, &ptr, &stride, &rows));
    CHECK_EQ(stride, 32);
    CHECK_EQ(rows, 3);
    CHECK_OK(kvswap_layer_staging(ctx, 0, &ptr, &stride, &rows));
    CHECK_EQ(stride, 64);
    CHECK_EQ(rows, 4);
    CHECK_OK(kvswap_sync(ctx, NULL));
    kvswap_destroy(ctx);

    /* The auto backend on a machine without CUDA is the CPU. */
    cfg.backend = KVSWAP_BACKEND_AUTO;
    ctx = create_ok(&cfg, specs, 1);
    CHECK_OK(kvswap_context_info(ctx, &info));
    CHECK_EQ(info.backend, KVSWAP_BACKEND_CPU);
    kvswap_destroy(ctx);
    group_done("create, destroy (NULL too), context_info, layer_staging, auto backend");

    /* ---- guards ---- */
    KvswapLayerSpec one = layer_spec(16, 64);
    cfg = cpu_config(1, 4, 4);
    KvswapContext *out = NULL;
    CHECK_ERR(kvswap_create(NULL, &one, 1, &out), KVSWAP_STATUS_NULL_POINTER, "config");
    CHECK(out == NULL);
    CHECK_ERR(kvswap_create(&cfg, NULL, 1, &out), KVSWAP_STATUS_NULL_POINTER, "layers");
    CHECK(out == NULL);
    CHECK_ERR(kvswap_create(&cfg, &one, 1, NULL), KVSWAP_STATUS_NULL_POINTER, "out");
    create_refused(&cfg, &one, 0, KVSWAP_STATUS_INVALID_ARGUMENT, "n_layers");

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
    c2.device = -1;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "device");
    c2 = cfg;
    memset(c2.fm_ckpt, 'a', sizeof c2.fm_ckpt); /* no NUL */
    create_refused(&c2, &one, 1, KVSWAP_STATUS_INVALID_ARGUMENT, "fm_ckpt");

    /* gpu_chunks < index_topk with swap on: refused unless the test flag is set. */
    c2 = cpu_config(1, 4, 8);
    create_refused(&c2, &one, 1, KVSWAP_STATUS_TOPK_GUARD, "index_topk");
    CHECK_MSG("gpu_chunks=4");
    CHECK_MSG("KVSWAP_TEST_ALLOW_TOPK_REDUCTION");
    c2.test_allow_topk_reduction = 1;
    ctx = create_ok(&c2, &one, 1);
    kvswap_destroy(ctx);
    c2 = cpu_config(0, 4, 8); /* swap off: no guard */
    ctx = create_ok(&c2, &one, 1);
    kvswap_destroy(ctx);

    /* Pinned host tier over the cap: 1024 x 2048 B = 2 MiB > 1 MiB. */
    c2 = cpu_config(1, 4, 4);
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

    /* An explicit CUDA backend on a machine without a GPU or libcuda. */
    c2 = cpu_config(1, 4, 4);
    c2.backend = KVSWAP_BACKEND_CUDA;
    create_refused(&c2, &one, 1, KVSWAP_STATUS_NO_DEVICE, "");
    CHECK(strlen(last_err()) > strlen("kvswap_create: "));
    group_done("create guards: NULLs, zero sizes, bad flags, TOPK_GUARD, PINNED_CAP, NO_DEVICE; *out untouched");
}

/* ---- store, store_batch, staging bytes, refresh ---- */

static void test_store_and_staging(void) {
    KvswapConfig cfg = cpu_config(1, 4, 4);
    enum { CB = 64, EXTRA = 24, ESTRIDE = 96 };
    uint8_t engine[4 * ESTRIDE];
    memset(engine, 0xEE, sizeof engine);
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
        CHECK_OK(kvswap_store_batch(ctx, l, ids, 8, src, CB + EXTRA, NULL));
        for (uint32_t i = 8; i < 16; i++) L.version[i] = 1;
        L.stores += 8;
        /* A batch with src_stride 0 (= chunk_bytes): new versions of 2 and 3. */
        uint8_t packed[2 * CB];
        int32_t ids2[2] = {2, 3};
        fill_chunk(packed, CB, l, 2, 2);
        fill_chunk(packed + CB, CB, l, 3, 2);
        CHECK_OK(kvswap_store_batch(ctx, l, ids2, 2, packed, 0, NULL));
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
        CHECK_OK(kvswap_store_batch(ctx, l, ids3, 2, two, CB + 8, NULL));
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
        CHECK_OK(kvswap_sync(ctx, NULL));
    }
    /* Engine staging: the bytes between rows (stride 96 > 64) were never written. */
    for (uint32_t s = 0; s < 4; s++)
        for (uint32_t b = CB; b < ESTRIDE; b++) CHECK(engine[s * ESTRIDE + b] == 0xEE);
    kvswap_destroy(ctx);
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
    KvswapConfig cfg = cpu_config(1, 4, 4);
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

/* ---- guards on a live context; the state is unchanged after each ---- */

static void test_guards(void) {
    KvswapConfig cfg = cpu_config(1, 4, 4);
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
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, &dummy, 0, UINT32_MAX, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "count=");
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, &dummy, UINT32_MAX, 1, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "window_len");
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, &dummy, (uint32_t)INT32_MAX - 2, 0, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "window_len");
        same_snapshot_at(__LINE__, ctx, &before);
        CHECK(dummy == 0);
        probe_lru(&L, 3);
    }
    check_stats(&L1);
    group_done("swap_in guards: NULL ctx/indices, layer, ids <0 and >=cap, count > gpu_chunks, NOT_STORED; state unchanged, LRU order intact");

    /* ---- store / store_batch guards ---- */
    uint8_t chunk[32];
    fill_chunk(chunk, 32, 0, 1, 99);
    Snapshot before = snapshot_at(__LINE__, ctx, 2);
    CHECK_ERR(kvswap_store(NULL, 0, 1, chunk, NULL), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_store");
    CHECK_ERR(kvswap_store(ctx, 0, 1, NULL, NULL), KVSWAP_STATUS_NULL_POINTER, "src");
    CHECK_ERR(kvswap_store(ctx, 2, 1, chunk, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    CHECK_ERR(kvswap_store(ctx, 0, -1, chunk, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "-1");
    CHECK_ERR(kvswap_store(ctx, 0, 16, chunk, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "16");
    CHECK_ERR(kvswap_store(ctx, 0, INT32_MIN, chunk, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "-2147483648");

    int32_t resident_id = L.model.slot_chunk[0];
    int32_t ids_bad[3] = {resident_id, 13, 99};
    uint8_t rows[3 * 32];
    fill_chunk(rows, 32, 0, (uint32_t)resident_id, 77);
    fill_chunk(rows + 32, 32, 0, 13, 77);
    fill_chunk(rows + 64, 32, 0, 99, 77);
    CHECK_ERR(kvswap_store_batch(NULL, 0, ids_bad, 2, rows, 0, NULL), KVSWAP_STATUS_NULL_POINTER, "ctx");
    CHECK_MSG("kvswap_store_batch");
    CHECK_ERR(kvswap_store_batch(ctx, 0, NULL, 2, rows, 0, NULL), KVSWAP_STATUS_NULL_POINTER, "ids");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 2, NULL, 0, NULL), KVSWAP_STATUS_NULL_POINTER, "src");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 0, rows, 0, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "n is 0");
    CHECK_ERR(kvswap_store_batch(ctx, 2, ids_bad, 2, rows, 0, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "layer 2");
    /* One bad id among good ones: nothing is stored (not 13, not the resident chunk). */
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 3, rows, 32, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "99");
    int32_t ids_neg[2] = {13, -7};
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_neg, 2, rows, 32, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "-7");
    CHECK_ERR(kvswap_store_batch(ctx, 0, ids_bad, 2, rows, 16, NULL), KVSWAP_STATUS_INVALID_ARGUMENT, "src_stride");
    same_snapshot_at(__LINE__, ctx, &before);
    check_staged(&L); /* the resident chunk still holds its old bytes */
    {
        int32_t buf[2] = {0, 13};
        CHECK_ERR(kvswap_swap_in_selected(ctx, 0, buf, 1, 1, NULL), KVSWAP_STATUS_NOT_STORED, "13");
        CHECK(buf[0] == 0 && buf[1] == 13);
    }
    same_snapshot_at(__LINE__, ctx, &before);
    probe_lru(&L, 5);
    check_stats(&L1);
    group_done("store / store_batch guards: NULLs, n 0, layer, ids, src_stride; nothing stored, slots not refreshed");

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
    CHECK_OK(kvswap_sync(ctx, NULL));
    same_snapshot_at(__LINE__, ctx, &before);
    probe_lru(&L, 7);
    check_stats(&L);
    check_stats(&L1);
    kvswap_destroy(ctx);
    group_done("layer_stats / layer_staging / sync / context_info guards; out-parameters untouched");
}

/* ---- asynchronous mode ---- */

static void test_async(void) {
    KvswapConfig cfg = cpu_config(1, 4, 4);
    cfg.sync = 0;
    KvswapLayerSpec specs[2] = {layer_spec(16, 32), layer_spec(16, 32)};
    KvswapContext *ctx = create_ok(&cfg, specs, 2);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    for (uint32_t id = 0; id < 9; id++) store_one(&L, id); /* 9.. never stored */

    /* 9 was never stored: its entry becomes -1, the rest proceed, OK. */
    int32_t buf[6] = {WIN_SENTINEL(0), WIN_SENTINEL(1), 1, 9, 2, 9};
    CHECK_OK(kvswap_swap_in_selected(ctx, 0, buf, 2, 4, NULL));
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
    CHECK_ERR(kvswap_sync(ctx, NULL), KVSWAP_STATUS_NOT_STORED, "chunk 9");
    CHECK_MSG("never stored");
    CHECK_OK(kvswap_sync(ctx, NULL));

    /* The same through layer_stats; its out-parameter is untouched on the error. */
    int32_t buf2[3] = {4, 10, 4};
    CHECK_OK(kvswap_swap_in_selected(ctx, 0, buf2, 0, 3, NULL));
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
    CHECK_OK(kvswap_swap_in_selected(ctx, 0, b3, 0, 1, NULL));
    CHECK_OK(kvswap_swap_in_selected(ctx, 0, b4, 0, 1, NULL));
    L.swap_calls += 2;
    int32_t none[1] = {-1};
    model_swap(&L.model, none, 1, 0);
    model_swap(&L.model, none, 1, 0);
    CHECK_EQ(b3[0], -1);
    CHECK_EQ(b4[0], -1);
    CHECK_ERR(kvswap_sync(ctx, NULL), KVSWAP_STATUS_NOT_STORED, "chunk 11");
    CHECK_OK(kvswap_sync(ctx, NULL));
    check_stats(&L);

    /* An out-of-range id in async mode is either refused at once (nothing
     * changed) or becomes -1 and is reported by the next sync. */
    int32_t b5[2] = {3, 16};
    enum KvswapStatus s = kvswap_swap_in_selected(ctx, 0, b5, 0, 2, NULL);
    if (s == KVSWAP_STATUS_OK) {
        L.swap_calls++;
        int32_t m5[2] = {3, -1};
        model_swap(&L.model, m5, 2, 0);
        CHECK_EQ(b5[0], m5[0]);
        CHECK_EQ(b5[1], -1);
        CHECK_ERR(kvswap_sync(ctx, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "16");
    } else {
        CHECK_EQ(s, KVSWAP_STATUS_OUT_OF_RANGE);
        CHECK_MSG("16");
        CHECK(b5[0] == 3 && b5[1] == 16);
    }
    CHECK_OK(kvswap_sync(ctx, NULL));
    /* Host-side guards are still immediate in async mode. */
    int32_t b6[5] = {0, 1, 2, 3, 4};
    CHECK_ERR(kvswap_swap_in_selected(ctx, 0, b6, 0, 5, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "count=5");
    CHECK_ERR(kvswap_swap_in_selected(ctx, 3, b6, 0, 1, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "layer 3");
    probe_lru(&L, 1);
    check_stats(&L);
    CHECK_OK(kvswap_sync(ctx, NULL));
    kvswap_destroy(ctx);
    group_done("async mode (sync=0): not-stored entry -> -1, call OK, next sync / layer_stats reports it once");
}

/* ---- swap off: every chunk resident at its own id ---- */

static void test_disabled(void) {
    for (int variant = 0; variant < 2; variant++) {
        /* variant 0: enable=0; variant 1: enable=1 but cap <= gpu_chunks. */
        KvswapConfig cfg = variant == 0 ? cpu_config(0, 4, 512) : cpu_config(1, 32, 32);
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
                CHECK_OK(kvswap_store(ctx, l, (int32_t)id, chunk, NULL));
            }
            s = stats_of(ctx, l);
            CHECK_EQ(s.resident, cap);
            /* With swap off, count is bounded by the layer's rows, not by
             * gpu_chunks (variant 0 has gpu_chunks 4 < count 7). */
            int32_t buf[3 + 7 + 1] = {WIN_SENTINEL(0), WIN_SENTINEL(1), WIN_SENTINEL(2), (int32_t)cap - 1, 3, 3, -1, 0, 5, 1,
                                      TAIL_SENTINEL};
            CHECK_OK(kvswap_swap_in_selected(ctx, l, buf, 3, 7, NULL));
            const int32_t want[7] = {3 + (int32_t)cap - 1, 3 + 3, 3 + 3, -1, 3 + 0, 3 + 5, 3 + 1};
            for (int i = 0; i < 3; i++) CHECK(buf[i] == WIN_SENTINEL(i));
            CHECK(buf[10] == TAIL_SENTINEL);
            for (int i = 0; i < 7; i++)
                if (buf[3 + i] != want[i]) FAIL("swap off, layer %u entry %d: %d, expected %d", l, i, buf[3 + i], want[i]);
            for (uint32_t id = 0; id < cap; id++)
                if (!chunk_is((const uint8_t *)ptr + id * stride, cb, l, id, 1)) FAIL("swap off: row %u is not chunk %u", id, id);
            s = stats_of(ctx, l);
            CHECK_EQ(s.misses, 0);
            CHECK_EQ(s.evictions, 0);
            CHECK_EQ(s.hits, 5); /* distinct: cap-1, 3, 0, 5, 1 */
            CHECK_EQ(s.swap_in_calls, 1);
            /* A new version is visible in its row at once. */
            fill_chunk(chunk, cb, l, 3, 2);
            CHECK_OK(kvswap_store(ctx, l, 3, chunk, NULL));
            CHECK(chunk_is((const uint8_t *)ptr + 3 * stride, cb, l, 3, 2));
            /* Guards still apply. */
            int32_t bad[2] = {(int32_t)cap, 0};
            CHECK_ERR(kvswap_swap_in_selected(ctx, l, bad, 0, 2, NULL), KVSWAP_STATUS_OUT_OF_RANGE, "");
            CHECK(bad[0] == (int32_t)cap && bad[1] == 0);
        }
        /* A chunk never stored cannot be selected even when swap is off. */
        KvswapLayerSpec one = layer_spec(8, 16);
        KvswapContext *c2 = create_ok(&cfg, &one, 1);
        int32_t b[2] = {0, 0};
        CHECK_ERR(kvswap_swap_in_selected(c2, 0, b, 0, 2, NULL), KVSWAP_STATUS_NOT_STORED, "0");
        kvswap_destroy(c2);
        kvswap_destroy(ctx);
    }
    group_done("swap off (enable=0, and cap <= gpu_chunks): slot == logical id, swap_enabled == 0");
}

/* ---- validate ---- */

static void test_validate(void) {
    KvswapConfig cfg = cpu_config(1, 4, 4);
    cfg.validate = 1;
    uint8_t engine[4 * 32];
    KvswapLayerSpec spec = layer_spec(16, 32);
    spec.staging = engine;
    KvswapContext *ctx = create_ok(&cfg, &spec, 1);
    Layer L;
    layer_init(&L, ctx, 0, 16, 4, 32);
    for (uint32_t id = 0; id < 16; id++) store_one(&L, id);
    const int32_t sel[3] = {3, 4, 5};
    swap_ok(&L, 0, 3, sel, NULL);
    /* Scribble on chunk 4's slot behind kvswap's back: the next hit is caught. */
    int32_t slot = L.model.chunk_slot[4];
    engine[slot * 32 + 7] ^= 0xFF;
    int32_t buf[1] = {4};
    CHECK_ERR(kvswap_swap_in_selected(ctx, 0, buf, 0, 1, NULL), KVSWAP_STATUS_VALIDATION_FAILED, "differs");
    kvswap_destroy(ctx);
    group_done("validate=1 passes on honest slots and catches a corrupted slot");
}

int main(void) {
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
    test_guards();
    test_async();
    test_disabled();
    test_validate();

    CHECK_OK(kvswap_set_log_callback(NULL, NULL));
    printf("test_abi (C11): all groups passed\n");
    return 0;
}
