//! The residency rules of DESIGN.md, on the host: which chunk sits in which
//! staging slot, the LRU order of the slots, and the hit / miss / victim
//! decision of one `swap_in_selected` call.
//!
//! The CPU backend uses this directly; the CUDA backend runs the same rules in
//! a kernel and is tested against it.
//!
//! # Rules
//! - Entries equal to -1 are padding and stay -1.
//! - Every other entry must be a stored logical id in `0..compressed_cap`;
//!   otherwise the call fails and nothing changes (strict mode), or the entry
//!   becomes -1 and the first error is reported later (deferred mode).
//! - Victims are slots not selected in the current call, least recently used
//!   first, ties to the lower slot index. Misses take victims in the order the
//!   misses first appear. A duplicate id maps to the same slot.
//! - Every slot selected by a call is "used" at that call: slots used by the
//!   same call tie, and ties go to the lower slot index.
//!
//! # Cost
//! Everything is O(1) per selected entry plus `gpu_chunks / 64` word scans,
//! with no allocation after construction: the LRU order is an intrusive
//! doubly-linked list threaded through two `u32` arrays indexed by slot, and
//! the chunk <-> slot maps are flat arrays.

/// "No slot" in the chunk -> slot map, "no chunk" in the slot -> chunk map.
pub const NONE: u32 = u32::MAX;

/// Why a selected entry was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryError {
    /// The id is negative (other than -1) or `>= compressed_cap`.
    OutOfRange { pos: usize, id: i32 },
    /// The id was never stored.
    NotStored { pos: usize, id: i32 },
}

/// Counts of one call (distinct chunks: a duplicate entry counts once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapOutcome {
    pub hits: u32,
    pub misses: u32,
    /// Misses whose victim slot held another chunk.
    pub evictions: u32,
    /// In deferred mode, the first refused entry (now -1).
    pub deferred: Option<EntryError>,
}

/// Residency state of one layer.
pub struct Residency {
    cap: u32,
    slots: u32,
    /// Swap off: every chunk lives in the slot of its own id.
    identity: bool,
    stored: Vec<u64>,
    chunk_slot: Vec<u32>,
    slot_chunk: Vec<u32>,
    /// LRU list over slots as `[prev, next]` per slot, `head` = least recently used.
    links: Vec<[u32; 2]>,
    head: u32,
    tail: u32,
    /// Slots selected by the current call (cleared at its end).
    selected: Vec<u64>,
    misses: Vec<(u32, u32)>,
    /// Scratch: positions of hit and miss entries of the current call.
    hit_pos: Vec<(u32, u32)>,
    miss_pos: Vec<u32>,
}

/// `n` copies of `v`, or OUT_OF_MEMORY instead of an abort.
fn filled<T: Clone>(n: usize, v: T, what: &str) -> crate::error::Result<Vec<T>> {
    let mut x = crate::error::try_vec(n, &format!("{what} of a layer's residency"))?;
    x.resize(n, v);
    Ok(x)
}

impl Residency {
    /// A layer of `cap` chunks with `slots` staging slots. When `cap <= slots`
    /// or `swap` is false the layer is fully resident (slot == logical id).
    /// The tables of a layer of `cap` chunks and `slots` slots; an
    /// allocation that fails is `KVSWAP_STATUS_OUT_OF_MEMORY` (the chunk
    /// table alone is 4 bytes per chunk), never an abort.
    pub fn new(cap: u32, slots: u32, swap: bool) -> crate::error::Result<Residency> {
        assert!(cap > 0 && cap < 1 << 30, "cap out of range");
        let identity = !swap || cap <= slots;
        let slots = if identity { cap } else { slots };
        assert!(slots > 0);
        let per_slot = if identity { 0 } else { slots as usize };
        let misses = crate::error::try_vec(per_slot, "the miss list of a layer's residency")?;
        let mut r = Residency {
            cap,
            slots,
            identity,
            stored: filled((cap as usize).div_ceil(64), 0, "the stored bits")?,
            chunk_slot: filled(if identity { 0 } else { cap as usize }, NONE, "the chunk -> slot table")?,
            slot_chunk: filled(per_slot, NONE, "the slot -> chunk table")?,
            links: filled(per_slot, [NONE; 2], "the LRU links")?,
            head: NONE,
            tail: NONE,
            selected: filled((slots as usize).div_ceil(64), 0, "the selected bits")?,
            misses,
            hit_pos: filled(per_slot, (0, 0), "the hit positions")?,
            miss_pos: filled(per_slot, 0, "the miss positions")?,
        };
        if !identity {
            for s in 0..slots {
                r.push_back(s);
            }
        }
        Ok(r)
    }

