//! Interned strings: one shared allocation per distinct cluster, zone or node name, however
//! many slices and endpoints name it (a million endpoints name a few hundred nodes).
//!
//! Strings nobody holds any more are swept when the set has doubled since the last sweep, so
//! the set stays within twice the live names (plus a small floor) and each lookup costs O(1)
//! amortised.

use std::{collections::HashSet, sync::Arc};

/// Below this many names the set is never swept.
const SWEEP_FLOOR: usize = 1024;

/// The interner. See the module docs.
#[derive(Debug, Default)]
pub struct Strings {
    set: HashSet<Arc<str>>,
    /// Names held after the last sweep.
    live_at_sweep: usize,
}

impl Strings {
    /// The shared copy of `s`.
    pub fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.set.get(s) {
            return a.clone();
        }
        if self.set.len() >= SWEEP_FLOOR.max(2 * self.live_at_sweep) {
            // Held only by the set: nothing names it any more.
            self.set.retain(|a| Arc::strong_count(a) > 1);
            self.live_at_sweep = self.set.len();
        }
        let a: Arc<str> = Arc::from(s);
        self.set.insert(a.clone());
        a
    }

    /// Names in the set (some may be unused until the next sweep).
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_names_share_one_allocation() {
        let mut s = Strings::default();
        let a = s.get("zone-a");
        let b = s.get("zone-a");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &s.get("zone-b")));
    }

    #[test]
    fn unused_names_are_swept_and_the_set_stays_bounded() {
        let mut s = Strings::default();
        let kept = s.get("kept");
        for i in 0..100_000 {
            drop(s.get(&format!("gone-{i}")));
            assert!(s.len() <= 2 * SWEEP_FLOOR, "{} names held", s.len());
        }
        // The name still held survives every sweep and is still the shared copy.
        assert!(Arc::ptr_eq(&kept, &s.get("kept")));
    }
}
