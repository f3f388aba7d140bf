//! A bound on the exported labels and annotations the controller keeps of one member's
//! ServiceExports, per namespace and in all. Each export may carry up to
//! [`mcs_merge::meta::MAX_ANNOTATION_BYTES`] + [`mcs_merge::meta::MAX_LABEL_BYTES`], and a
//! namespace may hold thousands of exports: without a bound in bytes one tenant could make
//! every cluster's controller hold gigabytes (and be killed at its memory limit).
//!
//! An export whose metadata does not fit is kept without it ([`OVER_BUDGET`]: imported
//! without its labels and annotations, its `Valid` condition says why), and remembered with
//! its size; when others shrink or go, the refused exports that fit the freed room together
//! (in key order, not each alone: one freed byte must not queue thousands of reads) are
//! queued ([`MetaBudget::readmit`]) and the member's re-admit task reads them again from the
//! API server. Exports come in as their events do (a complete list: oldest first), so at the
//! edge of the budget the ones that came first are kept. The per-member budget is first come
//! across namespaces, but past it a namespace still keeps its fair share (the budget over the
//! namespaces holding metadata), up to twice the budget in all; and a namespace past its
//! bound loses only its exports' metadata, never the exports.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Debug,
    sync::{Arc, Mutex},
};

use mcs_merge::meta::Refusal;
use tokio::sync::Notify;

use crate::objects::{LeanExport, ObjKey};

/// What a store may keep of each object it is given (a budget such as [`MetaBudget`]).
pub trait Admission<K>: Debug + Send + Sync {
    /// What is kept of `o` under `key` (`o`, or `o` trimmed); what `key` held before is
    /// given back first. Called with the store write-locked.
    fn admit(&self, key: &ObjKey, o: Arc<K>) -> Arc<K>;
    /// `key` is gone.
    fn release(&self, key: &ObjKey);
    /// Everything is given back (a complete list is admitted again).
    fn reset(&self);
    /// The order a complete list is admitted in (lower first).
    fn rank(&self, o: &K) -> i64;
}

/// `Valid=True` reason: the export is imported without its labels and annotations, which do
/// not fit its namespace's (or member's) budget.
pub const OVER_BUDGET: &str = "ExportedMetadataOverBudget";

/// Bytes charged per label or annotation beyond its key and value (the map entry and the
/// strings' own headers): many tiny entries cost more than their text.
const ENTRY_OVERHEAD: usize = 64;

/// What one member's exports may keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaLimits {
    /// Bytes of exported labels and annotations per namespace.
    pub per_namespace: usize,
    /// Bytes in all of the member's namespaces.
    pub per_member: usize,
}

impl Default for MetaLimits {
    fn default() -> Self {
        Self {
            per_namespace: 2 << 20,
            // Past it fair shares may take up to twice it: 16 MiB per member at most, as
            // before there were shares.
            per_member: 8 << 20,
        }
    }
}

/// The budget of one member's exports.
#[derive(Debug)]
pub struct MetaBudget {
    limits: MetaLimits,
    spent: Mutex<Spent>,
    /// Wakes the re-admit task when [`MetaBudget::readmit`] has keys.
    pub wake: Notify,
}

#[derive(Debug, Default)]
struct Spent {
    by_namespace: HashMap<String, usize>,
    total: usize,
    charged: HashMap<ObjKey, usize>,
    /// Exports kept without their metadata, and the bytes they want.
    over: BTreeMap<ObjKey, usize>,
    /// Of those, the ones that would fit now: to be read again.
    readmit: BTreeSet<ObjKey>,
    /// Of those, the ones the re-admit task took and is reading (their room stays counted
    /// until they are admitted, gone, or queued again).
    reading: BTreeSet<ObjKey>,
}

/// The bytes `e`'s labels and annotations cost.
pub fn meta_bytes(e: &LeanExport) -> usize {
    e.labels
        .iter()
        .chain(&e.annotations)
        .map(|(k, v)| k.len() + v.len() + ENTRY_OVERHEAD)
        .sum()
}