    pub fn compressed_cap(&self) -> u32 {
        self.cap
    }
    /// Staging slots in use for this layer (`compressed_cap` when fully resident).
    pub fn slots(&self) -> u32 {
        self.slots
    }
    /// True when swap is off for this layer (every chunk resident at its own id).
    pub fn fully_resident(&self) -> bool {
        self.identity
    }

    pub fn is_stored(&self, id: u32) -> bool {
        self.stored[(id / 64) as usize] >> (id % 64) & 1 == 1
    }

    /// Marks `id` stored. Returns the slot its bytes must also be written to,
    /// if any, and whether that slot already held the chunk (a refresh) -
    /// on a fully resident layer the first store fills the slot.
    pub fn mark_stored(&mut self, id: u32) -> Option<(u32, bool)> {
        debug_assert!(id < self.cap);
        let was_stored = self.is_stored(id);
        self.stored[(id / 64) as usize] |= 1 << (id % 64);
        if self.identity {
            return Some((id, was_stored));
        }
        self.slot_of(id).map(|s| (s, true))
    }

    /// The slot holding chunk `id`, if resident.
    pub fn slot_of(&self, id: u32) -> Option<u32> {
        if self.identity {
            return self.is_stored(id).then_some(id);
        }
        let s = self.chunk_slot[id as usize];
        (s != NONE).then_some(s)
    }

    /// The chunk held by `slot`, if any.
    pub fn chunk_in(&self, slot: u32) -> Option<u32> {
        if self.identity {
            return self.is_stored(slot).then_some(slot);
        }
        let c = self.slot_chunk[slot as usize];
        (c != NONE).then_some(c)
    }

    /// Number of chunks currently in slots.
    pub fn resident(&self) -> u32 {
        if self.identity {
            self.stored.iter().map(|w| w.count_ones()).sum()
        } else {
            self.slot_chunk.iter().filter(|&&c| c != NONE).count() as u32
        }
    }

