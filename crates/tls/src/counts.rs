//! Things open at once per key (connections per address or identity, requests per peer, bytes
//! of answers a peer has not read), each held by a [`Slot`] that gives its place (or its weight)
//! back when dropped, with what every such limit needs:
//! a refusal past the limit, and whether it is the first of its run, so that a peer held at its
//! limit is logged once rather than at each refusal.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Per key: how many are open, and whether a refusal was told since the key last had none.
/// Cloning shares the counts.
#[derive(Debug)]
pub struct OpenCounts<K> {
    keys: Arc<Mutex<HashMap<K, (usize, bool)>>>,
}

impl<K> Clone for OpenCounts<K> {
    fn clone(&self) -> Self {
        Self {
            keys: self.keys.clone(),
        }
    }
}

impl<K> Default for OpenCounts<K> {
    fn default() -> Self {
        Self {
            keys: Arc::default(),
        }
    }
}

/// Why [`OpenCounts::admit`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full {
    /// The first refusal since the key last had none open: the one to log.
    pub first: bool,
    /// What the key holds: how many open, or their weight.
    pub held: usize,
}

impl<K: Eq + Hash + Clone> OpenCounts<K> {
    fn lock(&self) -> MutexGuard<'_, HashMap<K, (usize, bool)>> {
        // Every change is one call under the lock: the map stays consistent after a panic.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for one more under `key` if fewer than `limit` are open (0: no limit).
    pub fn admit(&self, key: K, limit: usize) -> Result<Slot<K>, Full> {
        self.admit_weighing(key, 1, limit)
    }

    /// A slot of `weight` under `key` if what the key holds stays within `limit` with it (0: no
    /// limit). A weight above the limit is always refused.
    pub fn admit_weighing(&self, key: K, weight: usize, limit: usize) -> Result<Slot<K>, Full> {
        self.take(&key, weight, limit)?;
        Ok(Slot {
            counts: self.clone(),
            key,
            weight,
        })
    }

    /// Adds `weight` to what `key` holds if it stays within `limit` (0: no limit).
    fn take(&self, key: &K, weight: usize, limit: usize) -> Result<(), Full> {
        let mut keys = self.lock();
        let (open, told) = keys.entry(key.clone()).or_insert((0, false));
        if limit != 0 && open.saturating_add(weight) > limit {
            let held = *open;
            let first = !std::mem::replace(told, true);
            if held == 0 {
                // Nothing held: the key is not kept for a refusal alone.
                keys.remove(key);
            }
            return Err(Full { first, held });
        }
        *open += weight;
        Ok(())
    }

    /// Whether nothing is open (keys are forgotten at zero).
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// One place under a key of an [`OpenCounts`], given back when dropped.
#[derive(Debug)]
pub struct Slot<K: Eq + Hash + Clone> {
    counts: OpenCounts<K>,
    key: K,
    weight: usize,
}

impl<K: Eq + Hash + Clone> Slot<K> {
    pub fn key(&self) -> &K {
        &self.key
    }

    /// What the slot holds: 1 for a place, or its weight.
    pub fn weight(&self) -> usize {
        self.weight
    }

    /// Adds `weight` to the slot if what its key holds stays within `limit` with it (0: no
    /// limit); refused as [`OpenCounts::admit_weighing`] would, the slot unchanged.
    pub fn grow(&mut self, weight: usize, limit: usize) -> Result<(), Full> {
        self.counts.take(&self.key, weight, limit)?;
        self.weight += weight;
        Ok(())
    }
}

impl<K: Eq + Hash + Clone> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut keys = self.counts.lock();
        if let Some((open, _)) = keys.get_mut(&self.key) {
            *open -= self.weight;
            if *open == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn counted_per_key_refused_past_the_limit_and_the_first_refusal_of_a_run_told() {
        let counts = OpenCounts::default();
        let a: Vec<Slot<&str>> = (0..2).map(|_| counts.admit("a", 2).unwrap()).collect();
        assert_eq!(
            counts.admit("a", 2).unwrap_err(),
            Full {
                first: true,
                held: 2
            }
        );
        assert_eq!(
            counts.admit("a", 2).unwrap_err(),
            Full {
                first: false,
                held: 2
            }
        );
        let b = counts.admit("b", 2).unwrap();
        assert_eq!(b.key(), &"b");
        assert!(counts.admit("a", 0).is_ok(), "0: no limit");
        drop(a);
        // The run over (none open), a refusal is the first again.
        let a: Vec<Slot<&str>> = (0..2).map(|_| counts.admit("a", 2).unwrap()).collect();
        assert!(counts.admit("a", 2).unwrap_err().first);
        drop((a, b));
        assert!(counts.is_empty());
    }

    #[test]
    fn weights_are_held_to_the_limit_and_given_back_whole() {
        let counts = OpenCounts::default();
        let a = counts.admit_weighing("a", 60, 100).unwrap();
        assert_eq!(
            counts.admit_weighing("a", 41, 100).unwrap_err(),
            Full {
                first: true,
                held: 60
            }
        );
        let mut b = counts.admit_weighing("a", 30, 100).unwrap();
        assert_eq!(
            b.grow(11, 100).unwrap_err(),
            Full {
                first: false,
                held: 90
            }
        );
        b.grow(10, 100).unwrap();
        assert_eq!(b.weight(), 40);
        drop(a);
        let c = counts.admit_weighing("a", 60, 100).unwrap();
        drop((b, c));
        assert!(counts.is_empty());
        // Above the limit on its own: refused with nothing held, and nothing kept for it.
        assert_eq!(
            counts.admit_weighing("a", 101, 100).unwrap_err(),
            Full {
                first: true,
                held: 0
            }
        );
        assert!(counts.is_empty());
    }
}
