//! The eBPF socket load balancer, userspace side: load the embedded programs, pin maps and
//! links under bpffs, attach to a cgroup v2, and program frontends from the controller's diffs.
//!
//! # Pinning and restarts
//!
//! Maps are pinned at `<pin_dir>/<MAP_NAME>` and links at `<pin_dir>/links/<program>`
//! (directory mode 0700, objects 0600). On start, pinned maps are adopted (same kernel maps)
//! and pinned links are kept as they are, so connects keep being translated while the agent
//! is down or restarting. The first diff after start carries the whole table; frontends found
//! in the adopted maps but not in it are removed then. Only [`SocketLb::uninstall`] detaches
//! and unpins.
//!
//! # Layout
//!
//! - this module: loading, pinning and adoption, attaching, uninstall, reading the maps back;
//! - [`writer`]: programming frontends in the safe order, and the `Dataplane` impl with
//!   per-frontend isolation;
//! - [`ids`]: backend-id allocation (reference-counted, stable, not reused before the id
//!   space wraps).

use std::{
    collections::BTreeMap,
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

mod ids;
mod skips;
mod writer;

pub use skips::SkipMetrics;

use aya::{
    EbpfLoader,
    maps::{HashMap, IterableMap as _, MapData},
    programs::{
        CgroupAttachMode, CgroupSockAddr, SockOps,
        links::{FdLink, PinnedLink},
    },
};
use mcs_ebpf_common::{
    ALL_MAPS, BE4_MAP, BE6_MAP, Backend4, Backend6, MAX_BACKENDS_PER_SVC, SVC4_MAP, SVC6_MAP,
    Svc4Key, Svc6Key, SvcValue,
};
use mcs_ebpf_common::{FAILED_MAP, FALLBACK_SLOT_BASE, FailedKey, FailedValue, SKIPS_MAP};
use mcs_ebpf_common::{
    MAGLEV_MAP, MAGLEV_MAP_MAX_ENTRIES, MAGLEV_TABLE_SIZE, MEMBER_MAP, MaglevKey, MemberKey,
    SIZED_MAP_FLAGS,
};

/// The object built by `build.rs`, 8-byte aligned as the ELF parser wants.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mcs-ebpf"));

/// Programs in the object, each attached to the cgroup at the hook its section names: the
/// socket-address hooks, then the `sock_ops` program of passive health.
pub const PROGRAMS: &[&str] = &[
    "mcs_connect4",
    "mcs_sendmsg4",
    "mcs_recvmsg4",
    "mcs_getpeername4",
    "mcs_connect6",
    "mcs_sendmsg6",
    "mcs_recvmsg6",
    "mcs_getpeername6",
    SOCK_OPS_PROGRAM,
];

/// The `sock_ops` program (passive health of translated TCP connects).
pub const SOCK_OPS_PROGRAM: &str = "mcs_sock_ops";

/// Default pin directory.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/mcs";

/// Errors of the eBPF dataplane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object could not be loaded (verifier, missing kernel support, no privilege).
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    /// A program failed to load or attach.
    #[error("program {name}: {source}")]
    Program {
        /// Program name.
        name: &'static str,
        /// Cause.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("map {name}: {source}")]
    Map {
        /// Map name.
        name: &'static str,
        /// Cause.
        #[source]
        source: aya::maps::MapError,
    },
    /// A map or program is missing from the object.
    #[error("{0} is missing from the eBPF object")]
    Missing(&'static str),
    /// Pinning or unpinning failed.
    #[error("pinning {path}: {message}")]
    Pin {
        /// The path.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The cgroup directory cannot be opened.
    #[error("opening cgroup {path}: {source}")]
    Cgroup {
        /// The cgroup v2 directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// More backends than one frontend may have.
    #[error("frontend has {0} backends; at most {MAX_BACKENDS_PER_SVC} are supported")]
    TooManyBackends(usize),
    /// No free backend id: the backends map is full.
    #[error("the backends map is full ({0} entries)")]
    BackendsFull(u32),
}

/// The transport protocol of a frontend, as the socket hooks see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L4 {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl L4 {
    fn number(self) -> u8 {
        match self {
            Self::Tcp => mcs_ebpf_common::proto::TCP,
            Self::Udp => mcs_ebpf_common::proto::UDP,
        }
    }

    /// As frontends are written (`198.18.0.10:80/TCP`).
    fn name(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
        }
    }

    fn from_number(n: u8) -> Option<Self> {
        match n {
            mcs_ebpf_common::proto::TCP => Some(Self::Tcp),
            mcs_ebpf_common::proto::UDP => Some(Self::Udp),
            _ => None,
        }
    }
}

type FrontKey = (SocketAddr, L4);

/// What the maps hold, read back from the kernel (for `mcs-agent status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Programmed {
    /// Frontend → selected backends (in slot order).
    pub frontends: BTreeMap<String, Vec<String>>,
    /// Frontend → fallback backends (in slot order), for frontends that have any.
    pub fallbacks: BTreeMap<String, Vec<String>>,
    /// The maps sized from the caps: entries held and the size the kernel has.
    pub maps: BTreeMap<&'static str, MapFill>,
}

/// How full a map is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MapFill {
    /// Entries in it now.
    pub entries: usize,
    /// The most it holds (`max_entries`).
    pub max_entries: u32,
}

