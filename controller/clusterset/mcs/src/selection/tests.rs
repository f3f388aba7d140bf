//! The selection's unit tests: what is held back and passed on, watch plans, stale reads.

use super::*;
use crate::store::Changes;

fn selection() -> Arc<Selection> {
    let changes = Arc::new(Changes::default());
    Arc::new(Selection::new(
        Arc::new(Store::new(changes.clone(), None)),
        Arc::new(Store::new(changes.clone(), None)),
        Arc::new(Store::new(changes, Some(member_slice_service))),
        Arc::new(Notify::new()),
    ))
}

fn key(ns: &str, name: &str) -> ObjKey {
    (ns.into(), name.into())
}

fn export() -> Arc<LeanExport> {
    Arc::new(LeanExport::new(
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "x", "namespace": "shop", "generation": 1,
                          "creationTimestamp": "2026-01-01T00:00:00Z" }
        }))
        .unwrap(),
    ))
}

fn slice(ns: &str, name: &str, service: &str) -> Arc<EndpointSlice> {
    Arc::new(
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name, "namespace": ns,
                          "labels": { "kubernetes.io/service-name": service } },
            "addressType": "IPv4", "endpoints": []
        }))
        .unwrap(),
    )
}

fn slices_sink(sel: &Arc<Selection>, names: &[&str]) -> Slices {
    let names: BTreeSet<String> = names.iter().map(|n| n.to_string()).collect();
    let n = buckets(sel.lock().names.len());
    Slices {
        selection: sel.clone(),
        bucket: bucket_of(names.iter().next().unwrap(), n),
        buckets: n,
        names,
        live: Arc::new(AtomicBool::new(true)),
        listed: Arc::new(AtomicBool::new(false)),
        started: Instant::now(),
    }
}

#[test]
fn names_spread_over_power_of_two_buckets_and_only_service_names_are_selected() {
    assert_eq!(buckets(0), 0);
    assert_eq!(buckets(1), 1);
    assert_eq!(buckets(NAMES_PER_WATCH), 1);
    assert_eq!(buckets(NAMES_PER_WATCH + 1), 2);
    assert_eq!(buckets(5 * NAMES_PER_WATCH), 8);
    assert_eq!(bucket_of("web", 8), bucket_of("web", 8));
    assert!((0..1000).all(|i| bucket_of(&format!("s{i}"), 8) < 8));
    for ok in ["web", "a", "a-1", &"a".repeat(63)] {
        assert!(selectable(ok), "{ok}");
    }
    for bad in [
        "",
        "Web",
        "1web",
        "web-",
        "web.v2",
        "a,b",
        "a)",
        "web in",
        &"a".repeat(64),
    ] {
        assert!(!selectable(bad), "{bad}");
    }
    let names: BTreeSet<String> = ["a".to_string(), "b".to_string()].into();
    assert_eq!(selector(&names), "kubernetes.io/service-name in (a,b)");
}

#[test]
fn watches_grow_when_full_shrink_when_a_quarter_full_and_never_select_too_many() {
    let names: Vec<String> = (0..2000).map(|i| format!("svc-{i}")).collect();
    let refs = |n: usize| names[..n].iter().map(String::as_str).collect::<Vec<_>>();
    assert_eq!(plan(&refs(0), 4), 0);
    assert_eq!(plan(&refs(100), 0), 1);
    assert_eq!(plan(&refs(129), 1), 2);
    // Names coming and going at the boundary keep the watches.
    assert_eq!(plan(&refs(100), 2), 2);
    assert_eq!(plan(&refs(128), 2), 2);
    // A quarter full: fewer.
    assert_eq!(plan(&refs(60), 2), 1);
    for n in [1, 300, 2000] {
        let k = plan(&refs(n), 0);
        assert!(k.is_power_of_two());
        let mut sizes = vec![0; k];
        for name in refs(n) {
            sizes[bucket_of(name, k)] += 1;
        }
        assert!(sizes.iter().all(|s| *s <= MAX_NAMES_PER_WATCH), "{sizes:?}");
    }
}

