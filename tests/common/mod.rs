//! Shared test helpers: a seeded PRNG (fresh seed per run unless
//! `KVSWAP_SEED` is set; the seed is printed so a failure can be replayed) and
//! a plain, obviously-correct model of DESIGN.md's residency rules.
#![allow(dead_code)]

use std::collections::BTreeSet;

/// The backend the shared tests run on: `KVSWAP_TEST_BACKEND=cpu` (default)
/// or `cuda` (the GPU script reruns them there).
pub fn test_backend() -> kvswap::BackendChoice {
    match std::env::var("KVSWAP_TEST_BACKEND").as_deref() {
        Ok("cuda") => kvswap::BackendChoice::Cuda,
        Ok("cpu") | Err(_) => kvswap::BackendChoice::Cpu,
        Ok(other) => panic!("KVSWAP_TEST_BACKEND={other:?}: expected cpu or cuda"),
    }
}

/// Scales iteration counts (`KVSWAP_TEST_SCALE`, default 1.0), e.g. to keep
/// runs under compute-sanitizer short.
pub fn scaled(n: usize) -> usize {
    let f: f64 = std::env::var("KVSWAP_TEST_SCALE").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    ((n as f64 * f) as usize).max(1)
}

pub struct Rng(u64);

impl Rng {
    /// A generator seeded from `KVSWAP_SEED` or the clock; prints the seed.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("KVSWAP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
            t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
        });
        eprintln!("{test}: seed {seed} (replay with KVSWAP_SEED={seed})");
        Rng(seed)
    }
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Why the model refused a call.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum ModelError {
    OutOfRange,
    NotStored,
}

/// The residency rules, written for clarity, not speed: a list of slots with
/// their last-use call number, searched and sorted on every miss.
pub struct Model {
    pub cap: u32,
    pub slots: u32,
    pub identity: bool,
    pub stored: Vec<Option<Vec<u8>>>,
    pub chunk_in: Vec<Option<u32>>,
    pub last_used: Vec<u64>,
    pub call: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

impl Model {
    pub fn new(cap: u32, gpu_chunks: u32, swap: bool) -> Model {
        let identity = !swap || cap <= gpu_chunks;
        let slots = if identity { cap } else { gpu_chunks };
        Model {
            cap,
            slots,
            identity,
            stored: vec![None; cap as usize],
            chunk_in: vec![None; slots as usize],
            last_used: vec![0; slots as usize],
            call: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    pub fn slot_of(&self, id: u32) -> Option<u32> {
        if self.identity {
            return self.stored[id as usize].as_ref().map(|_| id);
        }
        (0..self.slots).find(|&s| self.chunk_in[s as usize] == Some(id))
    }

    pub fn store(&mut self, id: u32, bytes: Vec<u8>) {
        self.stored[id as usize] = Some(bytes);
        if self.identity {
            self.chunk_in[id as usize] = Some(id);
        }
    }

    fn check(&self, id: i32) -> Result<(), ModelError> {
        if id < 0 || id as u32 >= self.cap {
            Err(ModelError::OutOfRange)
        } else if self.stored[id as usize].is_none() {
            Err(ModelError::NotStored)
        } else {
            Ok(())
        }
    }

    /// Returns the rewritten entries, or the first error (strict) with no
    /// change. In deferred mode bad entries become -1 and the first error is
    /// returned beside the result.
    pub fn swap_in(
        &mut self,
        entries: &[i32],
        window: i32,
        strict: bool,
    ) -> Result<(Vec<i32>, Option<ModelError>), ModelError> {
        let mut e = entries.to_vec();
        let mut deferred = None;
        for x in e.iter_mut() {
            if *x == -1 {
                continue;
            }
            if let Err(err) = self.check(*x) {
                if strict {
                    return Err(err);
                }
                deferred.get_or_insert(err);
                *x = -1;
            }
        }
        self.call += 1;
        let ids: Vec<u32> = e.iter().filter(|&&x| x != -1).map(|&x| x as u32).collect();
        let distinct: BTreeSet<u32> = ids.iter().copied().collect();
        // Selected slots: those already holding a selected chunk.
        let mut selected: BTreeSet<u32> = distinct.iter().filter_map(|&id| self.slot_of(id)).collect();
        self.hits += selected.len() as u64;
        if !self.identity {
            let mut seen = BTreeSet::new();
            for &id in &ids {
                if !seen.insert(id) || self.slot_of(id).is_some() {
                    continue;
                }
                let mut candidates: Vec<u32> = (0..self.slots).filter(|s| !selected.contains(s)).collect();
                candidates.sort_by_key(|&s| (self.last_used[s as usize], s));
                let victim = candidates[0];
                if self.chunk_in[victim as usize].is_some() {
                    self.evictions += 1;
                }
                self.chunk_in[victim as usize] = Some(id);
                selected.insert(victim);
                self.misses += 1;
            }
        }
        for &s in &selected {
            self.last_used[s as usize] = self.call;
        }
        let out = e.iter().map(|&x| if x == -1 { -1 } else { window + self.slot_of(x as u32).unwrap() as i32 }).collect();
        Ok((out, deferred))
    }

    /// `(slot, chunk)` of every resident chunk, ascending slot.
    pub fn residency(&self) -> Vec<(u32, u32)> {
        (0..self.slots).filter_map(|s| self.chunk_in[s as usize].map(|c| (s, c))).collect()
    }
}