/// Entries of the maps whose size follows the agent's caps. Each is set when the map is
/// created; a map adopted from the pins keeps the size it was created with (see
/// [`SocketLb::capacity`]), so a new size takes effect after `mcs-agent uninstall`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MapSizes {
    /// Each services map (`MCS_SVC4_V1`, `MCS_SVC6_V1`): frontends plus backend slots.
    pub services: u32,
    /// Each backends map (`MCS_BE4_V1`, `MCS_BE6_V1`).
    pub backends: u32,
    /// The membership map (`MCS_MEMBER_V1`): (frontend, backend) pairs of both families (at
    /// most one per backend slot).
    pub members: u32,
    /// The Maglev map (`MCS_MAGLEV_V1`): `MAGLEV_TABLE_SIZE` entries per Maglev frontend.
    pub maglev: u32,
}

impl MapSizes {
    /// The most entries one map is made with: 4M (its hash buckets alone are 64 MiB of
    /// kernel memory), room for 1M endpoints four times over.
    pub const MAX_ENTRIES: u32 = 1 << 22;

    /// Sizes that hold the largest table the caps admit: `frontends` frontends with
    /// `backends` backends in all, in one address family or spread over both, plus one
    /// frontend's worth of room for an update in flight (new slots and backends are written
    /// before the old ones are freed). With `maglev`, a Maglev table for every frontend;
    /// without, for 4096 (enough to switch `--ebpf-selection` on a small node without
    /// reinstalling). Capped at [`MapSizes::MAX_ENTRIES`] each.
    pub fn for_caps(frontends: usize, backends: usize, maglev: bool) -> Self {
        let room = u64::from(MAX_BACKENDS_PER_SVC) + 1;
        let f = frontends as u64;
        let b = backends as u64;
        let clamp = |n: u64| n.clamp(1, u64::from(Self::MAX_ENTRIES)) as u32;
        let slots = f.saturating_add(b).saturating_add(room);
        Self {
            services: clamp(slots),
            backends: clamp(b.saturating_add(room)),
            // Pairs of both families: at most every backend slot.
            members: clamp(slots),
            maglev: if maglev {
                clamp(
                    f.saturating_add(1)
                        .saturating_mul(u64::from(MAGLEV_TABLE_SIZE)),
                )
            } else {
                MAGLEV_MAP_MAX_ENTRIES
            },
        }
    }
}

impl Default for MapSizes {
    /// The sizes for the agent's default caps, random selection.
    fn default() -> Self {
        let caps = mcs_model::Limits::default();
        Self::for_caps(caps.frontends, caps.backends, false)
    }
}

/// The loaded socket load balancer.
#[derive(Debug)]
pub struct SocketLb {
    pin_dir: PathBuf,
    ebpf: Option<aya::Ebpf>,
    svc4: HashMap<MapData, Svc4Key, SvcValue>,
    be4: HashMap<MapData, u32, Backend4>,
    svc6: HashMap<MapData, Svc6Key, SvcValue>,
    be6: HashMap<MapData, u32, Backend6>,
    /// Backend ids per frontend, as programmed (selected and fallback slots).
    programmed: BTreeMap<FrontKey, writer::Slots>,
    /// Backend ids, reference-counted by the slots that name them.
    ids: ids::BackendIds,
    /// Frontends of the table that could not be programmed, and why.
    failed: writer::Failed,
    /// Bumped whenever `failed` changes ([`mcs_model::Dataplane::unprogrammed_version`]).
    failed_version: u64,
    /// Frontends given random choice in this apply because their Maglev table did not fit.
    maglev_misses: usize,
    first_apply: bool,
    links: Vec<PinnedLink>,
    adopted_links: usize,
    maglev_map: HashMap<MapData, MaglevKey, u32>,
    /// (frontend, backend) pairs selected now (the kernel checks UDP stickiness with it).
    member_map: HashMap<MapData, MemberKey, u32>,
    /// Passive health: backends client pods failed on lately (written by the kernel; read
    /// for `/status`).
    failed_map: HashMap<MapData, FailedKey, FailedValue>,
    /// Per-frontend skip counters (the kernel counts; an entry goes with its frontend).
    skips: skips::Counters,
    /// The kernel took the `sock_ops` program (passive health runs).
    passive_health: bool,
    /// The marks `/status` read last, and when (read at most once a second).
    marks: std::sync::Mutex<Option<(std::time::Instant, Vec<writer::Mark>)>>,
    /// Use Maglev tables (consistent per client pod) instead of random picks.
    maglev: bool,
    /// The sizes of the maps as the kernel has them.
    capacity: MapSizes,
    /// `rev_nat_id` of each frontend (names its Maglev table).
    svc_ids: BTreeMap<FrontKey, u32>,
    /// `rev_nat_id`s that have a Maglev table in the map (only those have entries to delete).
    maglev_tables: std::collections::BTreeSet<u32>,
    free_svc_ids: Vec<u32>,
    next_svc_id: u32,
}

