//! Loader of the eBPF socket load balancer: load the embedded programs, attach them to a
//! cgroup v2, and program frontends into the maps.
//!
//! Map update order (see `mcs_ebpf_common`): backends first, then backend slots `1..=n`, then
//! the frontend at slot 0 with the new count, then stale slots and backends are freed. A
//! concurrent `connect()` therefore never reads a count that points to a missing slot.

use std::{
    collections::BTreeMap,
    fs::File,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData},
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use mcs_ebpf_common::{BE4_MAP, Backend4, MAX_BACKENDS_PER_SVC, SVC4_MAP, Svc4Key, SvcValue};

/// The object built by `build.rs`, 8-byte aligned as the ELF parser wants.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mcs-ebpf"));

/// Names of the programs in the object and the hook each one attaches to.
pub const PROGRAMS: &[&str] = &["mcs_connect4"];

/// Errors of the eBPF loader.
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
    /// A map is missing from the object or has the wrong type.
    #[error("map {name}: {source}")]
    Map {
        /// Map name.
        name: &'static str,
        /// Cause.
        #[source]
        source: aya::maps::MapError,
    },
    /// A map is missing from the object.
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(&'static str),
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
}

/// The IP protocol of a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    fn number(self) -> u8 {
        match self {
            Self::Tcp => mcs_ebpf_common::proto::TCP,
            Self::Udp => mcs_ebpf_common::proto::UDP,
        }
    }
}

/// A loaded socket load balancer. Dropping it detaches the programs (pinning, so that traffic
/// survives an agent restart, comes with the full socket LB).
#[derive(Debug)]
pub struct SocketLb {
    ebpf: Ebpf,
    services: HashMap<MapData, Svc4Key, SvcValue>,
    backends: HashMap<MapData, u32, Backend4>,
    /// Backend slots currently programmed per frontend, to free stale ones.
    programmed: BTreeMap<(SocketAddrV4, Protocol), Vec<u32>>,
    next_backend_id: u32,
}

impl SocketLb {
    /// Loads the embedded programs and takes their maps. Needs CAP_BPF/CAP_SYS_ADMIN.
    pub fn load() -> Result<Self, Error> {
        let mut ebpf = Ebpf::load(OBJECT)?;
        for &name in PROGRAMS {
            let prog: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or(Error::MissingMap(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.load()
                .map_err(|source| Error::Program { name, source })?;
        }
        let services = take_hash_map(&mut ebpf, SVC4_MAP)?;
        let backends = take_hash_map(&mut ebpf, BE4_MAP)?;
        Ok(Self {
            ebpf,
            services,
            backends,
            programmed: BTreeMap::new(),
            next_backend_id: 1,
        })
    }

    /// Attaches every program to the cgroup v2 directory `cgroup` (it then applies to every
    /// process in that cgroup and below).
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), Error> {
        let file = File::open(cgroup).map_err(|source| Error::Cgroup {
            path: cgroup.to_path_buf(),
            source,
        })?;
        for &name in PROGRAMS {
            let prog: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .ok_or(Error::MissingMap(name))?
                .try_into()
                .map_err(|source| Error::Program { name, source })?;
            prog.attach(&file, CgroupAttachMode::Single)
                .map_err(|source| Error::Program { name, source })?;
            tracing::info!(program = name, cgroup = %cgroup.display(), "attached");
        }
        Ok(())
    }

    /// Programs (or replaces) the frontend `vip/proto` with `backends`, in the safe order.
    pub fn set_service(
        &mut self,
        vip: SocketAddrV4,
        proto: Protocol,
        backends: &[SocketAddrV4],
    ) -> Result<(), Error> {
        let count = u16::try_from(backends.len())
            .ok()
            .filter(|&n| n <= MAX_BACKENDS_PER_SVC)
            .ok_or(Error::TooManyBackends(backends.len()))?;
        let (vip_be, port_be) = (ip_be(*vip.ip()), vip.port().to_be());
        let p = proto.number();
        let map_err = |source| Error::Map {
            name: SVC4_MAP,
            source,
        };
        // 1. Backends, under fresh ids.
        let mut ids = Vec::with_capacity(backends.len());
        for be in backends {
            let id = self.alloc_backend_id();
            let value = Backend4 {
                addr: ip_be(*be.ip()),
                port: be.port().to_be(),
                proto: p,
                ..Default::default()
            };
            self.backends
                .insert(id, value, 0)
                .map_err(|source| Error::Map {
                    name: BE4_MAP,
                    source,
                })?;
            ids.push(id);
        }
        // 2. Slots 1..=count.
        for (i, &id) in ids.iter().enumerate() {
            let key = Svc4Key::new(vip_be, port_be, p, i as u16 + 1);
            let value = SvcValue {
                backend_id: id,
                ..Default::default()
            };
            self.services.insert(key, value, 0).map_err(map_err)?;
        }
        // 3. The frontend last.
        let front = SvcValue {
            count,
            ..Default::default()
        };
        self.services
            .insert(Svc4Key::new(vip_be, port_be, p, 0), front, 0)
            .map_err(map_err)?;
        // 4. Free what the previous version used beyond the new count, and its backends.
        let old = self
            .programmed
            .insert((vip, proto), ids)
            .unwrap_or_default();
        for slot in (backends.len() + 1)..=old.len() {
            let _ = self
                .services
                .remove(&Svc4Key::new(vip_be, port_be, p, slot as u16));
        }
        for id in old {
            let _ = self.backends.remove(&id);
        }
        Ok(())
    }

    fn alloc_backend_id(&mut self) -> u32 {
        let id = self.next_backend_id;
        self.next_backend_id = self.next_backend_id.checked_add(1).unwrap_or(1);
        id
    }

    /// Number of frontends (slot-0 entries) in the services map, read back from the kernel.
    pub fn frontends_in_map(&self) -> usize {
        self.services
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.slot == 0)
            .count()
    }
}

fn take_hash_map<K: aya::Pod, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>, Error> {
    let map = ebpf.take_map(name).ok_or(Error::MissingMap(name))?;
    HashMap::try_from(map).map_err(|source| Error::Map { name, source })
}

/// An IPv4 address as the kernel's `user_ip4`: network byte order in a native `u32`.
fn ip_be(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_is_kept_in_network_order() {
        let v = ip_be(Ipv4Addr::new(198, 18, 0, 10));
        assert_eq!(v.to_ne_bytes(), [198, 18, 0, 10]);
    }

    #[test]
    fn object_is_embedded() {
        // An ELF object for the BPF machine.
        assert_eq!(&OBJECT[..4], b"\x7fELF");
    }
}
