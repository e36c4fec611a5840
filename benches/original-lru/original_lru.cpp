// The original engine's slot LRU, re-implemented faithfully as the benchmark
// baseline: a std::list of logical ids in recency order (front = most recent)
// and a std::unordered_map from logical id to {slot, list iterator}. Each
// swap-in touches hits first (splice to the front), then gives every miss the
// slot of the least recently used chunk at the back (or a never-used slot),
// allocating a list node per miss, as the original did.
#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {
struct OriginalLru {
    int32_t gpu_chunks;
    std::list<int32_t> lru;  // logical ids, front = most recently used
    std::unordered_map<int32_t, std::pair<int32_t, std::list<int32_t>::iterator>> map;
    std::vector<int32_t> free_slots;
    std::vector<uint8_t> stored;

    OriginalLru(int32_t slots, int32_t cap) : gpu_chunks(slots), stored(cap, 0) {
        map.reserve(slots * 2);
        for (int32_t s = slots - 1; s >= 0; --s) free_slots.push_back(s);
    }

    // Returns misses, or -1 if an id is invalid (nothing changed).
    int32_t swap_in(int32_t* idx, int32_t window, int32_t count) {
        for (int32_t i = 0; i < count; ++i) {
            int32_t id = idx[window + i];
            if (id == -1) continue;
            if (id < 0 || id >= (int32_t)stored.size() || !stored[id]) return -1;
        }
        // Touch hits first so that no selected chunk is evicted.
        for (int32_t i = 0; i < count; ++i) {
            int32_t id = idx[window + i];
            if (id == -1) continue;
            auto it = map.find(id);
            if (it != map.end()) lru.splice(lru.begin(), lru, it->second.second);
        }
        int32_t misses = 0;
        for (int32_t i = 0; i < count; ++i) {
            int32_t id = idx[window + i];
            if (id == -1) continue;
            auto it = map.find(id);
            int32_t slot;
            if (it != map.end()) {
                slot = it->second.first;
            } else {
                if (!free_slots.empty()) {
                    slot = free_slots.back();
                    free_slots.pop_back();
                } else {
                    int32_t victim = lru.back();
                    lru.pop_back();
                    auto v = map.find(victim);
                    slot = v->second.first;
                    map.erase(v);
                }
                lru.push_front(id);
                map.emplace(id, std::make_pair(slot, lru.begin()));
                ++misses;
            }
            idx[window + i] = window + slot;
        }
        return misses;
    }
};
}  // namespace

extern "C" {
void* original_lru_new(int32_t slots, int32_t cap) { return new OriginalLru(slots, cap); }
void original_lru_free(void* p) { delete static_cast<OriginalLru*>(p); }
void original_lru_mark_stored(void* p, int32_t id) { static_cast<OriginalLru*>(p)->stored[id] = 1; }
int32_t original_lru_swap_in(void* p, int32_t* idx, int32_t window, int32_t count) {
    return static_cast<OriginalLru*>(p)->swap_in(idx, window, count);
}
}