/// A program's link on the cgroup.
enum Linked {
    /// The link pinned before, running this very program: kept as it is.
    Kept(PinnedLink),
    /// A new link, attached beside whatever is pinned, not pinned yet.
    New(FdLink),
}

/// Loads program `name` and keeps its pinned link if that runs the same program, else
/// attaches a new link to `cgroup` (through bpf_link, kernel ≥ 5.7: links coexist with other
/// programs on the cgroup whatever the mode; `Single` is the flag value link_create accepts).
fn link_program(
    ebpf: &mut aya::Ebpf,
    name: &'static str,
    pin_dir: &Path,
    cgroup: &File,
) -> Result<Linked, Error> {
    use std::os::unix::fs::MetadataExt as _;
    let perr = |source| Error::Program { name, source };
    let cgroup_id = cgroup.metadata().ok().map(|m| m.ino());
    let program = ebpf.program_mut(name).ok_or(Error::Missing(name))?;
    let pin = pin_dir.join("links").join(name);
    macro_rules! load_and_attach {
        ($kind:ty) => {{
            let prog: &mut $kind = program.try_into().map_err(perr)?;
            prog.load().map_err(perr)?;
            let info = prog.info().map_err(perr)?;
            if let Some(link) = same_program_pinned(pin_dir, name, &info, cgroup_id) {
                return Ok(Linked::Kept(link));
            }
            let id = prog
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(perr)?;
            let link: FdLink = prog
                .take_link(id)
                .map_err(perr)?
                .try_into()
                .map_err(|e: aya::programs::links::LinkError| pin_err(&pin, e))?;
            Ok(Linked::New(link))
        }};
    }
    if name == SOCK_OPS_PROGRAM {
        load_and_attach!(SockOps)
    } else {
        load_and_attach!(CgroupSockAddr)
    }
}

/// The link pinned for program `name`, if it runs the program `loaded` is on the cgroup of id
/// `cgroup_id`: the program pinned beside it (`programs/NAME`) is the link's and has the same
/// name and tag (a hash of its instructions with map references left out: the same for every
/// load of one build), and the link is attached to that cgroup. Read
/// from the pins, not by listing the kernel's programs (that needs CAP_SYS_ADMIN, which the
/// agent does not have). A link of an agent that pinned no program is replaced once.
fn same_program_pinned(
    pin_dir: &Path,
    name: &str,
    loaded: &aya::programs::ProgramInfo,
    cgroup_id: Option<u64>,
) -> Option<PinnedLink> {
    let link_pin = pin_dir.join("links").join(name);
    if !link_pin.exists() {
        return None;
    }
    // The link's program and the cgroup it is attached to (a link on another cgroup, e.g.
    // after `--cgroup-root` changed, or on a deleted one, is replaced).
    let link = PinnedLink::from_pin(&link_pin).ok().map(FdLink::from);
    let info = link.as_ref().and_then(|l| l.info().ok());
    let link_program = info
        .as_ref()
        .map(aya::programs::links::LinkInfo::program_id);
    let link_cgroup = info.as_ref().and_then(|i| link_cgroup_id(i.id()));
    drop(link);
    let pinned = aya::programs::ProgramInfo::from_pin(pin_dir.join("programs").join(name)).ok();
    let same = pinned.is_some_and(|p| {
        Some(p.id()) == link_program && p.tag() == loaded.tag() && p.name() == loaded.name()
    }) && cgroup_id.is_some()
        && link_cgroup == cgroup_id;
    if !same {
        tracing::info!(link = %link_pin.display(), "the pinned link runs another program (another agent version); attaching this one beside it, then replacing it");
        return None;
    }
    match PinnedLink::from_pin(&link_pin) {
        Ok(link) => Some(link),
        Err(e) => {
            tracing::warn!(link = %link_pin.display(), error = %e, "unusable pinned link; attaching anew");
            None
        }
    }
}

/// The cgroup a cgroup link is attached to (its id, the cgroup2 directory's inode number), read
/// from the fdinfo of this process's descriptor of link `link_id` (aya does not expose it).
fn link_cgroup_id(link_id: u32) -> Option<u64> {
    let want = format!("link_id:\t{link_id}");
    for entry in std::fs::read_dir("/proc/self/fdinfo").ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        if text.lines().any(|l| l == want) {
            return text
                .lines()
                .find_map(|l| l.strip_prefix("cgroup_id:\t"))
                .and_then(|v| v.trim().parse().ok());
        }
    }
    None
}