    /// Slots from least to most recently used (empty when fully resident).
    pub fn lru_order(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.slots as usize);
        let mut s = self.head;
        while s != NONE {
            v.push(s);
            s = self.links[s as usize][1];
        }
        v
    }

    /// `(slot, chunk)` pairs the last call assigned: the bytes to copy in, in
    /// miss order.
    pub fn last_misses(&self) -> &[(u32, u32)] {
        &self.misses
    }

    pub fn check(&self, pos: usize, id: i32) -> Result<(), EntryError> {
        if id < 0 || id as u32 >= self.cap {
            Err(EntryError::OutOfRange { pos, id })
        } else if !self.is_stored(id as u32) {
            Err(EntryError::NotStored { pos, id })
        } else {
            Ok(())
        }
    }

    /// One `swap_in_selected` call over `entries` (the `count` entries after
    /// the window). Rewrites each non-padding entry to `window_len + slot`.
    ///
    /// The caller guarantees `entries.len() <= slots()` and that
    /// `window_len + slots() < 2^30`.
    pub fn swap_in(
        &mut self,
        entries: &mut [i32],
        window_len: i32,
        strict: bool,
    ) -> Result<SwapOutcome, EntryError> {
        debug_assert!(self.identity || entries.len() <= self.slots as usize);
        let mut out = SwapOutcome::default();
        // Validate everything before changing anything.
        for (pos, e) in entries.iter_mut().enumerate() {
            if *e == -1 {
                continue;
            }
            if let Err(err) = self.check(pos, *e) {
                if strict {
                    return Err(err);
                }
                out.deferred.get_or_insert(err);
                *e = -1;
            }
        }
        self.misses.clear();
        if self.identity {
            for e in entries.iter_mut().filter(|e| **e != -1) {
                let s = *e as u32;
                if !self.take_selected(s) {
                    out.hits += 1;
                }
                *e += window_len;
            }
            self.selected.fill(0);
            return Ok(out);
        }
        // Split entries into hit and miss positions without branching on the
        // (unpredictable) hit/miss outcome: both lists are written, one grows.
        let (mut nh, mut nm) = (0usize, 0usize);
        for (i, &e) in entries.iter().enumerate() {
            if e == -1 {
                continue;
            }
            let s = self.chunk_slot[e as usize];
            self.hit_pos[nh] = (i as u32, s);
            self.miss_pos[nm] = i as u32;
            let miss = (s == NONE) as usize;
            nh += 1 - miss;
            nm += miss;
        }
        // Pass A: hits leave the LRU list, so that only unselected slots
        // remain in it and its head is always the next victim.
        for &(i, s) in &self.hit_pos[..nh] {
            let e = &mut entries[i as usize];
            let (w, b) = ((s / 64) as usize, 1u64 << (s % 64));
            if self.selected[w] & b == 0 {
                self.selected[w] |= b;
                unlink(&mut self.links, &mut self.head, &mut self.tail, s);
                out.hits += 1;
            }
            *e = window_len + s as i32;
        }
        // Pass B: misses, in order of first appearance, take victims from the
        // head. A repeated miss finds the slot its first occurrence took.
        for &i in &self.miss_pos[..nm] {
            let e = &mut entries[i as usize];
            let id = *e as u32;
            let mut s = self.chunk_slot[id as usize];
            if s == NONE {
                s = self.head;
                debug_assert!(s != NONE, "more distinct ids than slots");
                unlink(&mut self.links, &mut self.head, &mut self.tail, s);
                let old = self.slot_chunk[s as usize];
                if old != NONE {
                    self.chunk_slot[old as usize] = NONE;
                    out.evictions += 1;
                }
                self.slot_chunk[s as usize] = id;
                self.chunk_slot[id as usize] = s;
                self.selected[(s / 64) as usize] |= 1u64 << (s % 64);
                self.misses.push((s, id));
                out.misses += 1;
            }
            *e = window_len + s as i32;
        }
        // Pass C: the selected slots become most recent, ascending slot index.
        for w in 0..self.selected.len() {
            let mut bits = std::mem::take(&mut self.selected[w]);
            while bits != 0 {
                let s = (w as u32) * 64 + bits.trailing_zeros();
                self.push_back(s);
                bits &= bits - 1;
            }
        }
        Ok(out)
    }

    /// Forgets chunks `first .. first + n` (`kvswap_layer_forget`): each
    /// becomes never stored, a slot holding one is emptied, and every empty
    /// slot becomes least recently used, in ascending slot index, ahead of
    /// the slots that hold chunks (in their order). Empty slots are always
    /// that prefix of the order (a swap-in takes victims from the front and
    /// fills each one), so forgetting every chunk gives the state of a new
    /// layer. O(slots + n / 64), no allocation.
    ///
    /// The caller guarantees `first + n <= compressed_cap()`.
    pub fn forget(&mut self, first: u32, n: u32) {
        assert!(first as u64 + n as u64 <= self.cap as u64, "forget range past compressed_cap");
        if n == 0 {
            return;
        }
        let end = first + n;
        let (w0, w1) = ((first / 64) as usize, ((end - 1) / 64) as usize);
        for w in w0..=w1 {
            let mut mask = u64::MAX;
            if w == w0 {
                mask &= u64::MAX << (first % 64);
            }
            if w == w1 {
                mask &= u64::MAX >> (63 - (end - 1) % 64);
            }
            self.stored[w] &= !mask;
        }
        if self.identity {
            return;
        }
        for s in 0..self.slots {
            let c = self.slot_chunk[s as usize];
            if c != NONE && c.wrapping_sub(first) < n {
                self.slot_chunk[s as usize] = NONE;
                self.chunk_slot[c as usize] = NONE;
            }
        }
        // Take the empty slots out of the order, then put them back at the
        // front, highest first, so they end up in ascending order.
        for s in 0..self.slots {
            if self.slot_chunk[s as usize] == NONE {
                unlink(&mut self.links, &mut self.head, &mut self.tail, s);
            }
        }
        for s in (0..self.slots).rev() {
            if self.slot_chunk[s as usize] == NONE {
                self.push_front(s);
            }
        }
    }

    /// Marks slot `s` selected by the current call; returns whether it already was.
    #[inline]
    fn take_selected(&mut self, s: u32) -> bool {
        let (w, b) = ((s / 64) as usize, 1u64 << (s % 64));
        let was = self.selected[w] & b != 0;
        self.selected[w] |= b;
        was
    }

    fn push_front(&mut self, s: u32) {
        self.links[s as usize] = [NONE, self.head];
        if self.head == NONE { self.tail = s } else { self.links[self.head as usize][0] = s }
        self.head = s;
    }

    fn push_back(&mut self, s: u32) {
        self.links[s as usize] = [self.tail, NONE];
        if self.tail == NONE { self.head = s } else { self.links[self.tail as usize][1] = s }
        self.tail = s;
    }
}

