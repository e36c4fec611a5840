// C++17 test of the kvswap C ABI (include/kvswap.h), on the CPU backend:
// RAII ownership of a context, std::vector buffers, the exact slots of a
// short scripted sequence, the NOT_STORED guard with an unchanged state, the
// thread-local kvswap_last_error(), and many threads hammering one context
// (8 threads on 8 own layers, checked exactly against a reference model,
// plus 2 threads sharing one layer, checked for consistency).
//
// Prints one line per test group; exits 1 at the first failure with
// file:line and the text of kvswap_last_error().

#include "kvswap.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

const char *last_err() {
    const char *e = kvswap_last_error();
    return e ? e : "(kvswap_last_error() returned NULL!)";
}

const char *sname(KvswapStatus s) { return kvswap_status_name(static_cast<int32_t>(s)); }

std::mutex g_fail_mutex;

[[noreturn]] void fail(const char *file, int line, const std::string &what) {
    std::lock_guard<std::mutex> lock(g_fail_mutex);
    std::fprintf(stderr, "%s:%d: FAILED: %s\n  kvswap_last_error(): \"%s\"\n", file, line, what.c_str(), last_err());
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(1);  // may be called from a worker thread: do not run destructors
}

#define FAIL(what) fail(__FILE__, __LINE__, (what))
#define CHECK(cond)                                                 \
    do {                                                            \
        if (!(cond)) FAIL(std::string("CHECK(") + #cond + ")");     \
    } while (0)
#define CHECK_EQ(a, b)                                                                                   \
    do {                                                                                                 \
        const long long a_ = static_cast<long long>(a), b_ = static_cast<long long>(b);                  \
        if (a_ != b_)                                                                                    \
            FAIL(std::string("CHECK_EQ(" #a ", " #b "): ") + std::to_string(a_) + " != " + std::to_string(b_)); \
    } while (0)
#define CHECK_OK(expr)                                                                                   \
    do {                                                                                                 \
        const KvswapStatus s_ = (expr);                                                                  \
        if (s_ != KVSWAP_STATUS_OK) FAIL(std::string(#expr " returned ") + sname(s_));                   \
    } while (0)
#define CHECK_ERR(expr, want, substr)                                                                    \
    do {                                                                                                 \
        const KvswapStatus s_ = (expr);                                                                  \
        if (s_ != (want)) FAIL(std::string(#expr " returned ") + sname(s_) + ", expected " + sname(want)); \
        if (!std::strstr(last_err(), (substr)))                                                          \
            FAIL(std::string("kvswap_last_error() does not contain \"") + (substr) + "\"");              \
    } while (0)

void group_done(const char *name) {
    std::printf("ok   %s\n", name);
    std::fflush(stdout);
}

// ---------------------------------------------------------------------------
// RAII ownership of a context
// ---------------------------------------------------------------------------

struct ContextDeleter {
    void operator()(KvswapContext *ctx) const noexcept { kvswap_destroy(ctx); }
};
using Context = std::unique_ptr<KvswapContext, ContextDeleter>;

KvswapConfig cpu_config(uint32_t enable, uint32_t gpu_chunks, uint32_t index_topk) {
    KvswapConfig c;
    CHECK_OK(kvswap_config_default(&c));
    c.backend = KVSWAP_BACKEND_CPU;
    c.enable = enable;
    c.gpu_chunks = gpu_chunks;
    c.index_topk = index_topk;
    return c;
}

KvswapLayerSpec layer_spec(uint64_t cap, uint64_t chunk_bytes) {
    KvswapLayerSpec s{};
    s.compressed_cap = cap;
    s.chunk_bytes = chunk_bytes;
    s.staging = nullptr;
    s.staging_stride = 0;
    return s;
}

Context make_context(const KvswapConfig &cfg, const std::vector<KvswapLayerSpec> &specs) {
    KvswapContext *raw = nullptr;
    CHECK_OK(kvswap_create(&cfg, specs.data(), specs.size(), &raw));
    CHECK(raw != nullptr);
    return Context(raw);
}

KvswapLayerStats stats_of(KvswapContext *ctx, uint32_t layer) {
    KvswapLayerStats s;
    std::memset(&s, 0xA5, sizeof s);
    CHECK_OK(kvswap_layer_stats(ctx, layer, &s));
    return s;
}

struct Staging {
    const uint8_t *ptr;
    size_t stride;
    uint32_t rows;
};

Staging staging_of(KvswapContext *ctx, uint32_t layer) {
    void *p = nullptr;
    size_t stride = 0;
    uint32_t rows = 0;
    CHECK_OK(kvswap_layer_staging(ctx, layer, &p, &stride, &rows));
    CHECK(p != nullptr);
    return Staging{static_cast<const uint8_t *>(p), stride, rows};
}

// ---------------------------------------------------------------------------
// Chunk contents: a deterministic function of (layer, id, version)
// ---------------------------------------------------------------------------

void fill_chunk(uint8_t *dst, size_t n, uint32_t layer, uint32_t id, uint32_t version) {
    uint32_t h = (layer + 1u) * 0x9E3779B1u ^ (id + 1u) * 0x85EBCA77u ^ (version + 1u) * 0xC2B2AE3Du;
    for (size_t i = 0; i < n; i++) {
        h = h * 1664525u + 1013904223u;
        dst[i] = static_cast<uint8_t>(h >> 24);
    }
}

std::vector<uint8_t> chunk(size_t n, uint32_t layer, uint32_t id, uint32_t version) {
    std::vector<uint8_t> v(n);
    fill_chunk(v.data(), n, layer, id, version);
    return v;
}

bool chunk_is(const uint8_t *p, size_t n, uint32_t layer, uint32_t id, uint32_t version) {
    return std::memcmp(p, chunk(n, layer, id, version).data(), n) == 0;
}

// ---------------------------------------------------------------------------
// Reference model of the residency rules of DESIGN.md
// ---------------------------------------------------------------------------

struct Model {
    uint32_t cap, slots;
    std::vector<int32_t> slot_chunk, chunk_slot;
    std::vector<uint64_t> last_used;  // 0: never used
    uint64_t t = 0, hits = 0, misses = 0, evictions = 0;

    Model(uint32_t cap_, uint32_t slots_)
        : cap(cap_), slots(slots_), slot_chunk(slots_, -1), chunk_slot(cap_, -1), last_used(slots_, 0) {}

    // Rewrites e (logical ids, -1 padding) to physical ids window + slot.
    void swap(std::vector<int32_t> &e, uint32_t window) {
        std::vector<bool> selected(slots, false);
        t++;
        for (int32_t id : e) {
            if (id == -1) continue;
            const int32_t s = chunk_slot[id];
            if (s >= 0 && !selected[s]) {
                selected[s] = true;
                hits++;
            }
        }
        for (int32_t &id : e) {
            if (id == -1) continue;
            int32_t s = chunk_slot[id];
            if (s < 0) {
                int32_t best = -1;
                for (uint32_t k = 0; k < slots; k++)
                    if (!selected[k] && (best < 0 || last_used[k] < last_used[best])) best = static_cast<int32_t>(k);
                if (best < 0) FAIL("model: more distinct ids than slots");
                s = best;
                if (slot_chunk[s] >= 0) {
                    chunk_slot[slot_chunk[s]] = -1;
                    evictions++;
                }
                slot_chunk[s] = id;
                chunk_slot[id] = s;
                selected[s] = true;
                misses++;
            }
            id = static_cast<int32_t>(window) + s;
        }
        for (uint32_t k = 0; k < slots; k++)
            if (selected[k]) last_used[k] = t;
    }

    uint32_t resident() const {
        return static_cast<uint32_t>(std::count_if(slot_chunk.begin(), slot_chunk.end(), [](int32_t c) { return c >= 0; }));
    }
};

std::string join(const std::vector<int32_t> &v) {
    std::string s;
    for (int32_t x : v) s += " " + std::to_string(x);
    return s;
}

// One swap-in through a std::vector index buffer: window entries, then the selection.
std::vector<int32_t> with_window(uint32_t window, const std::vector<int32_t> &sel) {
    std::vector<int32_t> buf(window, 0);
    for (uint32_t i = 0; i < window; i++) buf[i] = 90000 + static_cast<int32_t>(i);
    buf.insert(buf.end(), sel.begin(), sel.end());
    buf.push_back(0x5EED);  // past `count`: must stay untouched
    return buf;
}

// ---------------------------------------------------------------------------
// Test groups
// ---------------------------------------------------------------------------

void test_raii_script() {
    constexpr uint32_t CB = 64, CAP = 16, SLOTS = 4, STRIDE = CB + 16;
    Context ctx = make_context(cpu_config(1, SLOTS, SLOTS), {layer_spec(CAP, CB)});

    // All 16 chunks in one batch, from a buffer with a source stride > chunk_bytes.
    std::vector<uint8_t> src(CAP * STRIDE, 0xCC);
    std::vector<int32_t> ids(CAP);
    for (uint32_t i = 0; i < CAP; i++) {
        ids[i] = static_cast<int32_t>(i);
        fill_chunk(&src[i * STRIDE], CB, 0, i, 1);
    }
    CHECK_OK(kvswap_store_batch(ctx.get(), 0, ids.data(), ids.size(), src.data(), STRIDE, nullptr));

    struct Step {
        uint32_t window;
        std::vector<int32_t> sel, expected;
        uint64_t hits, misses, evictions;  // cumulative
    };
    // Hand-derived from DESIGN.md's rules (the same first steps as test_abi.c).
    const std::vector<Step> script = {
        {3, {5, 3, -1, 9}, {3, 4, -1, 5}, 0, 3, 0},
        {3, {7, 3, 8, 3}, {6, 4, 3, 4}, 1, 5, 1},
        {3, {9, 9, 9}, {5, 5, 5}, 2, 5, 1},
        {3, {10, 11, -1, -1}, {3, 4, -1, -1}, 2, 7, 3},
        {3, {3, 7, 12, 10}, {5, 6, 4, 3}, 4, 9, 5},
        {0, {13, 14, 15, 0}, {0, 1, 2, 3}, 4, 13, 9},
    };
    Model model(CAP, SLOTS);
    uint64_t calls = 0;
    for (const Step &st : script) {
        std::vector<int32_t> want = st.sel;
        model.swap(want, st.window);
        if (want != st.expected) FAIL("test bug: model" + join(want) + " vs script" + join(st.expected));
        std::vector<int32_t> buf = with_window(st.window, st.sel);
        CHECK_OK(kvswap_swap_in_selected(ctx.get(), 0, buf.data(), st.window, static_cast<uint32_t>(st.sel.size()), nullptr));
        calls++;
        std::vector<int32_t> got(buf.begin() + st.window, buf.end() - 1);
        if (got != st.expected) FAIL("selected" + join(st.sel) + ": got" + join(got) + ", expected" + join(st.expected));
        CHECK(buf == [&] {
            std::vector<int32_t> w = with_window(st.window, st.expected);
            return w;
        }());
        const KvswapLayerStats s = stats_of(ctx.get(), 0);
        CHECK_EQ(s.hits, st.hits);
        CHECK_EQ(s.misses, st.misses);
        CHECK_EQ(s.evictions, st.evictions);
        CHECK_EQ(s.swap_in_calls, calls);
        CHECK_EQ(s.h2d_bytes, st.misses * CB);
        CHECK_EQ(s.stores, CAP);
        const Staging stg = staging_of(ctx.get(), 0);
        for (size_t i = 0; i < st.sel.size(); i++) {
            if (st.sel[i] < 0) continue;
            const uint32_t slot = static_cast<uint32_t>(got[i]) - st.window;
            CHECK(chunk_is(stg.ptr + slot * stg.stride, CB, 0, static_cast<uint32_t>(st.sel[i]), 1));
        }
    }
    KvswapContextInfo info{};
    CHECK_OK(kvswap_context_info(ctx.get(), &info));
    CHECK_EQ(info.backend, KVSWAP_BACKEND_CPU);
    CHECK_EQ(info.n_layers, 1);
    CHECK_EQ(info.swap_layers, 1);
    CHECK_OK(kvswap_sync(ctx.get(), nullptr));

    // Moving the owner moves the handle; reset() destroys it; an empty owner is fine.
    Context other = std::move(ctx);
    CHECK(ctx == nullptr);
    CHECK(other != nullptr);
    other.reset();
    Context empty;
    group_done("C++: RAII context, store_batch from std::vector, exact slots of a scripted sequence, stats");
}

void test_not_stored_guard() {
    constexpr uint32_t CB = 32, CAP = 16, SLOTS = 4;
    Context ctx = make_context(cpu_config(1, SLOTS, SLOTS), {layer_spec(CAP, CB), layer_spec(CAP, CB)});
    for (uint32_t id = 0; id < 8; id++) {  // 8..15 never stored
        const std::vector<uint8_t> c = chunk(CB, 0, id, 1);
        CHECK_OK(kvswap_store(ctx.get(), 0, static_cast<int32_t>(id), c.data(), nullptr));
    }
    Model model(CAP, SLOTS);
    auto swap_ok = [&](uint32_t window, std::vector<int32_t> sel) {
        std::vector<int32_t> buf = with_window(window, sel);
        model.swap(sel, window);
        CHECK_OK(kvswap_swap_in_selected(ctx.get(), 0, buf.data(), window, static_cast<uint32_t>(sel.size()), nullptr));
        std::vector<int32_t> got(buf.begin() + window, buf.end() - 1);
        if (got != sel) FAIL("got" + join(got) + ", model" + join(sel));
    };
    swap_ok(1, {1, 2, 3, 4});
    swap_ok(1, {5, 2, 6});
    // Slots now: s0=5, s1=2, s2=6, s3=4; LRU order s3 (call 1), then s0, s1, s2 (call 2).

    std::vector<int32_t> sel = {4, 0, 12};  // a resident chunk, a stored one, a never-stored one
    std::vector<int32_t> buf = with_window(2, sel);
    const std::vector<int32_t> before_buf = buf;
    const KvswapLayerStats before0 = stats_of(ctx.get(), 0), before1 = stats_of(ctx.get(), 1);
    CHECK_ERR(kvswap_swap_in_selected(ctx.get(), 0, buf.data(), 2, 3, nullptr), KVSWAP_STATUS_NOT_STORED, "12");
    CHECK(buf == before_buf);
    KvswapLayerStats after0 = stats_of(ctx.get(), 0), after1 = stats_of(ctx.get(), 1);
    CHECK(std::memcmp(&before0, &after0, sizeof before0) == 0);
    CHECK(std::memcmp(&before1, &after1, sizeof before1) == 0);
    // The LRU order is intact: four misses take s3, s0, s1, s2 in that order.
    swap_ok(0, {7, 0, 1, 3});
    CHECK(model.slot_chunk == (std::vector<int32_t>{0, 1, 3, 7}));
    const KvswapLayerStats s = stats_of(ctx.get(), 0);
    CHECK_EQ(s.hits, model.hits);
    CHECK_EQ(s.misses, model.misses);
    CHECK_EQ(s.evictions, model.evictions);
    group_done("C++: NOT_STORED guard leaves the index buffer, the counters and the LRU order unchanged");
}

void test_last_error_is_per_thread() {
    CHECK_ERR(kvswap_sync(nullptr, nullptr), KVSWAP_STATUS_NULL_POINTER, "kvswap_sync");
    const std::string mine = last_err();
    std::string theirs_before, theirs_after;
    std::thread t([&] {
        theirs_before = kvswap_last_error();
        (void)kvswap_set_log_level(42);
        theirs_after = kvswap_last_error();
    });
    t.join();
    CHECK(theirs_before.empty());
    CHECK(theirs_after.find("kvswap_set_log_level") != std::string::npos);
    CHECK(mine == last_err());
    group_done("C++: kvswap_last_error() is per thread");
}

// ---------------------------------------------------------------------------
// Many threads on one context
// ---------------------------------------------------------------------------

class Barrier {
  public:
    explicit Barrier(int n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m_);
        const unsigned gen = gen_;
        if (++count_ == n_) {
            count_ = 0;
            gen_++;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return gen != gen_; });
        }
    }

  private:
    std::mutex m_;
    std::condition_variable cv_;
    int n_, count_ = 0;
    unsigned gen_ = 0;
};

constexpr uint32_t MT_OWN_LAYERS = 8, MT_SHARED = 8, MT_CAP = 64, MT_SLOTS = 8, MT_CB = 48;

int iterations() {
    const char *e = std::getenv("KVSWAP_FFI_TEST_ITERS");
    const int n = e ? std::atoi(e) : 0;
    return n > 0 ? n : 2000;
}

// A thread that owns `layer`: every call is checked exactly against the model.
void own_layer_worker(KvswapContext *ctx, uint32_t layer, int iters) {
    std::mt19937 rng(1000 + layer);
    auto rnd = [&](uint32_t n) { return n ? static_cast<uint32_t>(rng() % n) : 0u; };
    Model model(MT_CAP, MT_SLOTS);
    std::vector<uint32_t> version(MT_CAP, 0);
    uint64_t stores = 0, calls = 0;
    const uint32_t stride = MT_CB + 8;

    auto store = [&](uint32_t id) {
        const std::vector<uint8_t> c = chunk(MT_CB, layer, id, version[id] + 1);
        CHECK_OK(kvswap_store(ctx, layer, static_cast<int32_t>(id), c.data(), nullptr));
        version[id]++;
        stores++;
    };
    auto stored_id = [&]() {
        uint32_t id;
        do id = rnd(MT_CAP);
        while (version[id] == 0);
        return static_cast<int32_t>(id);
    };
    for (uint32_t id = 0; id < MT_CAP; id += 2) store(id);  // odd ids come later

    for (int it = 0; it < iters; it++) {
        const uint32_t op = rnd(10);
        if (op <= 1) {
            store(rnd(MT_CAP));
        } else if (op == 2) {
            // A batch of distinct ids from a strided std::vector.
            std::vector<int32_t> ids;
            const uint32_t n = 1 + rnd(4);
            while (ids.size() < n) {
                const int32_t id = static_cast<int32_t>(rnd(MT_CAP));
                if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
            }
            std::vector<uint8_t> src(n * stride, 0xAB);
            for (uint32_t i = 0; i < n; i++) fill_chunk(&src[i * stride], MT_CB, layer, static_cast<uint32_t>(ids[i]), version[ids[i]] + 1);
            CHECK_OK(kvswap_store_batch(ctx, layer, ids.data(), n, src.data(), stride, nullptr));
            for (int32_t id : ids) version[id]++;
            stores += n;
        } else if (op == 3) {
            // A never-stored chunk among stored ones: refused, nothing changes.
            int32_t unstored = -1;
            for (uint32_t k = 0; k < MT_CAP && unstored < 0; k++) {
                const uint32_t id = (k + rnd(MT_CAP)) % MT_CAP;
                if (version[id] == 0) unstored = static_cast<int32_t>(id);
            }
            if (unstored < 0) continue;
            std::vector<int32_t> sel = {stored_id(), stored_id(), unstored};
            std::vector<int32_t> buf = with_window(rnd(4), sel);
            const std::vector<int32_t> copy = buf;
            const uint32_t window = static_cast<uint32_t>(buf.size() - sel.size() - 1);
            const KvswapLayerStats before = stats_of(ctx, layer);
            CHECK_ERR(kvswap_swap_in_selected(ctx, layer, buf.data(), window, 3, nullptr), KVSWAP_STATUS_NOT_STORED, "never stored");
            CHECK(buf == copy);
            const KvswapLayerStats after = stats_of(ctx, layer);
            CHECK(std::memcmp(&before, &after, sizeof before) == 0);
        } else {
            const uint32_t count = rnd(MT_SLOTS + 1), window = rnd(9);
            std::vector<int32_t> sel(count);
            for (uint32_t i = 0; i < count; i++) {
                const uint32_t r = rnd(10);
                sel[i] = r == 0 ? -1 : (r <= 2 && i > 0) ? sel[rnd(i)] : stored_id();
            }
            std::vector<int32_t> want = sel;
            model.swap(want, window);
            std::vector<int32_t> buf = with_window(window, sel);
            CHECK_OK(kvswap_swap_in_selected(ctx, layer, buf.data(), window, count, nullptr));
            calls++;
            std::vector<int32_t> got(buf.begin() + window, buf.end() - 1);
            if (got != want)
                FAIL("layer " + std::to_string(layer) + " selected" + join(sel) + ": got" + join(got) + ", expected" + join(want));
            CHECK(buf.back() == 0x5EED);
            const Staging stg = staging_of(ctx, layer);
            for (uint32_t i = 0; i < count; i++) {
                if (sel[i] < 0) continue;
                CHECK(got[i] >= static_cast<int32_t>(window) && got[i] < static_cast<int32_t>(window + MT_SLOTS));
                const uint32_t slot = static_cast<uint32_t>(got[i]) - window;
                if (!chunk_is(stg.ptr + slot * stg.stride, MT_CB, layer, static_cast<uint32_t>(sel[i]), version[sel[i]]))
                    FAIL("layer " + std::to_string(layer) + " slot " + std::to_string(slot) + ": staged bytes are not chunk " +
                         std::to_string(sel[i]) + " version " + std::to_string(version[sel[i]]));
            }
        }
    }
    const KvswapLayerStats s = stats_of(ctx, layer);
    CHECK_EQ(s.hits, model.hits);
    CHECK_EQ(s.misses, model.misses);
    CHECK_EQ(s.evictions, model.evictions);
    CHECK_EQ(s.stores, stores);
    CHECK_EQ(s.swap_in_calls, calls);
    CHECK_EQ(s.resident, model.resident());
    CHECK_EQ(s.h2d_bytes, model.misses * MT_CB);
    CHECK_EQ(s.d2h_bytes, stores * MT_CB);
}

struct SharedLayer {
    std::atomic<uint32_t> version[MT_CAP];  // one writer per id (id % 2 == thread parity)
    std::atomic<uint64_t> stores{0}, calls{0}, selected_distinct{0}, verified{0};
    Barrier barrier{2};
    SharedLayer() {
        for (auto &v : version) v.store(0);
    }
};

// Two threads share one layer. During the concurrent phase only the returned
// ids are checked (range, duplicates, distinctness): another thread may evict
// or refresh a slot at any time, so reading staged bytes then would race. At
// quiescent points (both threads at a barrier) one thread swaps in a set of
// chunks and checks their staged bytes against the version last stored.
void shared_layer_worker(KvswapContext *ctx, SharedLayer *sh, uint32_t parity, int iters) {
    const uint32_t layer = MT_SHARED;
    std::mt19937 rng(77 + parity);
    auto rnd = [&](uint32_t n) { return n ? static_cast<uint32_t>(rng() % n) : 0u; };
    auto store = [&](uint32_t id) {  // id % 2 == parity
        const uint32_t v = sh->version[id].load(std::memory_order_relaxed) + 1;
        const std::vector<uint8_t> c = chunk(MT_CB, layer, id, v);
        CHECK_OK(kvswap_store(ctx, layer, static_cast<int32_t>(id), c.data(), nullptr));
        sh->version[id].store(v, std::memory_order_release);
        sh->stores++;
    };
    auto my_id = [&]() { return 2 * rnd(MT_CAP / 2) + parity; };
    for (uint32_t k = 0; k < 8; k++) store(2 * k + parity);
    sh->barrier.wait();

    for (int it = 0; it < iters; it++) {
        if (it % 50 == 49) {
            sh->barrier.wait();
            if (static_cast<uint32_t>(it / 50) % 2 == parity) {
                // Quiescent: nobody else touches the layer until the next barrier.
                std::vector<int32_t> sel;
                for (uint32_t id = rnd(MT_CAP); sel.size() < MT_SLOTS; id = (id + 1 + rnd(3)) % MT_CAP) {
                    if (sh->version[id].load(std::memory_order_acquire) > 0 &&
                        std::find(sel.begin(), sel.end(), static_cast<int32_t>(id)) == sel.end())
                        sel.push_back(static_cast<int32_t>(id));
                }
                std::vector<int32_t> buf = with_window(2, sel);
                CHECK_OK(kvswap_swap_in_selected(ctx, layer, buf.data(), 2, MT_SLOTS, nullptr));
                sh->calls++;
                sh->selected_distinct += MT_SLOTS;
                const Staging stg = staging_of(ctx, layer);
                std::vector<bool> seen(MT_SLOTS, false);
                for (uint32_t i = 0; i < MT_SLOTS; i++) {
                    const int32_t phys = buf[2 + i];
                    CHECK(phys >= 2 && phys < 2 + static_cast<int32_t>(MT_SLOTS));
                    CHECK(!seen[phys - 2]);
                    seen[phys - 2] = true;
                    const uint32_t id = static_cast<uint32_t>(sel[i]);
                    if (!chunk_is(stg.ptr + (phys - 2) * stg.stride, MT_CB, layer, id, sh->version[id].load()))
                        FAIL("shared layer: staged bytes of chunk " + std::to_string(id) + " are not its last stored version");
                }
                sh->verified++;
            }
            sh->barrier.wait();
            continue;
        }
        const uint32_t op = rnd(4);
        if (op == 0) {
            store(my_id());
        } else {
            const uint32_t count = rnd(MT_SLOTS + 1), window = rnd(5);
            std::vector<int32_t> sel(count);
            for (uint32_t i = 0; i < count; i++) {
                const uint32_t id = rnd(MT_CAP), r = rnd(8);
                if (r == 0 || sh->version[id].load(std::memory_order_acquire) == 0) sel[i] = -1;
                else if (r == 1 && i > 0) sel[i] = sel[rnd(i)];
                else sel[i] = static_cast<int32_t>(id);
            }
            std::vector<int32_t> buf = with_window(window, sel);
            CHECK_OK(kvswap_swap_in_selected(ctx, layer, buf.data(), window, count, nullptr));
            sh->calls++;
            CHECK(buf.back() == 0x5EED);
            std::vector<int32_t> slot_of(MT_CAP, -1), chunk_in(MT_SLOTS, -1);
            uint64_t distinct = 0;
            for (uint32_t i = 0; i < count; i++) {
                const int32_t phys = buf[window + i];
                if (sel[i] == -1) {
                    CHECK(phys == -1);
                    continue;
                }
                CHECK(phys >= static_cast<int32_t>(window) && phys < static_cast<int32_t>(window + MT_SLOTS));
                const int32_t slot = phys - static_cast<int32_t>(window);
                if (slot_of[sel[i]] < 0) {
                    CHECK(chunk_in[slot] < 0);  // distinct ids get distinct slots
                    slot_of[sel[i]] = slot;
                    chunk_in[slot] = sel[i];
                    distinct++;
                } else {
                    CHECK(slot_of[sel[i]] == slot);  // a duplicate maps to the same slot
                }
            }
            sh->selected_distinct += distinct;
        }
    }
}

std::atomic<uint64_t> g_log_lines{0};
int g_log_token;
void count_log(uint32_t level, const char *line, void *user_data) {
    if (user_data != &g_log_token || line == nullptr || level < 1 || level > 5) std::abort();
    g_log_lines++;
}

void test_threads() {
    const int iters = iterations();
    // Log lines may come from any thread that calls into kvswap.
    CHECK_OK(kvswap_set_log_callback(count_log, &g_log_token));
    std::vector<KvswapLayerSpec> specs(MT_OWN_LAYERS + 1, layer_spec(MT_CAP, MT_CB));
    Context ctx = make_context(cpu_config(1, MT_SLOTS, MT_SLOTS), specs);
    SharedLayer shared;
    std::vector<std::thread> threads;
    for (uint32_t l = 0; l < MT_OWN_LAYERS; l++) threads.emplace_back(own_layer_worker, ctx.get(), l, iters);
    for (uint32_t p = 0; p < 2; p++) threads.emplace_back(shared_layer_worker, ctx.get(), &shared, p, iters);
    for (std::thread &t : threads) t.join();

    const KvswapLayerStats s = stats_of(ctx.get(), MT_SHARED);
    CHECK_EQ(s.swap_in_calls, shared.calls.load());
    CHECK_EQ(s.stores, shared.stores.load());
    CHECK_EQ(s.hits + s.misses, shared.selected_distinct.load());
    CHECK(s.evictions <= s.misses);
    CHECK(s.resident <= MT_SLOTS);
    CHECK_EQ(s.h2d_bytes, s.misses * MT_CB);
    CHECK(shared.verified.load() == static_cast<uint64_t>(iters / 50));
    CHECK_OK(kvswap_sync(ctx.get(), nullptr));

    // The stats lines of destroy go through the callback.
    CHECK(g_log_lines.load() >= 1);  // the creation line
    g_log_lines = 0;
    ctx.reset();
    CHECK(g_log_lines.load() >= MT_OWN_LAYERS + 1);
    CHECK_OK(kvswap_set_log_callback(nullptr, nullptr));
    std::printf("ok   C++: %u threads on %u own layers (exact vs model) + 2 threads on a shared layer, %d iterations each\n",
                MT_OWN_LAYERS, MT_OWN_LAYERS, iters);
    std::fflush(stdout);
}

}  // namespace

int main() {
    CHECK(std::string(kvswap_last_error()).empty());
    CHECK(std::strlen(kvswap_version()) > 0);
    CHECK_OK(kvswap_set_log_level(2));  // keep creation lines off stderr
    test_raii_script();
    test_not_stored_guard();
    test_last_error_is_per_thread();
    CHECK_OK(kvswap_set_log_level(3));
    test_threads();
    std::printf("test_abi (C++17): all groups passed\n");
    return 0;
}
