// C++17 test of the kvswap C ABI (include/kvswap.h), on the backend that
// KVSWAP_TEST_BACKEND selects: cpu (default) or cuda (see devmem.h).
// RAII ownership of a context, std::vector buffers, the exact slots of a
// short scripted sequence, the NOT_STORED guard with an unchanged state, the
// thread-local kvswap_last_error(), and many threads hammering one context
// (8 threads on 8 own layers, checked exactly against a reference model,
// plus 2 threads sharing one layer, checked for consistency), and a
// FlashMemory scorer owned by a unique_ptr, checked against the tie rule
// (KVSWAP_TEST_FM_CKPT names the checkpoint; see test_abi.c).
//
// Every buffer handed to kvswap goes through the devmem adapter (device
// memory on CUDA, uploaded before a call and read back after it); on CUDA
// each thread has its own CUstream and its own device buffers.
//
// Prints one line per test group; exits 1 at the first failure with
// file:line and the text of kvswap_last_error().

#include "kvswap.h"
#include "devmem.h"

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
#include <chrono>
#include <vector>

namespace {

// Random inputs come from a fresh seed each run (KVSWAP_SEED replays one;
// main prints it).
uint32_t g_seed = 0;

uint32_t test_seed() {
    const char *s = std::getenv("KVSWAP_SEED");
    if (s != nullptr && *s != '\0') return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
    return static_cast<uint32_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count());
}

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

