//! Programming frontends into the maps: backend entries (reference-counted ids, see
//! [`super::ids`]), slots, the frontend at slot 0, Maglev tables; and the [`Dataplane`] impl,
//! in which a frontend that cannot be programmed (too many backends, a full map) is rejected
//! alone — removed whole, reported by [`Dataplane::unprogrammed`], retried when room frees —
//! while every other frontend is programmed.
//!
//! # Update order
//!
//! Backends first, then backend slots `1..=n`, then the frontend at slot 0 with the new count,
//! then stale slots are deleted and the old backends released (deleted when no slot names
//! them). A concurrent `connect()` never reads a count that points at a missing slot, and an
//! old slot it read names that frontend's backend or nothing.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use mcs_ebpf_common::{
    BE4_MAP, BE6_MAP, Backend4, Backend6, FALLBACK_SLOT_BASE, MAGLEV_TABLE_SIZE,
    MAX_BACKENDS_PER_SVC, MEMBER_MAP, MaglevKey, MemberKey, SVC4_MAP, SVC6_MAP, Svc4Key, Svc6Key,
    SvcValue,
};
use mcs_model::{
    Dataplane, DataplaneError, Frontend, Protocol, Service, TableDiff,
    health::SkippedBackend,
    validate::{Reason, Rejection},
};

use super::{Error, FrontKey, L4, SocketLb, ip6_words};

/// Failures logged one by one per diff; the rest are counted in one line (the controller also
/// reports every unprogrammable frontend as a rejection: metric, Event, `mcs-agent table`).
const LOGGED: usize = 20;

/// Failed frontends that may fail again for room in one retry pass (see
/// `SocketLb::retry_failed`).
const RETRY_MISSES: usize = 16;

impl SocketLb {
    /// Programs (or replaces) the frontend `vip` with `backends`, in the safe order.
    pub fn set_service(
        &mut self,
        vip: SocketAddr,
        l4: L4,
        backends: &[SocketAddr],
    ) -> Result<(), Error> {
        self.set_service_with(vip, l4, backends, None)
    }

    /// As [`SocketLb::set_service`], with ClientIP affinity for `affinity_timeout_s` seconds
    /// when given. The socket LB sees a client before it has a source address, so a client is
    /// its network namespace (its pod), as in Cilium's socket LB. On error nothing of the
    /// frontend is left in the maps (it is removed whole) and no backend id leaks.
    pub fn set_service_with(
        &mut self,
        vip: SocketAddr,
        l4: L4,
        backends: &[SocketAddr],
        affinity_timeout_s: Option<u32>,
    ) -> Result<(), Error> {
        self.set_service_staged(vip, l4, backends, &[], affinity_timeout_s)
    }