/// Pins program `name` at `programs/NAME` (renamed over the one before), so the next agent
/// can tell whether the link pinned for it runs this program.
fn pin_program(ebpf: &mut aya::Ebpf, name: &'static str, pin_dir: &Path) {
    let path = pin_dir.join("programs").join(name);
    let tmp = pin_dir.join("programs").join(format!("{name}_next"));
    let _ = std::fs::remove_file(&tmp);
    let r = match ebpf.program_mut(name) {
        Some(aya::programs::Program::SockOps(p)) => p.pin(&tmp).map_err(|e| e.to_string()),
        Some(aya::programs::Program::CgroupSockAddr(p)) => p.pin(&tmp).map_err(|e| e.to_string()),
        _ => Err("not in the object".to_string()),
    }
    .and_then(|()| std::fs::rename(&tmp, &path).map_err(|e| e.to_string()));
    match r {
        Ok(()) => {
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(program = name, error = %e, "could not pin the program beside its link; the next agent will replace the link once");
        }
    }
}

fn pin_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Pin {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

impl SocketLb {
    /// The per-frontend skip counters as metrics, read from this socket LB's pins at scrape.
    pub fn skip_metrics(&self) -> SkipMetrics {
        SkipMetrics::new(&self.pin_dir)
    }

    /// Loads the object with its maps pinned in `pin_dir` (adopting maps already pinned there)
    /// and reads back what they hold; new maps get the sizes for the default caps.
    pub fn open(pin_dir: &Path) -> Result<Self, Error> {
        Self::open_sized(pin_dir, MapSizes::default())
    }

    /// As [`SocketLb::open`], with new maps made `sizes` large. Maps adopted from the pins
    /// keep their size; one smaller than `sizes` is logged (frontends that do not fit are
    /// reported as unprogrammable, as with any full map).
    pub fn open_sized(pin_dir: &Path, sizes: MapSizes) -> Result<Self, Error> {
        std::fs::create_dir_all(pin_dir.join("links")).map_err(|e| pin_err(pin_dir, e))?;
        for d in [pin_dir.to_path_buf(), pin_dir.join("links")] {
            let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        }
        let paths: Vec<(&'static str, PathBuf)> =
            ALL_MAPS.iter().map(|m| (*m, pin_dir.join(m))).collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        loader
            .map_max_entries(SVC4_MAP, sizes.services)
            .map_max_entries(SVC6_MAP, sizes.services)
            .map_max_entries(BE4_MAP, sizes.backends)
            .map_max_entries(BE6_MAP, sizes.backends)
            .map_max_entries(MEMBER_MAP, sizes.members)
            .map_max_entries(MAGLEV_MAP, sizes.maglev);
        let mut ebpf = loader.load(OBJECT)?;
        for (_, path) in &paths {
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
        let take = |ebpf: &mut aya::Ebpf, name: &'static str| -> Result<aya::maps::Map, Error> {
            ebpf.take_map(name).ok_or(Error::Missing(name))
        };
        let map_err = |name: &'static str| move |source| Error::Map { name, source };
        let svc4 = HashMap::try_from(take(&mut ebpf, SVC4_MAP)?).map_err(map_err(SVC4_MAP))?;
        let be4 = HashMap::try_from(take(&mut ebpf, BE4_MAP)?).map_err(map_err(BE4_MAP))?;
        let svc6 = HashMap::try_from(take(&mut ebpf, SVC6_MAP)?).map_err(map_err(SVC6_MAP))?;
        let be6 = HashMap::try_from(take(&mut ebpf, BE6_MAP)?).map_err(map_err(BE6_MAP))?;
        let maglev_map =
            HashMap::try_from(take(&mut ebpf, MAGLEV_MAP)?).map_err(map_err(MAGLEV_MAP))?;
        let member_map =
            HashMap::try_from(take(&mut ebpf, MEMBER_MAP)?).map_err(map_err(MEMBER_MAP))?;
        let failed_map =
            HashMap::try_from(take(&mut ebpf, FAILED_MAP)?).map_err(map_err(FAILED_MAP))?;
        let skips = skips::Counters(
            HashMap::try_from(take(&mut ebpf, SKIPS_MAP)?).map_err(map_err(SKIPS_MAP))?,
        );
        // Each sized map: its name, the size asked, and what the kernel has (an adopted pin
        // keeps the size it was made with).
        let mut have: Vec<(&'static str, u32, u32, u32)> = Vec::new();
        for (name, map, wanted) in [
            (SVC4_MAP, svc4.map(), sizes.services),
            (SVC6_MAP, svc6.map(), sizes.services),
            (BE4_MAP, be4.map(), sizes.backends),
            (BE6_MAP, be6.map(), sizes.backends),
            (MEMBER_MAP, member_map.map(), sizes.members),
            (MAGLEV_MAP, maglev_map.map(), sizes.maglev),
        ] {
            let info = map.info().map_err(map_err(name))?;
            have.push((name, wanted, info.max_entries(), info.map_flags()));
        }
        // The smallest of `names` (a table must fit in both families' maps).
        let entries = |names: &[&str]| {
            have.iter()
                .filter(|h| names.contains(&h.0))
                .map(|h| h.2)
                .min()
                .unwrap_or(0)
        };
        let capacity = MapSizes {
            services: entries(&[SVC4_MAP, SVC6_MAP]),
            backends: entries(&[BE4_MAP, BE6_MAP]),
            members: entries(&[MEMBER_MAP]),
            maglev: entries(&[MAGLEV_MAP]),
        };
        report_sizes(&have, capacity);
        let mut lb = Self {
            maglev_map,
            member_map,
            failed_map,
            skips,
            passive_health: true,
            marks: std::sync::Mutex::new(None),
            maglev: false,
            svc_ids: BTreeMap::new(),
            maglev_tables: std::collections::BTreeSet::new(),
            free_svc_ids: Vec::new(),
            next_svc_id: 1,
            pin_dir: pin_dir.to_path_buf(),
            ebpf: Some(ebpf),
            svc4,
            be4,
            svc6,
            be6,
            programmed: BTreeMap::new(),
            ids: ids::BackendIds::new(capacity.backends as usize),
            capacity,
            failed: BTreeMap::new(),
            failed_version: 0,
            maglev_misses: 0,
            first_apply: true,
            links: Vec::new(),
            adopted_links: 0,
        };
        lb.adopt_state();
        Ok(lb)
    }

    /// The sizes of the maps as the kernel has them (the smaller of the two families'): what
    /// the table must fit in.
    pub fn capacity(&self) -> MapSizes {
        self.capacity
    }

    /// Reads what pinned maps already hold (a previous agent's work).
    fn adopt_state(&mut self) {
        // (vip, proto, slot, value) of both families.
        let entries: Vec<(SocketAddr, u8, u16, SvcValue)> = self
            .svc4
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| (sock4(k.vip, k.port), k.proto, k.slot, v))
            .chain(
                self.svc6
                    .iter()
                    .filter_map(Result::ok)
                    .map(|(k, v)| (sock6(k.vip, k.port), k.proto, k.slot, v)),
            )
            .collect();
        let mut fronts: BTreeMap<FrontKey, BTreeMap<u16, u32>> = BTreeMap::new();
        for (vip, proto, slot, v) in entries {
            let Some(l4) = L4::from_number(proto) else {
                continue;
            };
            let fk = (vip, l4);
            if slot == 0 && v.rev_nat_id != 0 {
                self.svc_ids.insert(fk, v.rev_nat_id);
                if v.flags & mcs_ebpf_common::SVC_FLAG_MAGLEV != 0 {
                    self.maglev_tables.insert(v.rev_nat_id);
                }
            }
            let e = fronts.entry(fk).or_default();
            if slot > 0 {
                e.insert(slot, v.backend_id);
            }
        }
        self.next_svc_id = self.svc_ids.values().max().map_or(1, |m| m + 1);
        let backends: Vec<(u32, SocketAddr, u8)> = self
            .be4
            .iter()
            .filter_map(Result::ok)
            .map(|(id, b)| (id, sock4(b.addr, b.port), b.proto))
            .chain(
                self.be6
                    .iter()
                    .filter_map(Result::ok)
                    .map(|(id, b)| (id, sock6(b.addr, b.port), b.proto)),
            )
            .collect();
        for (id, addr, proto) in backends {
            match L4::from_number(proto) {
                Some(l4) => self.ids.adopt(id, (addr, l4)),
                None => self.delete_backend_entry(id, addr.is_ipv4()),
            }
        }
        self.programmed = fronts
            .into_iter()
            .map(|(k, slots)| {
                let (selected, fallback): (Vec<_>, Vec<_>) = slots
                    .into_iter()
                    .partition(|(slot, _)| *slot < FALLBACK_SLOT_BASE);
                let ids = |v: Vec<(u16, u32)>| v.into_iter().map(|(_, id)| id).collect();
                (
                    k,
                    writer::Slots {
                        selected: ids(selected),
                        fallback: ids(fallback),
                    },
                )
            })
            .collect();
        for slots in self.programmed.values() {
            for id in slots.ids() {
                self.ids.add_ref(id);
            }
        }
        // Entries no slot names (a crash between writes): nothing can reach them.
        for id in self.ids.unreferenced() {
            self.ids.forget(id);
            self.delete_backend_entry(id, true);
            self.delete_backend_entry(id, false);
        }
        if !self.programmed.is_empty() {
            tracing::info!(
                frontends = self.programmed.len(),
                "adopted pinned eBPF maps"
            );
        }
    }

    /// Attaches every program to `cgroup`, or keeps the links a previous agent pinned that run
    /// the same programs. In three phases, so that no hook is ever left without a program:
    /// each program is loaded (verified) and either its pinned link kept or a new link
    /// attached beside the old one (the two run in turn: the first translates, the second
    /// sees a backend and leaves it); only when every socket-address hook has its link are
    /// the new links pinned, each under a temporary name renamed over the old pin (the old
    /// link detaches when its pin goes). A socket-address hook that cannot be loaded or
    /// attached fails the call with nothing changed (the new links are dropped: detached);
    /// the `sock_ops` program of passive health is optional (a kernel that refuses it runs
    /// the socket LB without passive health, said in the log).
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), Error> {
        let file = File::open(cgroup).map_err(|source| Error::Cgroup {
            path: cgroup.to_path_buf(),
            source,
        })?;
        let ebpf = self.ebpf.as_mut().ok_or(Error::Missing("programs"))?;
        for d in ["links", "programs"] {
            let dir = self.pin_dir.join(d);
            std::fs::create_dir_all(&dir).map_err(|e| pin_err(&dir, e))?;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        let mut kept = Vec::new();
        let mut new = Vec::new();
        for &name in PROGRAMS {
            match link_program(ebpf, name, &self.pin_dir, &file) {
                Ok(Linked::Kept(link)) => kept.push(link),
                Ok(Linked::New(link)) => new.push((name, link)),
                Err(e) if name == SOCK_OPS_PROGRAM => {
                    tracing::warn!(error = %e, "the kernel refuses the sock_ops program: the socket LB runs without passive health (a backend whose connects fail is still chosen)");
                    self.passive_health = false;
                }
                // The new links are dropped here: detached; no pin was touched.
                Err(e) => return Err(e),
            }
        }
        // Pin every new link under its temporary name first: a socket-address hook whose pin
        // fails undoes this call's pins and fails the start with no pin changed.
        let mut staged: Vec<(&'static str, PinnedLink, PathBuf)> = Vec::new();
        for (name, link) in new {
            // bpffs refuses names with a dot: the temporary name is `NAME_next`.
            let tmp = self.pin_dir.join("links").join(format!("{name}_next"));
            let _ = std::fs::remove_file(&tmp);
            match link.pin(&tmp) {
                Ok(pinned) => staged.push((name, pinned, tmp)),
                Err(e) if name == SOCK_OPS_PROGRAM => {
                    tracing::warn!(error = %e, "could not pin the sock_ops program's link: the socket LB runs without passive health");
                    self.passive_health = false;
                }
                Err(e) => {
                    for (_, _, t) in &staged {
                        let _ = std::fs::remove_file(t);
                    }
                    return Err(pin_err(&tmp, e));
                }
            }
        }
        self.adopted_links = kept.len();
        self.links.extend(kept);
        let mut replaced = 0;
        for (name, pinned, tmp) in staged {
            let pin = self.pin_dir.join("links").join(name);
            let old = pin.exists();
            if let Err(e) = std::fs::rename(&tmp, &pin) {
                let _ = std::fs::remove_file(&tmp);
                // Held, not pinned: attached while this agent runs, beside any older one.
                tracing::error!(program = name, pin = %pin.display(), error = %e, "could not put the new link in place; it stays attached only while this agent runs");
                self.links.push(pinned);
                continue;
            }
            let _ = std::fs::set_permissions(&pin, std::fs::Permissions::from_mode(0o600));
            self.links.push(pinned);
            replaced += usize::from(old);
            pin_program(ebpf, name, &self.pin_dir);
        }
        if replaced > 0 {
            tracing::info!(
                replaced,
                kept = self.adopted_links,
                "replaced pinned programs of another agent version, the new ones attached first: no gap"
            );
        } else if self.adopted_links > 0 {
            tracing::info!(
                adopted = self.adopted_links,
                "kept pinned links: no detach, no gap"
            );
        } else {
            tracing::info!(cgroup = %cgroup.display(), programs = PROGRAMS.len(), "attached socket LB");
        }
        Ok(())
    }

    /// Picks backends from per-frontend Maglev tables keyed by the client's network namespace
    /// (each client pod consistently lands on one backend; a backend change moves the fewest
    /// clients) instead of at random per connection. Applies to frontends programmed after.
    pub fn set_maglev(&mut self, on: bool) {
        self.maglev = on;
    }

    fn svc_id(&mut self, k: FrontKey) -> u32 {
        if let Some(&id) = self.svc_ids.get(&k) {
            return id;
        }
        let id = self.free_svc_ids.pop().unwrap_or_else(|| {
            let id = self.next_svc_id;
            self.next_svc_id += 1;
            id
        });
        self.svc_ids.insert(k, id);
        id
    }

    /// Links adopted from a previous run.
    pub fn adopted_links(&self) -> usize {
        self.adopted_links
    }

    /// Number of frontends (slot-0 entries) in the maps, read back from the kernel.
    pub fn frontends_in_map(&self) -> usize {
        self.svc4
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.slot == 0)
            .count()
            + self
                .svc6
                .keys()
                .filter_map(Result::ok)
                .filter(|k| k.slot == 0)
                .count()
    }

    /// Removes the pinned links (detaching the programs) and maps of `pin_dir`.
    pub fn uninstall(pin_dir: &Path) -> Result<usize, Error> {
        let mut removed = 0;
        let links = pin_dir.join("links");
        if let Ok(dir) = std::fs::read_dir(&links) {
            for e in dir.filter_map(Result::ok) {
                std::fs::remove_file(e.path()).map_err(|err| pin_err(&e.path(), err))?;
                removed += 1;
            }
        }
        let _ = std::fs::remove_dir(&links);
        let programs = pin_dir.join("programs");
        if let Ok(dir) = std::fs::read_dir(&programs) {
            for e in dir.filter_map(Result::ok) {
                std::fs::remove_file(e.path()).map_err(|err| pin_err(&e.path(), err))?;
            }
        }
        let _ = std::fs::remove_dir(&programs);
        for m in ALL_MAPS {
            let p = pin_dir.join(m);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| pin_err(&p, e))?;
                removed += 1;
            }
        }
        let _ = std::fs::remove_dir(pin_dir);
        Ok(removed)
    }
}

