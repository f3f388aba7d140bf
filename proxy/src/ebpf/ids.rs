//! Backend ids of the eBPF maps: one id per backend (address, port, protocol), shared by every
//! frontend that uses it and reference-counted, so an id is stable while any frontend selects
//! its backend (ClientIP affinity entries, which name ids, survive scale-ups and readiness
//! flaps). A freed id is not handed out again until the 32-bit id space wraps, so a `connect()`
//! racing an update that read an old slot finds either that backend or no backend — never
//! another service's. Pure bookkeeping; the writer mirrors it into the maps.

use std::{collections::HashMap, net::SocketAddr};

use super::L4;

/// What a backend id names.
pub type BackendKey = (SocketAddr, L4);

/// The id space is full: as many live backends as the map holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full;

/// Reference-counted backend ids.
#[derive(Debug)]
pub struct BackendIds {
    capacity: usize,
    /// The id new references to a backend get.
    by_backend: HashMap<BackendKey, u32>,
    /// Every live id: what it names and how many slots refer to it.
    live: HashMap<u32, (BackendKey, u32)>,
    /// The next never-used id (0 is never an id).
    next: u32,
}

impl BackendIds {
    /// At most `capacity` live ids.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            by_backend: HashMap::new(),
            live: HashMap::new(),
            next: 1,
        }
    }

    /// Takes over an id found in pinned maps (a previous agent's), with no reference yet.
    pub fn adopt(&mut self, id: u32, key: BackendKey) {
        if id == 0 {
            return;
        }
        self.live.insert(id, (key, 0));
        self.by_backend.entry(key).or_insert(id);
        self.next = self.next.max(id.saturating_add(1));
    }

    /// Counts one more reference to an adopted id (a slot that names it). False when the id
    /// is unknown.
    pub fn add_ref(&mut self, id: u32) -> bool {
        match self.live.get_mut(&id) {
            Some((_, refs)) => {
                *refs += 1;
                true
            }
            None => false,
        }
    }

    /// Adopted ids that no slot names (to delete from the maps).
    pub fn unreferenced(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .live
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, _)| *id)
            .collect();
        v.sort_unstable();
        v
    }

    /// One reference to `key`'s id; `true` with it when the id is new (its map entry must be
    /// written).
    pub fn acquire(&mut self, key: BackendKey) -> Result<(u32, bool), Full> {
        if let Some(&id) = self.by_backend.get(&key)
            && let Some((_, refs)) = self.live.get_mut(&id)
        {
            *refs += 1;
            return Ok((id, false));
        }
        if self.live.len() >= self.capacity {
            return Err(Full);
        }
        // Never used since the last wrap; skip 0 and any id still live.
        let mut id = self.next;
        while id == 0 || self.live.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.next = id.wrapping_add(1);
        self.live.insert(id, (key, 1));
        self.by_backend.insert(key, id);
        Ok((id, true))
    }

    /// Drops one reference; `Some(key)` when it was the last one (delete the map entry).
    pub fn release(&mut self, id: u32) -> Option<BackendKey> {
        let (key, refs) = self.live.get_mut(&id)?;
        let key = *key;
        *refs = refs.saturating_sub(1);
        if *refs > 0 {
            return None;
        }
        self.live.remove(&id);
        if self.by_backend.get(&key) == Some(&id) {
            self.by_backend.remove(&key);
        }
        Some(key)
    }

    /// Forgets an id with no references (deleted from the maps).
    pub fn forget(&mut self, id: u32) {
        if let Some((key, 0)) = self.live.get(&id).copied() {
            self.live.remove(&id);
            if self.by_backend.get(&key) == Some(&id) {
                self.by_backend.remove(&key);
            }
        }
    }

    /// Changes the most live ids.
    pub fn set_capacity(&mut self, n: usize) {
        self.capacity = n;
    }

    /// The backend a live id names.
    pub fn backend(&self, id: u32) -> Option<BackendKey> {
        self.live.get(&id).map(|(key, _)| *key)
    }

    /// Live ids.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn be(s: &str) -> BackendKey {
        (s.parse().unwrap(), L4::Tcp)
    }

    #[test]
    fn one_id_per_backend_shared_and_counted() {
        let mut ids = BackendIds::new(8);
        let (a, new) = ids.acquire(be("198.18.1.2:80")).unwrap();
        assert!(new);
        let (a2, new) = ids.acquire(be("198.18.1.2:80")).unwrap();
        assert_eq!((a2, new), (a, false));
        let (b, _) = ids.acquire(be("198.18.1.3:80")).unwrap();
        assert_ne!(a, b);
        // UDP on the same address is another backend.
        let (u, _) = ids
            .acquire(("198.18.1.2:80".parse().unwrap(), L4::Udp))
            .unwrap();
        assert_ne!(u, a);
        assert_eq!(ids.release(a), None, "still referenced");
        assert_eq!(ids.release(a), Some(be("198.18.1.2:80")));
        assert_eq!(ids.live_count(), 2);
    }

    #[test]
    fn freed_ids_are_not_reused_before_the_space_wraps() {
        let mut ids = BackendIds::new(2);
        let (a, _) = ids.acquire(be("198.18.1.2:80")).unwrap();
        ids.release(a);
        let (b, _) = ids.acquire(be("198.18.1.3:80")).unwrap();
        assert_ne!(a, b, "a freed id came back at once");
        // The same backend again gets a new id too: an old slot read by a racing connect
        // finds nothing rather than a different service's backend.
        let (c, _) = ids.acquire(be("198.18.1.2:80")).unwrap();
        assert!(c != a && c != b);
        assert_eq!(ids.acquire(be("198.18.1.4:80")), Err(Full));
    }

    #[test]
    fn adopted_ids_count_their_slots_and_orphans_are_found() {
        let mut ids = BackendIds::new(8);
        ids.adopt(7, be("198.18.1.2:80"));
        ids.adopt(9, be("198.18.1.3:80"));
        assert!(ids.add_ref(7));
        assert!(!ids.add_ref(42));
        assert_eq!(ids.unreferenced(), [9]);
        ids.forget(9);
        // New ids start past the adopted ones; the adopted backend keeps its id.
        assert_eq!(ids.acquire(be("198.18.1.2:80")).unwrap(), (7, false));
        assert_eq!(ids.acquire(be("198.18.1.9:80")).unwrap(), (10, true));
    }

    #[test]
    fn the_id_space_wraps_around_live_ids() {
        let mut ids = BackendIds::new(4);
        ids.adopt(u32::MAX, be("198.18.1.2:80"));
        ids.add_ref(u32::MAX);
        let (a, _) = ids.acquire(be("198.18.1.3:80")).unwrap();
        assert_eq!(a, 1, "wrapped past u32::MAX, skipping 0");
    }
}