    /// As [`SocketLb::set_service_with`], with `fallback` backends after the selected ones:
    /// a TCP connect goes to one of them only when every selected backend it tried failed on
    /// its pod lately (passive health). Fallback backends past the per-frontend maximum are
    /// left out.
    pub fn set_service_staged(
        &mut self,
        vip: SocketAddr,
        l4: L4,
        selected: &[SocketAddr],
        fallback: &[SocketAddr],
        affinity_timeout_s: Option<u32>,
    ) -> Result<(), Error> {
        let same_family = |b: &&SocketAddr| b.is_ipv4() == vip.is_ipv4();
        let selected: Vec<SocketAddr> = selected.iter().filter(same_family).copied().collect();
        if selected.len() > usize::from(MAX_BACKENDS_PER_SVC) {
            return Err(Error::TooManyBackends(selected.len()));
        }
        let fallback: Vec<SocketAddr> = fallback
            .iter()
            .filter(same_family)
            .take(usize::from(MAX_BACKENDS_PER_SVC))
            .copied()
            .collect();
        // 1. Backends: one reference each (new ids get their map entry).
        let mut ids = Vec::with_capacity(selected.len() + fallback.len());
        for be in selected.iter().chain(&fallback) {
            match self.acquire_backend(*be, l4) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for id in ids {
                        self.release_backend(id);
                    }
                    return Err(e);
                }
            }
        }
        let fallback_ids = ids.split_off(selected.len());
        let new = Slots {
            selected: ids,
            fallback: fallback_ids,
        };
        if let Err(e) = self.write_frontend(vip, l4, &selected, &new, affinity_timeout_s) {
            // Partly written: take the frontend out whole (slot 0 first), then every slot
            // either version used, and give back both versions' references.
            self.delete_slot(vip, l4, 0);
            let old = self.programmed.remove(&(vip, l4)).unwrap_or_default();
            for (slot, _) in new.numbered().chain(old.numbered()) {
                self.delete_slot(vip, l4, slot);
            }
            if let Some(&svc_id) = self.svc_ids.get(&(vip, l4)) {
                self.drop_members(svc_id, new.ids().chain(old.ids()));
            }
            self.drop_maglev(vip, l4);
            for id in new.ids().chain(old.ids()) {
                self.release_backend(id);
            }
            return Err(e);
        }
        // 4. Delete the slots the previous version used beyond the new ones; release its ids.
        // Membership goes for every old backend that is not selected now (one may have moved
        // to the fallback stage).
        let selected_now: BTreeSet<u32> = new.selected.iter().copied().collect();
        let (new_selected, new_fallback) = (new.selected.len(), new.fallback.len());
        let old = self.programmed.insert((vip, l4), new).unwrap_or_default();
        if let Some(&svc_id) = self.svc_ids.get(&(vip, l4)) {
            self.drop_members(svc_id, old.ids().filter(|id| !selected_now.contains(id)));
        }
        for (i, slot) in old.numbered().map(|(slot, _)| slot).enumerate() {
            let stale = if i < old.selected.len() {
                i >= new_selected
            } else {
                i - old.selected.len() >= new_fallback
            };
            if stale {
                self.delete_slot(vip, l4, slot);
            }
        }
        for id in old.ids() {
            self.release_backend(id);
        }
        Ok(())
    }

    /// Steps 2 and 3: slots (selected at `1..`, fallback from `FALLBACK_SLOT_BASE`),
    /// membership and Maglev table of the selected ones, then the frontend last.
    fn write_frontend(
        &mut self,
        vip: SocketAddr,
        l4: L4,
        backends: &[SocketAddr],
        slots: &Slots,
        affinity_timeout_s: Option<u32>,
    ) -> Result<(), Error> {
        for (slot, id) in slots.numbered() {
            self.put_slot(
                vip,
                l4,
                slot,
                SvcValue {
                    backend_id: id,
                    ..Default::default()
                },
            )?;
        }
        let ids = &slots.selected;
        let count = ids.len() as u16;
        let svc_id = self.svc_id((vip, l4));
        for &id in ids {
            self.member_map
                .insert(
                    MemberKey {
                        svc_id,
                        backend_id: id,
                    },
                    1,
                    0,
                )
                .map_err(|source| Error::Map {
                    name: MEMBER_MAP,
                    source,
                })?;
        }
        let mut flags = 0;
        if self.maglev && !ids.is_empty() && ids.len() < MAGLEV_TABLE_SIZE as usize {
            // Entries are overwritten in place; every entry names a live backend at all times
            // (old ids are released only after the frontend points at the new ones).
            let keys: Vec<String> = backends.iter().map(ToString::to_string).collect();
            let table = crate::maglev::Maglev::new(&keys, MAGLEV_TABLE_SIZE as usize);
            let mut complete = true;
            for index in 0..MAGLEV_TABLE_SIZE {
                let Some(i) = table.pick(u64::from(index)) else {
                    break;
                };
                // `pick(index)` of a table of that size is entry `index`.
                if let Err(e) = self
                    .maglev_map
                    .insert(MaglevKey { svc_id, index }, ids[i], 0)
                {
                    // Map full (more Maglev frontends than it holds): this frontend falls back
                    // to random choice rather than failing.
                    if self.maglev_misses < LOGGED {
                        tracing::warn!(frontend = %vip, error = %e, "Maglev table does not fit; random choice for this frontend");
                    }
                    self.maglev_misses += 1;
                    complete = false;
                    break;
                }
            }
            if complete {
                flags |= mcs_ebpf_common::SVC_FLAG_MAGLEV;
                self.maglev_tables.insert(svc_id);
            } else {
                self.delete_maglev_table(svc_id);
            }
        } else if self.maglev_tables.contains(&svc_id) {
            // No table any more (no backend, or too many for one): its entries go.
            self.delete_maglev_table(svc_id);
        }
        let front = SvcValue {
            // Slot 0 holds the number of fallback slots (see `SvcValue::fallback_count`).
            backend_id: slots.fallback.len() as u32,
            count,
            flags: flags
                | if affinity_timeout_s.is_some() {
                    mcs_ebpf_common::SVC_FLAG_AFFINITY
                } else {
                    0
                },
            affinity_timeout_s: affinity_timeout_s.unwrap_or(0),
            rev_nat_id: svc_id,
            ..Default::default()
        };
        self.put_slot(vip, l4, 0, front)
    }

    fn drop_members(&mut self, svc_id: u32, ids: impl Iterator<Item = u32>) {
        for id in ids {
            let _ = self.member_map.remove(&MemberKey {
                svc_id,
                backend_id: id,
            });
        }
    }

    /// Deletes the Maglev entries of `svc_id` (251 map deletes), if it has a table.
    fn delete_maglev_table(&mut self, svc_id: u32) {
        if self.maglev_tables.remove(&svc_id) {
            for index in 0..MAGLEV_TABLE_SIZE {
                let _ = self.maglev_map.remove(&MaglevKey { svc_id, index });
            }
        }
    }

    fn drop_maglev(&mut self, vip: SocketAddr, l4: L4) {
        if let Some(svc_id) = self.svc_ids.remove(&(vip, l4)) {
            // Only frontends with a table cost the 251 deletes (removing 10k frontends
            // without Maglev took 3.5 s when every one paid them).
            self.delete_maglev_table(svc_id);
            self.free_svc_ids.push(svc_id);
        }
    }

    /// Removes a frontend: slot 0 first (new connects stop matching), then slots, then the
    /// backends' references.
    pub fn remove_service(&mut self, vip: SocketAddr, l4: L4) {
        self.delete_slot(vip, l4, 0);
        // Its skip counters go with it (a later frontend on the same address starts at 0).
        self.skips.remove(vip, l4);
        let old = self.programmed.remove(&(vip, l4));
        if let (Some(&svc_id), Some(old)) = (self.svc_ids.get(&(vip, l4)), &old) {
            self.drop_members(svc_id, old.ids());
        }
        self.drop_maglev(vip, l4);
        if let Some(old) = old {
            for (slot, _) in old.numbered() {
                self.delete_slot(vip, l4, slot);
            }
            for id in old.ids() {
                self.release_backend(id);
            }
        }
    }

    /// One reference to the backend's id, writing its map entry when the id is new.
    fn acquire_backend(&mut self, be: SocketAddr, l4: L4) -> Result<u32, Error> {
        let full = self.capacity.backends;
        let (id, new) = self
            .ids
            .acquire((be, l4))
            .map_err(|_| Error::BackendsFull(full))?;
        if !new {
            return Ok(id);
        }
        let r = match be {
            SocketAddr::V4(a) => self.be4.insert(
                id,
                Backend4 {
                    addr: u32::from_ne_bytes(a.ip().octets()),
                    port: a.port().to_be(),
                    proto: l4.number(),
                    ..Default::default()
                },
                0,
            ),
            SocketAddr::V6(a) => self.be6.insert(
                id,
                Backend6 {
                    addr: ip6_words(*a.ip()),
                    port: a.port().to_be(),
                    proto: l4.number(),
                    ..Default::default()
                },
                0,
            ),
        };
        if let Err(source) = r {
            self.ids.release(id);
            return Err(Error::Map {
                name: if be.is_ipv4() { BE4_MAP } else { BE6_MAP },
                source,
            });
        }
        Ok(id)
    }

    /// Drops one reference; the last one deletes the map entry.
    fn release_backend(&mut self, id: u32) {
        if let Some((be, _)) = self.ids.release(id) {
            self.delete_backend_entry(id, be.is_ipv4());
        }
    }

    pub(super) fn delete_backend_entry(&mut self, id: u32, v4: bool) {
        let _ = if v4 {
            self.be4.remove(&id)
        } else {
            self.be6.remove(&id)
        };
    }

    fn put_slot(&mut self, vip: SocketAddr, l4: L4, slot: u16, v: SvcValue) -> Result<(), Error> {
        match vip {
            SocketAddr::V4(a) => self
                .svc4
                .insert(
                    Svc4Key::new(
                        u32::from_ne_bytes(a.ip().octets()),
                        a.port().to_be(),
                        l4.number(),
                        slot,
                    ),
                    v,
                    0,
                )
                .map_err(|source| Error::Map {
                    name: SVC4_MAP,
                    source,
                }),
            SocketAddr::V6(a) => self
                .svc6
                .insert(
                    Svc6Key::new(ip6_words(*a.ip()), a.port().to_be(), l4.number(), slot),
                    v,
                    0,
                )
                .map_err(|source| Error::Map {
                    name: SVC6_MAP,
                    source,
                }),
        }
    }

    fn delete_slot(&mut self, vip: SocketAddr, l4: L4, slot: u16) {
        let _ = match vip {
            SocketAddr::V4(a) => self.svc4.remove(&Svc4Key::new(
                u32::from_ne_bytes(a.ip().octets()),
                a.port().to_be(),
                l4.number(),
                slot,
            )),
            SocketAddr::V6(a) => self.svc6.remove(&Svc6Key::new(
                ip6_words(*a.ip()),
                a.port().to_be(),
                l4.number(),
                slot,
            )),
        };
    }

    /// Live backend ids (one per backend address, port and protocol).
    pub fn backend_ids(&self) -> usize {
        self.ids.live_count()
    }

    /// Holds at most `n` backend ids, as if the backends map were that small (tests of a
    /// full map without writing 65,536 entries).
    #[doc(hidden)]
    pub fn limit_backend_ids(&mut self, n: usize) {
        self.ids.set_capacity(n);
    }

    /// Room may have freed: tries the frontends that did not fit (those of `diff` were just
    /// tried), in order, until [`RETRY_MISSES`] more of them fail for room. Bounded so that
    /// with maps smaller than the table (adopted from an older agent) every freed slot does
    /// not cost an attempt at each of tens of thousands of failed frontends; the rest are
    /// tried when room frees again.
    fn retry_failed(&mut self, diff: &TableDiff) {
        use std::ops::Bound;
        let mut misses = 0;
        let mut programmed = 0usize;
        let mut after: Option<Frontend> = None;
        while misses < RETRY_MISSES {
            let lower = after.map_or(Bound::Unbounded, Bound::Excluded);
            let Some((f, svc)) = self
                .failed
                .range((lower, Bound::Unbounded))
                .find(|(f, _)| !diff.upsert.contains_key(*f))
                .map(|(f, (s, _))| (*f, s.clone()))
            else {
                break;
            };
            after = Some(f);
            match self.program(&f, &svc) {
                Ok(()) => {
                    if programmed < LOGGED {
                        tracing::info!(frontend = %f, "frontend programmed after an earlier failure");
                    }
                    programmed += 1;
                    self.failed.remove(&f);
                    self.failed_version += 1;
                }
                // Too many backends for one frontend: room does not help.
                Err(Error::TooManyBackends(_)) => {}
                Err(_) => misses += 1,
            }
        }
        if programmed > LOGGED {
            tracing::info!(
                more = programmed - LOGGED,
                "more frontends programmed after an earlier failure than logged one by one"
            );
        }
    }

    /// Programs one frontend of the table; `Err` leaves nothing of it in the maps.
    fn program(&mut self, f: &Frontend, svc: &Service) -> Result<(), Error> {
        let Some((vip, l4)) = key_of(f) else {
            return Ok(());
        };
        let addr = |b: &mcs_model::Backend| SocketAddr::new(b.address, b.port);
        let selected: Vec<SocketAddr> = svc.selected().map(addr).collect();
        let fallback: Vec<SocketAddr> = svc.fallback().map(addr).collect();
        self.set_service_staged(
            vip,
            l4,
            &selected,
            &fallback,
            svc.affinity.map(|a| a.timeout_seconds),
        )
    }
}