/// Logs the sizes the maps have, and each adopted map smaller than the caps want (made by an
/// agent with smaller caps, or by one from before the maps were sized, preallocated at 65,536).
/// `have`: (map, entries wanted, entries it has, its flags).
fn report_sizes(have: &[(&'static str, u32, u32, u32)], capacity: MapSizes) {
    for &(map, wanted, entries, flags) in have {
        if entries < wanted {
            tracing::warn!(
                map,
                entries,
                wanted,
                preallocated = flags & SIZED_MAP_FLAGS == 0,
                "a pinned eBPF map is smaller than the caps want; frontends that do not fit are \
                 rejected as unprogrammable. `mcs-agent uninstall` (connects are not translated \
                 until the agent is back) and a restart make it anew at the wanted size"
            );
        }
    }
    tracing::info!(
        services = capacity.services,
        backends = capacity.backends,
        members = capacity.members,
        maglev = capacity.maglev,
        "eBPF map sizes (entries; allocated as written)"
    );
}

/// Opens the pinned hash map `name` in `dir` (`lru`: an LRU hash map) without loading programs.
fn open_pinned<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &'static str,
    lru: bool,
) -> Result<HashMap<MapData, K, V>, Error> {
    let err = |source| Error::Map { name, source };
    let data = MapData::from_pin(dir.join(name)).map_err(err)?;
    let map = if lru {
        aya::maps::Map::LruHashMap(data)
    } else {
        aya::maps::Map::HashMap(data)
    };
    HashMap::try_from(map).map_err(err)
}

/// Entries of the reverse-NAT maps pinned in `pin_dir` (IPv4, IPv6).
pub fn reverse_entries(pin_dir: &Path) -> Result<(usize, usize), Error> {
    use mcs_ebpf_common::{
        REVNAT4_MAP, REVNAT6_MAP, RevNat4Key, RevNat4Value, RevNat6Key, RevNat6Value,
    };
    let v4: HashMap<_, RevNat4Key, RevNat4Value> = open_pinned(pin_dir, REVNAT4_MAP, true)?;
    let v6: HashMap<_, RevNat6Key, RevNat6Value> = open_pinned(pin_dir, REVNAT6_MAP, true)?;
    Ok((
        v4.keys().filter_map(Result::ok).count(),
        v6.keys().filter_map(Result::ok).count(),
    ))
}

/// Reads what the pinned maps in `pin_dir` hold (no program is loaded).
pub fn read_pinned(pin_dir: &Path) -> Result<Programmed, Error> {
    let svc4: HashMap<_, Svc4Key, SvcValue> = open_pinned(pin_dir, SVC4_MAP, false)?;
    let be4: HashMap<_, u32, Backend4> = open_pinned(pin_dir, BE4_MAP, false)?;
    let svc6: HashMap<_, Svc6Key, SvcValue> = open_pinned(pin_dir, SVC6_MAP, false)?;
    let be6: HashMap<_, u32, Backend6> = open_pinned(pin_dir, BE6_MAP, false)?;
    // Frontend text → slot → backend text; and each frontend's selected count (slot 0).
    let mut slots: BTreeMap<String, BTreeMap<u16, String>> = BTreeMap::new();
    let mut selected: BTreeMap<String, u16> = BTreeMap::new();
    let mut record =
        |vip: SocketAddr, proto: u8, slot: u16, v: SvcValue, backend: Option<SocketAddr>| {
            let name = L4::from_number(proto).map_or("?", L4::name);
            let front = format!("{vip}/{name}");
            if slot == 0 {
                selected.insert(front.clone(), v.count);
            }
            let e = slots.entry(front).or_default();
            if slot > 0 {
                let id = v.backend_id;
                let b =
                    backend.map_or_else(|| format!("<missing backend {id}>"), |b| b.to_string());
                e.insert(slot, b);
            }
        };
    for (k, v) in svc4.iter().filter_map(Result::ok) {
        let be = (k.slot > 0)
            .then(|| be4.get(&v.backend_id, 0).ok())
            .flatten()
            .map(|b| sock4(b.addr, b.port));
        record(sock4(k.vip, k.port), k.proto, k.slot, v, be);
    }
    for (k, v) in svc6.iter().filter_map(Result::ok) {
        let be = (k.slot > 0)
            .then(|| be6.get(&v.backend_id, 0).ok())
            .flatten()
            .map(|b| sock6(b.addr, b.port));
        record(sock6(k.vip, k.port), k.proto, k.slot, v, be);
    }
    let mut frontends = BTreeMap::new();
    let mut fallbacks = BTreeMap::new();
    for (f, s) in slots {
        let (sel, fall): (Vec<_>, Vec<_>) = s
            .into_iter()
            .partition(|(slot, _)| *slot < FALLBACK_SLOT_BASE);
        if !fall.is_empty() {
            fallbacks.insert(f.clone(), fall.into_iter().map(|(_, b)| b).collect());
        }
        frontends.insert(f, sel.into_iter().map(|(_, b)| b).collect());
    }
    let member: HashMap<_, MemberKey, u32> = open_pinned(pin_dir, MEMBER_MAP, false)?;
    // Absent where an agent from before passive health pinned the maps.
    let failed: Option<HashMap<_, FailedKey, FailedValue>> =
        open_pinned(pin_dir, FAILED_MAP, true).ok();
    let maglev: HashMap<_, MaglevKey, u32> = open_pinned(pin_dir, MAGLEV_MAP, false)?;
    let fill = |name: &'static str, map: &MapData, entries: usize| {
        let info = map.info().map_err(|source| Error::Map { name, source })?;
        Ok::<_, Error>((
            name,
            MapFill {
                entries,
                max_entries: info.max_entries(),
            },
        ))
    };
    let mut maps: BTreeMap<&'static str, MapFill> = [
        fill(SVC4_MAP, svc4.map(), svc4.keys().count())?,
        fill(SVC6_MAP, svc6.map(), svc6.keys().count())?,
        fill(BE4_MAP, be4.map(), be4.keys().count())?,
        fill(BE6_MAP, be6.map(), be6.keys().count())?,
        fill(MEMBER_MAP, member.map(), member.keys().count())?,
        fill(MAGLEV_MAP, maglev.map(), maglev.keys().count())?,
    ]
    .into_iter()
    .collect();
    if let Some(failed) = &failed {
        let (name, f) = fill(FAILED_MAP, failed.map(), failed.keys().count())?;
        maps.insert(name, f);
    }
    Ok(Programmed {
        frontends,
        fallbacks,
        maps,
    })
}

