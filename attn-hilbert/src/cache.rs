//! `OrderCache`: generated permutations shared by `(kind, grid)`, bounded in size.
//!
//! Each cached order holds two `usize` tables (16 bytes per token), so the cache
//! is bounded by entries and by total tokens; the oldest entries go first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use attn_core::error::Result;

use crate::generate::{OrderKind, generate};
use crate::grid::Grid;
use crate::permutation::Permutation;

/// Default number of orders the global cache keeps.
pub const DEFAULT_CAPACITY: usize = 32;
/// Default total tokens over all cached orders (2^24 tokens: 256 MiB of tables).
pub const DEFAULT_TOKEN_BUDGET: usize = 1 << 24;

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<(OrderKind, Grid), Arc<Permutation>>,
    /// Insertion order, oldest first (evicted first).
    age: VecDeque<(OrderKind, Grid)>,
    tokens: usize,
}

/// A thread-safe cache of permutations keyed by `(kind, grid)`, keeping at most
/// `capacity` entries and `token_budget` tokens (the oldest entries are dropped
/// first; callers holding an `Arc` keep it alive; an order larger than the whole
/// budget is returned but not kept). Generation runs outside the lock.
#[derive(Debug)]
pub struct OrderCache {
    entries: Mutex<Entries>,
    capacity: usize,
    token_budget: usize,
}

impl OrderCache {
    /// An empty cache holding at most `capacity` orders (at least 1) and
    /// [`DEFAULT_TOKEN_BUDGET`] tokens.
    pub fn new(capacity: usize) -> Self {
        Self::with_budget(capacity, DEFAULT_TOKEN_BUDGET)
    }

    /// An empty cache holding at most `capacity` orders and `token_budget` tokens.
    pub fn with_budget(capacity: usize, token_budget: usize) -> Self {
        OrderCache { entries: Mutex::new(Entries::default()), capacity: capacity.max(1), token_budget }
    }

    /// The process-wide cache used by [`crate::TokenOrder::new`].
    pub fn global() -> &'static OrderCache {
        static GLOBAL: OnceLock<OrderCache> = OnceLock::new();
        GLOBAL.get_or_init(|| OrderCache::new(DEFAULT_CAPACITY))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // A panic elsewhere while holding the lock leaves the map consistent
        // (every mutation is a single insert/remove), so poisoning is ignored.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached permutation, if any.
    pub fn get(&self, kind: OrderKind, grid: Grid) -> Option<Arc<Permutation>> {
        self.lock().map.get(&(kind, grid)).cloned()
    }

    /// The cached permutation, generating and inserting it on a miss.
    pub fn get_or_generate(&self, kind: OrderKind, grid: Grid) -> Result<Arc<Permutation>> {
        if let Some(p) = self.get(kind, grid) {
            return Ok(p);
        }
        let fresh = Arc::new(generate(kind, grid)?);
        let mut e = self.lock();
        if let Some(p) = e.map.get(&(kind, grid)) {
            return Ok(p.clone()); // another thread won the race
        }
        let n = fresh.len();
        if n > self.token_budget {
            return Ok(fresh);
        }
        while e.map.len() >= self.capacity || e.tokens + n > self.token_budget {
            let Some(old) = e.age.pop_front() else { break };
            if let Some(p) = e.map.remove(&old) {
                e.tokens -= p.len();
            }
        }
        e.map.insert((kind, grid), fresh.clone());
        e.age.push_back((kind, grid));
        e.tokens += n;
        Ok(fresh)
    }

    /// Number of cached orders.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Drop every cached order.
    pub fn clear(&self) {
        let mut e = self.lock();
        e.map.clear();
        e.age.clear();
        e.tokens = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_share_the_permutation_and_capacity_is_bounded() {
        let cache = OrderCache::new(2);
        let g = |n| Grid::new_2d(n, n).unwrap();
        let a = cache.get_or_generate(OrderKind::Hilbert, g(4)).unwrap();
        let b = cache.get_or_generate(OrderKind::Hilbert, g(4)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        cache.get_or_generate(OrderKind::ZOrder, g(4)).unwrap();
        cache.get_or_generate(OrderKind::ZOrder, g(5)).unwrap();
        assert_eq!(cache.len(), 2);
        assert!(cache.get(OrderKind::Hilbert, g(4)).is_none(), "oldest entry is evicted");
        assert_eq!(a.len(), 16, "evicted entries stay valid for their holders");
        cache.clear();
        assert!(cache.is_empty());
    }

    #[test]
    fn token_budget_is_respected() {
        let cache = OrderCache::with_budget(8, 100);
        let g = |h, w| Grid::new_2d(h, w).unwrap();
        cache.get_or_generate(OrderKind::Hilbert, g(6, 10)).unwrap();
        cache.get_or_generate(OrderKind::Hilbert, g(5, 6)).unwrap();
        assert_eq!(cache.len(), 2); // 90 tokens
        cache.get_or_generate(OrderKind::Hilbert, g(4, 5)).unwrap();
        assert_eq!(cache.len(), 2, "the 60-token order is evicted to fit 20 more");
        let big = cache.get_or_generate(OrderKind::Hilbert, g(20, 20)).unwrap();
        assert_eq!(big.len(), 400, "an order over the budget is returned, not kept");
        assert!(cache.get(OrderKind::Hilbert, g(20, 20)).is_none());
    }
}