/// The backend ids a frontend's slots name: the selected ones at `1..`, the fallback ones
/// from `FALLBACK_SLOT_BASE`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Slots {
    pub(super) selected: Vec<u32>,
    pub(super) fallback: Vec<u32>,
}

impl Slots {
    /// Every id, selected first.
    pub(super) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.selected.iter().chain(&self.fallback).copied()
    }

    /// Every slot in use, with the id it names.
    pub(super) fn numbered(&self) -> impl Iterator<Item = (u16, u32)> + '_ {
        let selected = (1u16..).zip(self.selected.iter().copied());
        let fallback = (FALLBACK_SLOT_BASE..).zip(self.fallback.iter().copied());
        selected.chain(fallback)
    }
}

fn l4_of(p: Protocol) -> Option<L4> {
    match p {
        Protocol::Tcp => Some(L4::Tcp),
        Protocol::Udp => Some(L4::Udp),
        Protocol::Sctp => None,
    }
}

fn key_of(f: &Frontend) -> Option<FrontKey> {
    Some((SocketAddr::new(f.vip, f.port), l4_of(f.protocol)?))
}

impl Dataplane for SocketLb {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn apply(&mut self, diff: &TableDiff) -> Result<(), DataplaneError> {
        let mut freed = false;
        let mut failures = 0usize;
        self.maglev_misses = 0;
        for f in &diff.remove {
            if self.failed.remove(f).is_some() {
                self.failed_version += 1;
            }
            if let Some((vip, l4)) = key_of(f) {
                self.remove_service(vip, l4);
                freed = true;
            }
        }
        for (f, svc) in &diff.upsert {
            if key_of(f).is_none() {
                tracing::warn!(frontend = %f, "SCTP is not translated by the socket LB");
                continue;
            }
            let before = self.ids.live_count();
            match self.program(f, svc) {
                Ok(()) => {
                    if self.failed.remove(f).is_some() {
                        self.failed_version += 1;
                        tracing::info!(frontend = %f, "frontend programmed after an earlier failure");
                    }
                }
                Err(e) => {
                    if failures < LOGGED {
                        tracing::warn!(frontend = %f, service = %svc.service, error = %e, "frontend cannot be programmed; rejected alone, the rest is programmed");
                    }
                    failures += 1;
                    self.failed.insert(*f, (svc.clone(), e.to_string()));
                    self.failed_version += 1;
                }
            }
            freed |= self.ids.live_count() < before;
        }
        if failures > LOGGED {
            tracing::warn!(
                more = failures - LOGGED,
                "more frontends cannot be programmed than logged one by one"
            );
        }
        if self.maglev_misses > LOGGED {
            tracing::warn!(
                more = self.maglev_misses - LOGGED,
                "more Maglev tables do not fit than logged one by one; those frontends choose at random"
            );
        }
        if freed && !self.failed.is_empty() {
            self.retry_failed(diff);
        }
        if std::mem::take(&mut self.first_apply) {
            // The first diff is the whole table: drop what a previous agent left that is gone.
            let keep: BTreeSet<FrontKey> = diff.upsert.keys().filter_map(key_of).collect();
            let stale: Vec<FrontKey> = self
                .programmed
                .keys()
                .filter(|k| !keep.contains(k))
                .copied()
                .collect();
            for (vip, l4) in stale {
                tracing::info!(frontend = %vip, "removing a frontend left by the previous agent");
                self.remove_service(vip, l4);
            }
            // Skip counters of frontends that are gone (one made by a connect racing its
            // frontend's removal outlives the removal).
            let programmed = &self.programmed;
            self.skips
                .retain(|vip, l4| programmed.contains_key(&(vip, l4)));
        }
        Ok(())
    }