// The defaults, on the backend under test (dm_backend()).
KvswapConfig test_config(uint32_t enable, uint32_t gpu_chunks, uint32_t index_topk) {
    KvswapConfig c;
    CHECK_OK(kvswap_config_default(&c));
    c.backend = dm_backend();
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

// Where a layer's staging rows are (device memory on CUDA: read them with
// Dev::rows).
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
// Buffers handed to kvswap, through the devmem adapter
// ---------------------------------------------------------------------------

// A reusable "device" buffer. On the CPU backend it is reallocated at the
// exact size of each use (so ASan and valgrind see any access past what a
// call may touch); on CUDA it only grows (cuMemFree waits for the device).
class Scratch {
  public:
    Scratch() = default;
    Scratch(const Scratch &) = delete;
    Scratch &operator=(const Scratch &) = delete;
    ~Scratch() { dm_free(p_); }
    void *get(size_t n) {
        if (p_ && (dm_is_cuda() ? n <= cap_ : n == cap_)) return p_;
        dm_free(p_);
        p_ = dm_alloc(n);
        cap_ = n;
        return p_;
    }

  private:
    void *p_ = nullptr;
    size_t cap_ = 0;
};

// One stream (the stream every kvswap call of its user gets: NULL on the CPU
// backend) and device buffers for index lists and store sources. Uploads,
// kvswap calls and downloads are all ordered on that stream; downloads wait
// for it. Used by one thread at a time.
class Dev {
  public:
    // `owned`: a stream from dm_stream_new(), destroyed with this object.
    Dev(void *stream, bool owned) : stream_(stream), owned_(owned) {}
    Dev(const Dev &) = delete;
    Dev &operator=(const Dev &) = delete;
    ~Dev() {
        if (owned_) dm_stream_free(stream_);  // the buffers go after it (dm_free waits for the device)
    }

    void *stream() const { return stream_; }
    void sync() const { dm_stream_sync(stream_); }

    KvswapStatus store(KvswapContext *ctx, uint32_t layer, int32_t id, const std::vector<uint8_t> &src) {
        void *d = src_.get(src.size());
        dm_upload_s(stream_, d, src.data(), src.size());
        return kvswap_store(ctx, layer, id, d, stream_);
    }

    // `ids` stay host memory; `src` (rows and what lies between them) is uploaded.
    KvswapStatus store_batch(KvswapContext *ctx, uint32_t layer, const std::vector<int32_t> &ids,
                             const std::vector<uint8_t> &src, size_t src_stride) {
        void *d = src_.get(src.size());
        dm_upload_s(stream_, d, src.data(), src.size());
        return kvswap_store_batch(ctx, layer, ids.data(), ids.size(), d, src_stride, stream_);
    }

    // swap_in_selected over all of `buf` (window, selection, anything after):
    // uploaded before the call, read back into `buf` after it, whatever its
    // outcome.
    KvswapStatus swap(KvswapContext *ctx, uint32_t layer, std::vector<int32_t> &buf, uint32_t window, uint32_t count) {
        const size_t bytes = buf.size() * sizeof(int32_t);
        int32_t *d = static_cast<int32_t *>(idx_.get(bytes));
        dm_upload_s(stream_, d, buf.data(), bytes);
        const KvswapStatus s = kvswap_swap_in_selected(ctx, layer, d, window, count, stream_);
        dm_stream_sync(stream_);
        dm_download_s(stream_, buf.data(), d, bytes);
        return s;
    }

    // A host copy of the staging rows (row r at r * stg.stride), read after
    // this stream is synchronised.
    std::vector<uint8_t> rows(const Staging &stg, size_t chunk_bytes) const {
        CHECK(stg.rows > 0);
        std::vector<uint8_t> h(static_cast<size_t>(stg.rows - 1) * stg.stride + chunk_bytes);
        dm_stream_sync(stream_);
        dm_download_s(stream_, h.data(), stg.ptr, h.size());
        return h;
    }

  private:
    void *stream_;
    bool owned_;
    Scratch idx_, src_;
};

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
    Dev dev(dm_stream(), false);
    Context ctx = make_context(test_config(1, SLOTS, SLOTS), {layer_spec(CAP, CB)});

    // All 16 chunks in one batch, from a buffer with a source stride > chunk_bytes.
    std::vector<uint8_t> src(CAP * STRIDE, 0xCC);
    std::vector<int32_t> ids(CAP);
    for (uint32_t i = 0; i < CAP; i++) {
        ids[i] = static_cast<int32_t>(i);
        fill_chunk(&src[i * STRIDE], CB, 0, i, 1);
    }
    CHECK_OK(dev.store_batch(ctx.get(), 0, ids, src, STRIDE));

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
        CHECK_OK(dev.swap(ctx.get(), 0, buf, st.window, static_cast<uint32_t>(st.sel.size())));
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
        const std::vector<uint8_t> rows = dev.rows(stg, CB);
        for (size_t i = 0; i < st.sel.size(); i++) {
            if (st.sel[i] < 0) continue;
            const uint32_t slot = static_cast<uint32_t>(got[i]) - st.window;
            CHECK(chunk_is(rows.data() + slot * stg.stride, CB, 0, static_cast<uint32_t>(st.sel[i]), 1));
        }
    }
    KvswapContextInfo info{};
    CHECK_OK(kvswap_context_info(ctx.get(), &info));
    CHECK_EQ(info.backend, dm_backend());
    CHECK_EQ(info.n_layers, 1);
    CHECK_EQ(info.swap_layers, 1);
    CHECK_OK(kvswap_sync(ctx.get(), dev.stream()));

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
    Dev dev(dm_stream(), false);
    Context ctx = make_context(test_config(1, SLOTS, SLOTS), {layer_spec(CAP, CB), layer_spec(CAP, CB)});
    for (uint32_t id = 0; id < 8; id++) {  // 8..15 never stored
        CHECK_OK(dev.store(ctx.get(), 0, static_cast<int32_t>(id), chunk(CB, 0, id, 1)));
    }
    Model model(CAP, SLOTS);
    auto swap_ok = [&](uint32_t window, std::vector<int32_t> sel) {
        std::vector<int32_t> buf = with_window(window, sel);
        model.swap(sel, window);
        CHECK_OK(dev.swap(ctx.get(), 0, buf, window, static_cast<uint32_t>(sel.size())));
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
    CHECK_ERR(dev.swap(ctx.get(), 0, buf, 2, 3), KVSWAP_STATUS_NOT_STORED, "12");
    CHECK(buf == before_buf);  // read back from the device
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
// On CUDA it has a stream and device buffers of its own.
void own_layer_worker(KvswapContext *ctx, uint32_t layer, int iters) {
    Dev dev(dm_stream_new(), true);
    std::mt19937 rng(g_seed + 1000 + layer);
    auto rnd = [&](uint32_t n) { return n ? static_cast<uint32_t>(rng() % n) : 0u; };
    Model model(MT_CAP, MT_SLOTS);
    std::vector<uint32_t> version(MT_CAP, 0);
    uint64_t stores = 0, calls = 0;
    const uint32_t stride = MT_CB + 8;

    auto store = [&](uint32_t id) {
        CHECK_OK(dev.store(ctx, layer, static_cast<int32_t>(id), chunk(MT_CB, layer, id, version[id] + 1)));
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
            CHECK_OK(dev.store_batch(ctx, layer, ids, src, stride));
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
            CHECK_ERR(dev.swap(ctx, layer, buf, window, 3), KVSWAP_STATUS_NOT_STORED, "never stored");
            CHECK(buf == copy);  // read back from the device
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
            CHECK_OK(dev.swap(ctx, layer, buf, window, count));
            calls++;
            std::vector<int32_t> got(buf.begin() + window, buf.end() - 1);
            if (got != want)
                FAIL("layer " + std::to_string(layer) + " selected" + join(sel) + ": got" + join(got) + ", expected" + join(want));
            CHECK(buf.back() == 0x5EED);
            const Staging stg = staging_of(ctx, layer);
            const std::vector<uint8_t> rows = dev.rows(stg, MT_CB);
            for (uint32_t i = 0; i < count; i++) {
                if (sel[i] < 0) continue;
                CHECK(got[i] >= static_cast<int32_t>(window) && got[i] < static_cast<int32_t>(window + MT_SLOTS));
                const uint32_t slot = static_cast<uint32_t>(got[i]) - window;
                if (!chunk_is(rows.data() + slot * stg.stride, MT_CB, layer, static_cast<uint32_t>(sel[i]), version[sel[i]]))
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
//
// On CUDA each thread has its own stream. A store is device work on the
// storing thread's stream, so, as an engine would, the thread waits for its
// stream before it publishes the new version to the other thread (whose
// swap-ins on another stream are not ordered after that store otherwise).
void shared_layer_worker(KvswapContext *ctx, SharedLayer *sh, uint32_t parity, int iters) {
    Dev dev(dm_stream_new(), true);
    const uint32_t layer = MT_SHARED;
    std::mt19937 rng(g_seed + 77 + parity);
    auto rnd = [&](uint32_t n) { return n ? static_cast<uint32_t>(rng() % n) : 0u; };
    auto store = [&](uint32_t id) {  // id % 2 == parity
        const uint32_t v = sh->version[id].load(std::memory_order_relaxed) + 1;
        CHECK_OK(dev.store(ctx, layer, static_cast<int32_t>(id), chunk(MT_CB, layer, id, v)));
        dev.sync();  // the store is done on the device before others may select it
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
                CHECK_OK(dev.swap(ctx, layer, buf, 2, MT_SLOTS));
                sh->calls++;
                sh->selected_distinct += MT_SLOTS;
                const Staging stg = staging_of(ctx, layer);
                const std::vector<uint8_t> rows = dev.rows(stg, MT_CB);
                std::vector<bool> seen(MT_SLOTS, false);
                for (uint32_t i = 0; i < MT_SLOTS; i++) {
                    const int32_t phys = buf[2 + i];
                    CHECK(phys >= 2 && phys < 2 + static_cast<int32_t>(MT_SLOTS));
                    CHECK(!seen[phys - 2]);
                    seen[phys - 2] = true;
                    const uint32_t id = static_cast<uint32_t>(sel[i]);
                    if (!chunk_is(rows.data() + (phys - 2) * stg.stride, MT_CB, layer, id, sh->version[id].load()))
                        FAIL("shared layer: staged bytes of chunk " + std::to_string(id) + " are not its last stored version" +
                             (dm_is_cuda() ? " (CUDA: a store on one thread's stream racing a swap-in on the other's?)" : ""));
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
            CHECK_OK(dev.swap(ctx, layer, buf, window, count));
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
    Context ctx = make_context(test_config(1, MT_SLOTS, MT_SLOTS), specs);
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
    CHECK_OK(kvswap_sync(ctx.get(), dm_stream()));

    // The stats lines of destroy go through the callback.
    CHECK(g_log_lines.load() >= 1);  // the creation line
    g_log_lines = 0;
    ctx.reset();
    CHECK(g_log_lines.load() >= MT_OWN_LAYERS + 1);
    CHECK_OK(kvswap_set_log_callback(nullptr, nullptr));
    std::printf("ok   C++: %u threads on %u own layers (exact vs model) + 2 threads on a shared layer, %d iterations each%s\n",
                MT_OWN_LAYERS, MT_OWN_LAYERS, iters, dm_is_cuda() ? ", one CUstream per thread" : "");
    std::fflush(stdout);
}

// ---------------------------------------------------------------------------
// FlashMemory scorer: RAII ownership and the tie rule
// ---------------------------------------------------------------------------

struct ScorerDeleter {
    void operator()(FmScorer *s) const noexcept { fm_scorer_free(s); }
};
using Scorer = std::unique_ptr<FmScorer, ScorerDeleter>;

// Device 0 on CUDA, the CPU (-1) otherwise.
Scorer load_scorer(const char *path) {
    FmScorer *raw = nullptr;
    CHECK_OK(fm_scorer_load(path, dm_is_cuda() ? 0 : -1, &raw));
    CHECK(raw != nullptr);
    return Scorer(raw);
}

// A device buffer (host memory on the CPU backend) holding a copy of `v`.
class DevBuf {
  public:
    template <typename T>
    explicit DevBuf(const std::vector<T> &v, void *stream) : bytes_(v.size() * sizeof(T)), p_(dm_alloc(bytes_)) {
        dm_upload_s(stream, p_, v.data(), bytes_);
    }
    DevBuf(const DevBuf &) = delete;
    DevBuf &operator=(const DevBuf &) = delete;
    ~DevBuf() { dm_free(p_); }
    template <typename T>
    T *get() const {
        return static_cast<T *>(p_);
    }
    template <typename T>
    void read(std::vector<T> &v, void *stream) const {
        dm_stream_sync(stream);
        dm_download_s(stream, v.data(), p_, v.size() * sizeof(T));
    }

  private:
    size_t bytes_;
    void *p_;
};

uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// fm_score_topk of bf16 keys (n rows of head_dim) on `stream`; the result.
std::vector<int32_t> score_topk(const FmScorer *s, const std::vector<float> &hidden, const std::vector<uint16_t> &keys,
                                size_t n, uint32_t k, void *stream) {
    DevBuf dh(hidden, stream), dk(keys, stream);
    std::vector<int32_t> out(k, -7);
    DevBuf dout(out, stream);
    FmKeys fk{};
    fk.data = dk.get<void>();
    fk.scales = nullptr;
    fk.row_stride_bytes = 0;
    fk.dtype = FM_KEYS_BF16;
    CHECK_OK(fm_score_topk(s, dh.get<float>(), &fk, n, k, dout.get<int32_t>(), stream));
    dout.read(out, stream);
    return out;
}

// The keys: rows 0, 2, 4, ... are one random key K, rows 1, 3, 5, ... are
// zero. Every K row has the same score S (unknown without the weights), every
// zero row scores exactly 0. The tie rule (score descending, ties to the lower
// id, -1 padding) then gives: S > 0: the even ids, then the odd ones; S < 0:
// odd, then even; S == 0: 0, 1, 2, ... The result must be one of them.
std::vector<int32_t> tie_rule(size_t n, uint32_t k, int sign_of_s) {
    std::vector<int32_t> ids;
    if (sign_of_s == 0) {
        for (size_t i = 0; i < n; i++) ids.push_back(static_cast<int32_t>(i));
    } else {
        const size_t first = sign_of_s > 0 ? 0 : 1;
        for (size_t parity : {first, 1 - first})
            for (size_t i = parity; i < n; i += 2) ids.push_back(static_cast<int32_t>(i));
    }
    ids.resize(k, -1);
    return ids;
}

// Returns false when there is no checkpoint (KVSWAP_TEST_FM_CKPT unset).
bool test_scorer() {
    const char *ckpt = std::getenv("KVSWAP_TEST_FM_CKPT");
    if (ckpt == nullptr || *ckpt == 0) {
        std::fprintf(stderr,
                     "\n*** NOTE: KVSWAP_TEST_FM_CKPT is not set: the C++ FlashMemory scorer group is SKIPPED "
                     "(see ffi-tests/Makefile for how to make a checkpoint) ***\n\n");
        std::printf("SKIP C++: fm scorer: KVSWAP_TEST_FM_CKPT is not set\n");
        std::fflush(stdout);
        const char *req = std::getenv("KVSWAP_TEST_REQUIRE_FM_CKPT");
        if (req && std::string(req) == "1") FAIL("KVSWAP_TEST_REQUIRE_FM_CKPT=1, but KVSWAP_TEST_FM_CKPT is not set");
        return false;
    }
    Scorer s = load_scorer(ckpt);
    FmScorerInfo info{};
    CHECK_OK(fm_scorer_info(s.get(), &info));
    CHECK(info.n_scorers >= 1 && info.head_dim >= 1);

    std::mt19937 rng(g_seed + 11);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> hidden(static_cast<size_t>(info.n_scorers) * info.hidden);
    for (float &h : hidden) h = uni(rng);
    const size_t n = 13;
    const uint32_t k = 16;
    std::vector<uint16_t> keys(n * info.head_dim, 0);
    for (uint32_t d = 0; d < info.head_dim; d++) {
        const uint16_t v = to_bf16(uni(rng));
        for (size_t r = 0; r < n; r += 2) keys[r * info.head_dim + d] = v;
    }
    const std::vector<int32_t> got = score_topk(s.get(), hidden, keys, n, k, dm_stream());
    int sign = 2;
    for (int sg : {1, -1, 0})
        if (got == tie_rule(n, k, sg)) sign = sg;
    if (sign == 2)
        FAIL("fm_score_topk gave" + join(got) + "; the tie rule allows" + join(tie_rule(n, k, 1)) + " or" +
             join(tie_rule(n, k, -1)) + " or" + join(tie_rule(n, k, 0)));

    // The same handle from several threads at once (own streams on CUDA):
    // every call gives the same result.
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; t++) {
        threads.emplace_back([&] {
            void *stream = dm_stream_new();
            for (int i = 0; i < 10; i++) {
                const std::vector<int32_t> again = score_topk(s.get(), hidden, keys, n, k, stream);
                if (again != got) FAIL("a concurrent fm_score_topk gave" + join(again) + ", first call" + join(got));
            }
            dm_stream_free(stream);
        });
    }
    for (std::thread &t : threads) t.join();
    // Moving the owner keeps one handle; reset frees it once.
    Scorer moved = std::move(s);
    CHECK(s == nullptr && moved != nullptr);
    moved.reset();
    std::printf("ok   C++: fm_scorer_load into a unique_ptr, fm_score_topk of two tied key groups = the tie rule "
                "(S %s 0), 4 threads on one handle\n",
                sign > 0 ? ">" : sign < 0 ? "<" : "==");
    std::fflush(stdout);
    return true;
}

}  // namespace

int main() {
    dm_init();  // KVSWAP_TEST_BACKEND: cpu (default) or cuda
    g_seed = test_seed();
    std::printf("backend: %s, seed %u (KVSWAP_SEED=%u replays it)\n", dm_backend_name(), g_seed, g_seed);
    CHECK(std::string(kvswap_last_error()).empty());
    CHECK(std::strlen(kvswap_version()) > 0);
    CHECK_OK(kvswap_set_log_level(2));  // keep creation lines off stderr
    test_raii_script();
    test_not_stored_guard();
    test_last_error_is_per_thread();
    CHECK_OK(kvswap_set_log_level(3));
    test_threads();
    const bool fm_ran = test_scorer();
    dm_fini();
    if (fm_ran)
        std::printf("test_abi (C++17, %s backend): all groups passed\n", dm_backend_name());
    else
        std::printf("test_abi (C++17, %s backend): all groups run passed, but the FlashMemory scorer group was SKIPPED "
                    "(KVSWAP_TEST_FM_CKPT is not set)\n",
                    dm_backend_name());
    return 0;
}