/// An IPv4 address and port as the maps hold them (network byte order) → `SocketAddr`.
fn sock4(addr: u32, port_be: u16) -> SocketAddr {
    SocketAddr::new(
        IpAddr::V4(Ipv4Addr::from(addr.to_ne_bytes())),
        u16::from_be(port_be),
    )
}

/// An IPv6 address (four network-order words) and port → `SocketAddr`.
fn sock6(addr: [u32; 4], port_be: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(ip6_from_words(addr)), u16::from_be(port_be))
}

/// An IPv6 address as the kernel's `user_ip6`: four words, each in network byte order.
pub fn ip6_words(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    core::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

fn ip6_from_words(w: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, word) in w.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_words_round_trip_in_network_order() {
        let ip: Ipv6Addr = "2001:2::1:2".parse().unwrap();
        let w = ip6_words(ip);
        assert_eq!(w[0].to_ne_bytes(), [0x20, 0x01, 0x00, 0x02]);
        assert_eq!(ip6_from_words(w), ip);
    }

    #[test]
    fn map_sizes_hold_the_largest_table_the_caps_admit() {
        // The default caps: 10,000 frontends, 100,000 backends, one frontend's room.
        let d = MapSizes::default();
        assert_eq!(d.services, 10_000 + 100_000 + 1025);
        assert_eq!(d.backends, 100_000 + 1025);
        assert_eq!(d.members, d.services);
        assert_eq!(d.maglev, MAGLEV_MAP_MAX_ENTRIES);
        // 100k imports x 2 clusters x 5 endpoints, Maglev on.
        let big = MapSizes::for_caps(100_000, 1_000_000, true);
        assert_eq!(big.services, 1_101_025);
        // 251 entries a frontend: Maglev tables for 16,710 frontends at most (the others
        // choose at random, said in the log).
        assert_eq!(big.maglev, MapSizes::MAX_ENTRIES);
        let maglev = MapSizes::for_caps(10_000, 100_000, true);
        assert_eq!(maglev.maglev, 10_001 * MAGLEV_TABLE_SIZE);
        // Caps beyond any map: clamped, not wrapped.
        let huge = MapSizes::for_caps(usize::MAX, usize::MAX, true);
        assert_eq!(huge.services, MapSizes::MAX_ENTRIES);
        assert_eq!(huge.maglev, MapSizes::MAX_ENTRIES);
        let zero = MapSizes::for_caps(0, 0, false);
        assert_eq!(zero.services, 1025);
    }

    #[test]
    fn object_is_embedded() {
        assert_eq!(&OBJECT[..4], b"\x7fELF");
    }
}