impl MetaBudget {
    /// An empty budget within `limits`.
    pub fn new(limits: MetaLimits) -> Self {
        Self {
            limits,
            spent: Mutex::new(Spent::default()),
            wake: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Spent> {
        self.spent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the keys of refused exports that would fit now (they count as being read until
    /// admitted, gone or [`MetaBudget::requeue`]d).
    pub fn readmit(&self) -> BTreeSet<ObjKey> {
        let mut s = self.lock();
        let keys = std::mem::take(&mut s.readmit);
        s.reading.extend(keys.iter().cloned());
        keys
    }

    /// Queues `keys` to be read again (a read failed), those still refused.
    pub fn requeue(&self, keys: BTreeSet<ObjKey>) {
        let mut s = self.lock();
        for k in &keys {
            s.reading.remove(k);
        }
        let still: Vec<ObjKey> = keys
            .into_iter()
            .filter(|k| s.over.contains_key(k))
            .collect();
        if !still.is_empty() {
            s.readmit.extend(still);
            self.wake.notify_one();
        }
    }

    /// How many exports are kept without their metadata.
    pub fn over_count(&self) -> usize {
        self.lock().over.len()
    }

    /// What `key` held, given back (and forgotten as refused or queued).
    fn give_back(s: &mut Spent, key: &ObjKey) {
        s.over.remove(key);
        s.readmit.remove(key);
        s.reading.remove(key);
        let Some(n) = s.charged.remove(key) else {
            return;
        };
        s.total -= n;
        if let Some(ns) = s.by_namespace.get_mut(&key.0) {
            *ns -= n;
            if *ns == 0 {
                s.by_namespace.remove(&key.0);
            }
        }
    }

    /// Queues the refused exports that fit the room there is now, together (as many as could
    /// be admitted, not every one that would fit alone), the room of those already queued or
    /// being read counted as taken. Called after a change is charged, so an update that
    /// takes back what it gave queues nothing.
    fn queue_fitting(&self, s: &mut Spent) {
        let mut room_total = self.limits.per_member.saturating_sub(s.total);
        if room_total == 0 || s.over.is_empty() {
            return;
        }
        let mut room_ns: HashMap<&str, usize> = HashMap::new();
        for k in s.readmit.iter().chain(&s.reading) {
            if let Some(need) = s.over.get(k) {
                room_total = room_total.saturating_sub(*need);
                let in_ns = s.by_namespace.get(&k.0).copied().unwrap_or(0);
                let r = room_ns
                    .entry(&k.0)
                    .or_insert_with(|| self.limits.per_namespace.saturating_sub(in_ns));
                *r = r.saturating_sub(*need);
            }
        }
        let mut fits: Vec<ObjKey> = Vec::new();
        for (k, need) in &s.over {
            if room_total == 0 {
                break;
            }
            if *need > room_total || s.readmit.contains(k) || s.reading.contains(k) {
                continue;
            }
            let in_ns = s.by_namespace.get(&k.0).copied().unwrap_or(0);
            let r = room_ns
                .entry(&k.0)
                .or_insert_with(|| self.limits.per_namespace.saturating_sub(in_ns));
            if *need <= *r {
                *r -= need;
                room_total -= need;
                fits.push(k.clone());
            }
        }
        if !fits.is_empty() {
            s.readmit.extend(fits);
            self.wake.notify_one();
        }
    }
}

impl Admission<LeanExport> for MetaBudget {
    /// What is kept of `e` under `key` (what it held before is given back first): `e` itself
    /// when its metadata fits, else `e` without it and refused.
    fn admit(&self, key: &ObjKey, e: Arc<LeanExport>) -> Arc<LeanExport> {
        let mut s = self.lock();
        let before = s.total;
        Self::give_back(&mut s, key);
        let kept = self.charge(&mut s, key, e);
        // Room freed for others only when this one holds less than it did.
        if s.total < before {
            self.queue_fitting(&mut s);
        }
        kept
    }

    /// `key` is gone: what it held is given back.
    fn release(&self, key: &ObjKey) {
        let mut s = self.lock();
        Self::give_back(&mut s, key);
        self.queue_fitting(&mut s);
    }

    /// Forgets everything (a complete list is admitted again).
    fn reset(&self) {
        *self.lock() = Spent::default();
    }

    fn rank(&self, e: &LeanExport) -> i64 {
        e.created
    }
}

impl MetaBudget {
    /// What is kept of `e` under `key`, which holds nothing now: `e` itself when its
    /// metadata fits (charged), else `e` without it, remembered as refused.
    fn charge(&self, s: &mut Spent, key: &ObjKey, e: Arc<LeanExport>) -> Arc<LeanExport> {
        let need = meta_bytes(&e);
        if need == 0 {
            return e;
        }
        let in_ns = s.by_namespace.get(&key.0).copied().unwrap_or(0);
        let over_ns = in_ns + need > self.limits.per_namespace;
        // Past the member's budget a namespace may still fill its fair share of it (the
        // budget over the namespaces holding metadata, this one counted), up to twice the
        // budget in all: what other namespaces took first does not leave it nothing.
        let holders = s.by_namespace.len() + usize::from(in_ns == 0);
        let share = self.limits.per_member / holders.max(1);
        let within_share =
            in_ns + need <= share && s.total + need <= self.limits.per_member.saturating_mul(2);
        if over_ns || (s.total + need > self.limits.per_member && !within_share) {
            s.over.insert(key.clone(), need);
            let message = if over_ns {
                format!(
                    "the exported labels and annotations of namespace {}'s exports are kept up to {} bytes (mcs-controller --exported-metadata-bytes-per-namespace) and this export's {need} do not fit; they are taken when others shrink or go",
                    key.0, self.limits.per_namespace
                )
            } else {
                format!(
                    "the exported labels and annotations of this cluster's exports are kept up to {} bytes (mcs-controller --exported-metadata-bytes-per-member), past which each namespace keeps its fair share ({share} bytes now), and this export's {need} do not fit; they are taken when others shrink or go",
                    self.limits.per_member
                )
            };
            return Arc::new(LeanExport {
                labels: BTreeMap::new(),
                annotations: BTreeMap::new(),
                metadata_dropped: Some(Refusal::new(OVER_BUDGET, message)),
                ..(*e).clone()
            });
        }
        *s.by_namespace.entry(key.0.clone()).or_default() += need;
        s.total += need;
        s.charged.insert(key.clone(), need);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(bytes: usize) -> Arc<LeanExport> {
        Arc::new(LeanExport {
            generation: Some(1),
            annotations: BTreeMap::from([("a".into(), "v".repeat(bytes - 1 - ENTRY_OVERHEAD))]),
            ..Default::default()
        })
    }

    fn key(ns: &str, name: &str) -> ObjKey {
        (ns.into(), name.into())
    }

    #[test]
    fn past_the_namespace_budget_an_export_is_kept_without_metadata_until_room_frees() {
        let b = MetaBudget::new(MetaLimits {
            per_namespace: 1000,
            per_member: 1500,
        });
        assert_eq!(meta_bytes(&export(400)), 400);
        let a = b.admit(&key("shop", "a"), export(400));
        assert!(a.metadata_dropped.is_none() && !a.annotations.is_empty());
        assert!(
            b.admit(&key("shop", "b"), export(400))
                .metadata_dropped
                .is_none()
        );
        let c = b.admit(&key("shop", "c"), export(400));
        let why = c.metadata_dropped.as_ref().unwrap();
        assert_eq!(why.reason, OVER_BUDGET);
        assert!(why.message.contains("namespace shop's"), "{}", why.message);
        assert!(c.annotations.is_empty());
        assert!(c.refused.is_none(), "imported, without its metadata");
        assert_eq!(c.generation, Some(1), "the rest is kept");
        // Another namespace has its own budget, within the member's.
        assert!(
            b.admit(&key("blog", "x"), export(400))
                .metadata_dropped
                .is_none()
        );
        let y = b.admit(&key("blog", "y"), export(400));
        assert!(
            y.metadata_dropped
                .as_ref()
                .unwrap()
                .message
                .contains("per-member"),
            "{:?}",
            y.metadata_dropped
        );
        assert_eq!(b.over_count(), 2);
        assert!(b.readmit().is_empty());
        // An export without metadata costs nothing.
        assert!(
            b.admit(&key("shop", "d"), Arc::new(LeanExport::default()))
                .metadata_dropped
                .is_none()
        );
        // `a` goes (800 of the member's 1500 spent): `c` and `y` would each fit alone, but
        // only one of them fits the room, so only one is read again (the first by key).
        b.release(&key("shop", "a"));
        assert_eq!(b.readmit(), BTreeSet::from([key("blog", "y")]));
        assert!(
            b.admit(&key("blog", "y"), export(400))
                .metadata_dropped
                .is_none()
        );
        assert!(b.readmit().is_empty());
        // `b` shrinks to nothing: room for `c`.
        b.admit(&key("shop", "b"), Arc::new(LeanExport::default()));
        assert_eq!(b.readmit(), BTreeSet::from([key("shop", "c")]));
        assert!(
            b.admit(&key("shop", "c"), export(400))
                .metadata_dropped
                .is_none()
        );
        assert_eq!(b.over_count(), 0);
        b.reset();
        assert!(
            b.admit(&key("shop", "e"), export(900))
                .metadata_dropped
                .is_none()
        );
    }

    /// Issue 52: one freed byte used to queue a read of every refused export that would fit
    /// alone (~3,000 GETs for one admitted); now only what fits the room together.
    #[test]
    fn freed_room_queues_only_the_reads_it_can_admit() {
        let b = MetaBudget::new(MetaLimits {
            per_namespace: 10_000,
            per_member: 10_000,
        });
        for i in 0..25 {
            b.admit(&key("hog", &format!("h{i:02}")), export(400));
        }
        for i in 0..3000 {
            let e = b.admit(&key("hog", &format!("e{i:04}")), export(400));
            assert!(e.metadata_dropped.is_some());
        }
        b.release(&key("hog", "h00"));
        let first = b.readmit();
        assert_eq!(first, BTreeSet::from([key("hog", "e0000")]));
        // Read again and admitted, as the member's re-admit task does.
        assert!(
            b.admit(&key("hog", "e0000"), export(400))
                .metadata_dropped
                .is_none()
        );
        // Room freed while a read is queued counts the queued one first.
        b.release(&key("hog", "h01"));
        b.release(&key("hog", "h02"));
        b.requeue(b.readmit());
        b.release(&key("hog", "h03"));
        assert_eq!(b.readmit().len(), 3);
        // Keys being read keep their room: more freed room queues others, not them again.
        b.release(&key("hog", "h04"));
        assert_eq!(b.readmit(), BTreeSet::from([key("hog", "e0004")]));
    }

    /// Issue 52: eight namespaces filling the member's budget left every other namespace's
    /// export with one label without it; past the budget a namespace keeps its fair share.
    #[test]
    fn past_the_member_budget_a_namespace_keeps_its_fair_share() {
        let b = MetaBudget::new(MetaLimits {
            per_namespace: 4_000,
            per_member: 16_000,
        });
        for ns in 0..8 {
            for i in 0..5 {
                b.admit(&key(&format!("hog{ns}"), &format!("e{i}")), export(400));
            }
        }
        // 8 x 2,000: the member's whole budget.
        assert!(
            b.admit(&key("hog0", "more"), export(400))
                .metadata_dropped
                .is_some()
        );
        let one_label = b.admit(&key("shop", "web"), export(100));
        assert!(
            one_label.metadata_dropped.is_none(),
            "{:?}",
            one_label.metadata_dropped
        );
        // Its share is the budget over 9 namespaces (1,777 bytes): more than that is not kept.
        for i in 0..4 {
            assert!(
                b.admit(&key("shop", &format!("w{i}")), export(400))
                    .metadata_dropped
                    .is_none()
            );
        }
        let kept = b.admit(&key("shop", "w4"), export(400));
        let why = kept.metadata_dropped.as_ref().unwrap();
        assert!(
            why.message.contains("fair share (1777 bytes now)"),
            "{}",
            why.message
        );
        // However many namespaces come, never more than twice the budget in all.
        for ns in 0..200 {
            b.admit(&key(&format!("n{ns:03}"), "e"), export(100));
        }
        assert!(b.lock().total <= 32_000, "{}", b.lock().total);
    }

    /// An update of an export that fits gives back and takes the same bytes: nothing to
    /// read again (each of its events once queued a read of every refused export).
    #[test]
    fn an_update_that_takes_back_what_it_gave_queues_no_reads() {
        let b = MetaBudget::new(MetaLimits {
            per_namespace: 1_000,
            per_member: 1_000,
        });
        b.admit(&key("ns", "big"), export(900));
        for i in 0..100 {
            assert!(
                b.admit(&key("ns", &format!("small{i:03}")), export(150))
                    .metadata_dropped
                    .is_some()
            );
        }
        for _ in 0..10 {
            b.admit(&key("ns", "big"), export(900));
        }
        assert!(b.readmit().is_empty());
        // It shrinks: room for one small one.
        b.admit(&key("ns", "big"), export(800));
        assert_eq!(b.readmit().len(), 1);
    }
}