/// Removes slot `s` from the LRU list (a free function so the borrow of the
/// list does not conflict with the scratch lists being iterated).
#[inline]
fn unlink(links: &mut [[u32; 2]], head: &mut u32, tail: &mut u32, s: u32) {
    let [p, n] = links[s as usize];
    if p == NONE { *head = n } else { links[p as usize][1] = n }
    if n == NONE { *tail = p } else { links[n as usize][0] = p }
    links[s as usize] = [NONE; 2];
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored_all(cap: u32, slots: u32) -> Residency {
        let mut r = Residency::new(cap, slots, true).unwrap();
        for i in 0..cap {
            r.mark_stored(i);
        }
        r
    }

    #[test]
    fn fills_slots_in_order_then_evicts_lru() {
        let mut r = stored_all(16, 4);
        let mut e = vec![5, 3, -1, 9];
        let o = r.swap_in(&mut e, 10, true).unwrap();
        assert_eq!(e, vec![10, 11, -1, 12]);
        assert_eq!((o.hits, o.misses, o.evictions), (0, 3, 0));
        assert_eq!(r.lru_order(), vec![3, 0, 1, 2]);
        // 3 hits slot 1; 7 and 8 take slot 3 (never used) then slot 0.
        let mut e = vec![7, 3, 8, 3];
        let o = r.swap_in(&mut e, 0, true).unwrap();
        assert_eq!(e, vec![3, 1, 0, 1]);
        assert_eq!((o.hits, o.misses, o.evictions), (1, 2, 1));
        assert_eq!(r.slot_of(5), None);
        assert_eq!(r.lru_order(), vec![2, 0, 1, 3]);
    }

    #[test]
    fn refused_calls_change_nothing() {
        let mut r = Residency::new(8, 4, true).unwrap();
        r.mark_stored(1);
        let mut e = vec![1, 2];
        assert_eq!(r.swap_in(&mut e, 0, true), Err(EntryError::NotStored { pos: 1, id: 2 }));
        assert_eq!(e, vec![1, 2]);
        assert_eq!(r.slot_of(1), None);
        let mut e = vec![1, 8];
        assert_eq!(r.swap_in(&mut e, 0, true), Err(EntryError::OutOfRange { pos: 1, id: 8 }));
        let mut e = vec![-2];
        assert_eq!(r.swap_in(&mut e, 0, true), Err(EntryError::OutOfRange { pos: 0, id: -2 }));
        assert_eq!(r.lru_order(), vec![0, 1, 2, 3]);
        // Deferred mode: the bad entry becomes padding, the rest proceeds.
        let mut e = vec![2, 1];
        let o = r.swap_in(&mut e, 0, false).unwrap();
        assert_eq!(e, vec![-1, 0]);
        assert_eq!(o.deferred, Some(EntryError::NotStored { pos: 0, id: 2 }));
    }

    #[test]
    fn forget_empties_slots_to_the_front_and_clears_stored_bits() {
        let mut r = stored_all(200, 4);
        let mut e = vec![5, 70, 130, 199];
        r.swap_in(&mut e, 0, true).unwrap();
        let mut e = vec![130];
        r.swap_in(&mut e, 0, true).unwrap();
        assert_eq!(r.lru_order(), vec![0, 1, 3, 2]);
        // 64..=130 spans a word boundary at both ends: slots 1 and 2 empty.
        r.forget(64, 67);
        assert_eq!((r.slot_of(70), r.slot_of(130)), (None, None));
        assert_eq!(r.lru_order(), vec![1, 2, 0, 3]);
        assert_eq!(r.resident(), 2);
        for id in 0..200 {
            assert_eq!(r.is_stored(id), !(64..131).contains(&id), "id {id}");
        }
        let mut e = vec![5, 70];
        assert_eq!(r.swap_in(&mut e, 0, true), Err(EntryError::NotStored { pos: 1, id: 70 }));
        // A miss takes the lowest empty slot first; the kept chunks stay.
        r.mark_stored(70);
        let mut e = vec![70, 5];
        let o = r.swap_in(&mut e, 0, true).unwrap();
        assert_eq!(e, vec![1, 0]);
        assert_eq!((o.hits, o.misses, o.evictions), (1, 1, 0));
        assert_eq!(r.lru_order(), vec![2, 3, 0, 1]);
        r.forget(0, 0);
        assert_eq!(r.lru_order(), vec![2, 3, 0, 1]);
    }

    #[test]
    fn forget_on_a_fully_resident_layer_clears_its_chunks() {
        let mut r = Residency::new(100, 128, true).unwrap();
        for id in [3, 63, 64, 99] {
            r.mark_stored(id);
        }
        r.forget(63, 2);
        assert_eq!(r.resident(), 2);
        assert_eq!((r.slot_of(3), r.slot_of(63), r.slot_of(64), r.slot_of(99)), (Some(3), None, None, Some(99)));
        let mut e = vec![63];
        assert_eq!(r.swap_in(&mut e, 0, true), Err(EntryError::NotStored { pos: 0, id: 63 }));
    }

    /// Random stores, swap-ins and forgets (seed printed): after each,
    /// the empty slots are the front of the LRU order in ascending slot
    /// index; forgetting everything gives a new layer, which then answers
    /// every call as a new one does.
    #[test]
    fn forget_all_gives_a_new_layer() {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
        let mut x = seed;
        let mut next = move |m: u32| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as u32
        };
        let (cap, slots) = (300u32, 24u32);
        let mut r = Residency::new(cap, slots, true).unwrap();
        let empties_first = |r: &Residency| {
            let order = r.lru_order();
            let k = order.iter().take_while(|&&s| r.chunk_in(s).is_none()).count();
            assert!(order[k..].iter().all(|&s| r.chunk_in(s).is_some()), "seed {seed}: an empty slot after a full one");
            assert!(order[..k].windows(2).all(|w| w[0] < w[1]), "seed {seed}: empty slots not ascending");
        };
        for round in 0..400 {
            match next(10) {
                0..=3 => {
                    for _ in 0..next(40) {
                        r.mark_stored(next(cap));
                    }
                }
                4..=7 => {
                    let mut e: Vec<i32> = (0..next(slots) + 1).map(|_| next(cap) as i32).collect();
                    let _ = r.swap_in(&mut e, 0, next(2) == 0);
                }
                8 => {
                    let first = next(cap);
                    r.forget(first, next(cap - first + 1));
                }
                _ => {
                    r.forget(0, cap);
                    let fresh = Residency::new(cap, slots, true).unwrap();
                    assert_eq!(r.lru_order(), fresh.lru_order(), "seed {seed} round {round}");
                    assert_eq!(r.resident(), 0);
                    assert!((0..cap).all(|id| !r.is_stored(id) && r.slot_of(id).is_none()));
                }
            }
            empties_first(&r);
        }
        // The same calls on a forgotten layer and on a new one.
        r.forget(0, cap);
        let mut fresh = Residency::new(cap, slots, true).unwrap();
        for _ in 0..200 {
            let id = next(cap);
            r.mark_stored(id);
            fresh.mark_stored(id);
            let e: Vec<i32> = (0..next(slots) + 1).map(|_| next(cap) as i32).collect();
            let (mut a, mut b) = (e.clone(), e);
            assert_eq!(r.swap_in(&mut a, 7, false), fresh.swap_in(&mut b, 7, false), "seed {seed}");
            assert_eq!(a, b, "seed {seed}");
            assert_eq!(r.lru_order(), fresh.lru_order(), "seed {seed}");
        }
    }

    #[test]
    fn identity_when_cap_fits() {
        let mut r = Residency::new(4, 8, true).unwrap();
        assert!(r.fully_resident());
        r.mark_stored(2);
        r.mark_stored(3);
        let mut e = vec![3, 2, 3, -1];
        let o = r.swap_in(&mut e, 5, true).unwrap();
        assert_eq!(e, vec![8, 7, 8, -1]);
        assert_eq!((o.hits, o.misses), (2, 0));
        assert_eq!(r.slot_of(3), Some(3));
        assert_eq!(r.resident(), 2);
    }
}