#[test]
fn an_export_is_passed_on_once_its_service_and_slices_are_read() {
    let sel = selection();
    let web = key("shop", "web");
    Sink::replace(&*sel, HashMap::from([(web.clone(), export())]));
    assert!(sel.exports.listed() && !sel.exports.contains(&web));
    assert_eq!(sel.held_back(), 1);

    // Services listed (the export was wanted before the list began): known.
    let services = Services(sel.clone());
    services.begin();
    assert!(services.keep(&web, &ServiceShape::default()));
    assert!(!services.keep(&key("shop", "idle"), &ServiceShape::default()));
    services.replace(HashMap::from([
        (web.clone(), Arc::new(ServiceShape::default())),
        (key("shop", "idle"), Arc::new(ServiceShape::default())),
    ]));
    assert!(sel.services.contains(&web) && !sel.services.contains(&key("shop", "idle")));
    assert!(!sel.exports.contains(&web), "its slices are not read yet");
    assert!(!sel.settled());

    // Its bucket listed: passed on, and the member is settled.
    slices_sink(&sel, &["web"]).replace(HashMap::from([(
        key("shop", "web-1"),
        slice("shop", "web-1", "web"),
    )]));
    assert!(sel.exports.contains(&web));
    assert_eq!(sel.held_back(), 0);
    assert!(sel.settled());

    // Another namespace exports the same name: its slices were listed with the name.
    let other = key("other", "web");
    Sink::apply(&*sel, other.clone(), export());
    assert!(sel.lock().wanted[&other].slices_known);
    assert!(!sel.lock().wanted[&other].service_known, "read by name");
    assert!(!sel.exports.contains(&other));

    // Unexported: its Service is dropped, the export gone.
    Sink::remove(&*sel, &web);
    assert!(!sel.exports.contains(&web) && !sel.services.contains(&web));
    assert!(sel.settled(), "settled stays");
}

#[test]
fn a_member_is_settled_once_its_first_list_is_read_whatever_comes_after() {
    let sel = selection();
    let web = key("shop", "web");
    Sink::replace(&*sel, HashMap::from([(web.clone(), export())]));
    let services = Services(sel.clone());
    services.begin();
    services.replace(HashMap::new());
    // A new export before the first one's slices are listed: it does not hold the
    // member back once the first list's exports are read.
    Sink::apply(&*sel, key("shop", "late"), export());
    slices_sink(&sel, &["web"]).replace(HashMap::new());
    assert!(sel.exports.contains(&web));
    assert_eq!(sel.held_back(), 1);
    assert!(sel.settled());
}

#[test]
fn a_read_by_name_older_than_the_watch_is_dropped_and_an_unexported_name_is_listed_again() {
    let sel = selection();
    Sink::replace(&*sel, HashMap::new());
    let services = Services(sel.clone());
    services.begin();
    services.replace(HashMap::new());
    let web = key("shop", "web");
    Sink::apply(&*sel, web.clone(), export());
    // The read is sent; the watch then says the Service was deleted.
    sel.lock().wanted.get_mut(&web).unwrap().seen = false;
    Services(sel.clone()).remove(&web);
    assert!(
        sel.lock().wanted[&web].seen,
        "a later read result is dropped"
    );
    // A Service event for a key nobody wants is not kept.
    Services(sel.clone()).apply(key("shop", "idle"), Arc::new(ServiceShape::default()));
    assert!(!sel.services.contains(&key("shop", "idle")));

    // Its name listed, then unexported and exported again: it waits for a new list.
    slices_sink(&sel, &["web"]).replace(HashMap::new());
    Sink::remove(&*sel, &web);
    Sink::apply(&*sel, web.clone(), export());
    assert!(!sel.lock().wanted[&web].slices_known);
    // A list by a watch that was replaced meanwhile is not taken.
    let stale = slices_sink(&sel, &["web"]);
    stale.live.store(false, Ordering::Release);
    stale.replace(HashMap::new());
    assert!(!sel.lock().wanted[&web].slices_known);
}

#[test]
fn a_service_exported_while_services_are_listed_is_left_to_a_read_by_name() {
    let sel = selection();
    Sink::replace(&*sel, HashMap::new());
    let services = Services(sel.clone());
    services.begin();
    let late = key("shop", "late");
    // Wanted after the list began: the list may have passed over its Service.
    Sink::apply(&*sel, late.clone(), export());
    services.replace(HashMap::new());
    assert!(!sel.lock().wanted[&late].service_known);
    assert!(sel.services.listed());
}

#[test]
fn an_export_no_service_can_match_is_passed_on_at_once() {
    let sel = selection();
    Sink::replace(&*sel, HashMap::new());
    let odd = key("shop", "web.v2");
    Sink::apply(&*sel, odd.clone(), export());
    assert!(sel.exports.contains(&odd));
    assert!(sel.lock().names.is_empty(), "never in a selector");
}
