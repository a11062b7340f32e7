//! Things open at once per key (connections per address or identity, requests per peer), each
//! held by a [`Slot`] that gives its place back when dropped, with what every such limit needs:
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
}

impl<K: Eq + Hash + Clone> OpenCounts<K> {
    fn lock(&self) -> MutexGuard<'_, HashMap<K, (usize, bool)>> {
        // Every change is one call under the lock: the map stays consistent after a panic.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for one more under `key` if fewer than `limit` are open (0: no limit).
    pub fn admit(&self, key: K, limit: usize) -> Result<Slot<K>, Full> {
        let mut keys = self.lock();
        let (open, told) = keys.entry(key.clone()).or_insert((0, false));
        if limit != 0 && *open >= limit {
            return Err(Full {
                first: !std::mem::replace(told, true),
            });
        }
        *open += 1;
        Ok(Slot {
            counts: self.clone(),
            key,
        })
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
}

impl<K: Eq + Hash + Clone> Slot<K> {
    pub fn key(&self) -> &K {
        &self.key
    }
}

impl<K: Eq + Hash + Clone> Drop for Slot<K> {
    fn drop(&mut self) {
        let mut keys = self.counts.lock();
        if let Some((open, _)) = keys.get_mut(&self.key) {
            *open -= 1;
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
        assert_eq!(counts.admit("a", 2).unwrap_err(), Full { first: true });
        assert_eq!(counts.admit("a", 2).unwrap_err(), Full { first: false });
        let b = counts.admit("b", 2).unwrap();
        assert_eq!(b.key(), &"b");
        assert!(counts.admit("a", 0).is_ok(), "0: no limit");
        drop(a);
        // The run over (none open), a refusal is the first again.
        let a: Vec<Slot<&str>> = (0..2).map(|_| counts.admit("a", 2).unwrap()).collect();
        assert_eq!(counts.admit("a", 2).unwrap_err(), Full { first: true });
        drop((a, b));
        assert!(counts.is_empty());
    }
}