    fn unprogrammed_version(&self) -> Option<u64> {
        Some(self.failed_version)
    }

    fn report(&self) -> Vec<(&'static str, String)> {
        vec![
            ("frontends programmed", self.programmed.len().to_string()),
            ("frontends unprogrammable", self.failed.len().to_string()),
            ("backend ids in use", self.ids.live_count().to_string()),
            (
                "passive health",
                if self.passive_health {
                    "on (per client pod, TCP)".to_string()
                } else {
                    "off: the kernel refused the sock_ops program".to_string()
                },
            ),
            ("pin dir", self.pin_dir.display().to_string()),
        ]
    }

    fn unprogrammed(&self) -> Vec<Rejection> {
        self.failed
            .iter()
            .map(|(f, (svc, message))| {
                Rejection::new(
                    format!("ServiceImport {}", svc.service),
                    Reason::Unprogrammable,
                    format!("frontend {f}: {message}"),
                )
            })
            .collect()
    }

    fn programmed(&self, frontend: &Frontend) -> bool {
        !self.failed.contains_key(frontend)
    }

    /// Backends of `frontend` that some client pod on this node skips now (a pod's failed
    /// connect marks a backend for that pod only): per backend, the most failures in a row
    /// and the longest wait of any pod. Marks are TCP's only. The node's marks are read at
    /// most once a second (at most [`FAILED_SCAN`] of them), however many frontends ask.
    fn skipped(&self, frontend: &Frontend, limit: usize) -> Vec<SkippedBackend> {
        let Some(key) = key_of(frontend).filter(|(_, l4)| *l4 == L4::Tcp) else {
            return Vec::new();
        };
        let Some(slots) = self.programmed.get(&key) else {
            return Vec::new();
        };
        let backends: BTreeSet<SocketAddr> = slots
            .ids()
            .filter_map(|id| self.ids.backend(id))
            .map(|(addr, _)| addr)
            .collect();
        let Some(now_ns) = monotonic_ns() else {
            return Vec::new();
        };
        let mut cache = self
            .marks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fresh = cache
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < std::time::Duration::from_secs(1));
        if !fresh {
            let marks = self
                .failed_map
                .iter()
                .take(FAILED_SCAN)
                .filter_map(Result::ok)
                .filter(|(_, v)| v.until_ns > now_ns)
                .map(|(k, v)| Mark {
                    backend: match k.family {
                        4 => super::sock4(k.addr[0], k.port),
                        _ => super::sock6(k.addr, k.port),
                    },
                    failures: v.failures,
                    until_ns: v.until_ns,
                })
                .collect();
            *cache = Some((std::time::Instant::now(), marks));
        }
        let mut by_backend: BTreeMap<SocketAddr, SkippedBackend> = BTreeMap::new();
        for m in cache.iter().flat_map(|(_, marks)| marks) {
            if m.until_ns <= now_ns || !backends.contains(&m.backend) {
                continue;
            }
            let e = by_backend.entry(m.backend).or_insert(SkippedBackend {
                address: m.backend.ip(),
                port: m.backend.port(),
                failures: 0,
                for_ms: 0,
            });
            e.failures = e.failures.max(m.failures);
            e.for_ms = e.for_ms.max((m.until_ns - now_ns) / 1_000_000);
        }
        by_backend.into_values().take(limit).collect()
    }
}

/// A mark of the failed map, as `/status` reads it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mark {
    backend: SocketAddr,
    failures: u32,
    until_ns: u64,
}

/// `CLOCK_MONOTONIC` in nanoseconds (the kernel's `bpf_ktime_get_ns`).
fn monotonic_ns() -> Option<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
    Some(
        (now.tv_sec() as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(now.tv_nsec() as u64),
    )
}

/// The most marks of the failed map `/status` reads at a time (each costs two system calls;
/// the map holds up to 65,536).
const FAILED_SCAN: usize = 8192;

/// Frontends that could not be programmed, with the service and why.
pub(super) type Failed = BTreeMap<Frontend, (std::sync::Arc<Service>, String)>;
