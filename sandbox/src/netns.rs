//! Network namespaces for the demo and the dataplane tests, always removed.
//!
//! Only addresses from 198.18.0.0/15 (IPv4) and 2001:2::/48 (IPv6) may be assigned; anything
//! else panics, so a test can never send traffic to a real network.

use std::{
    net::IpAddr,
    path::PathBuf,
    process::{Command, Output},
};

use anyhow::{Context as _, bail};

/// Whether `ip` is an address tests may use: 198.18.0.0/15, 2001:2::/48 or loopback.
pub fn is_test_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback() || (o[0] == 198 && (o[1] == 18 || o[1] == 19))
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            v6.is_loopback() || (s[0] == 0x2001 && s[1] == 0x0002 && s[2] == 0)
        }
    }
}

/// Panics unless `cidr`'s address is a test address (see [`is_test_address`]).
pub fn check_cidr(cidr: &str) {
    let addr = cidr.split('/').next().unwrap_or_default();
    let ip: IpAddr = addr
        .parse()
        .unwrap_or_else(|_| panic!("not an IP address: {cidr}"));
    assert!(
        is_test_address(ip),
        "{cidr} is outside 198.18.0.0/15 and 2001:2::/48: tests never use other addresses"
    );
}

/// A network namespace named `mcst<pid>-<tag><n>`, with `lo` up. Deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        crate::sweep_stale();
        let name = crate::unique_name(tag);
        run_ip(&["netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Its name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of its handle under /run/netns.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip <args>` inside the namespace (`ip -n NAME ...`); fails with ip's message.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        run_ip(&all)
    }

    /// Assigns `cidr` (a test address) to `dev` and brings `dev` up.
    pub fn addr(&self, dev: &str, cidr: &str) -> anyhow::Result<()> {
        check_cidr(cidr);
        let v6 = cidr.contains(':');
        let mut args = vec![];
        if v6 {
            args.push("-6");
        }
        args.extend(["addr", "add", cidr, "dev", dev]);
        if v6 {
            args.push("nodad");
        }
        self.ip(&args)?;
        self.ip(&["link", "set", dev, "up"])
    }

    /// Adds a route `dst via gw` (`dst` may be `default`).
    pub fn route(&self, dst: &str, via: &str) -> anyhow::Result<()> {
        if dst != "default" {
            check_cidr(dst);
        }
        check_cidr(via);
        let fam = if via.contains(':') { "-6" } else { "-4" };
        self.ip(&[fam, "route", "add", dst, "via", via])
    }

    /// Turns on IPv4 and IPv6 forwarding inside the namespace.
    pub fn enable_forwarding(&self) -> anyhow::Result<()> {
        for key in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            let out = self.command("sysctl").args(["-qw", key]).output()?;
            check_output("sysctl", &out)?;
        }
        Ok(())
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// Runs `f` on a thread that has entered this namespace, and returns its result. Sockets
    /// created inside `f` belong to the namespace and may be used from any thread afterwards.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        let file = std::fs::File::open(self.path())
            .with_context(|| format!("opening {}", self.path().display()))?;
        std::thread::scope(|s| {
            s.spawn(move || {
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .context("setns into the test namespace")?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("closure inside netns panicked"))?
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run_ip(&["netns", "del", &self.name]) {
            eprintln!("warning: removing netns {}: {e:#}", self.name);
        }
    }
}

/// Creates a veth pair: `a_dev` in `a`, `b_dev` in `b`. Both ends go with their namespaces.
pub fn veth(a: &Netns, a_dev: &str, b: &Netns, b_dev: &str) -> anyhow::Result<()> {
    // Created inside `a` so that no interface ever appears in the host namespace.
    a.ip(&[
        "link",
        "add",
        a_dev,
        "type",
        "veth",
        "peer",
        "name",
        b_dev,
        "netns",
        b.name(),
    ])?;
    a.ip(&["link", "set", a_dev, "up"])?;
    b.ip(&["link", "set", b_dev, "up"])
}

/// Two namespaces joined by a veth pair with `a_cidr`/`b_cidr` on `eth0` each side.
#[derive(Debug)]
pub struct Pair {
    /// First namespace (device `eth0`, address `a_cidr`).
    pub a: Netns,
    /// Second namespace (device `eth0`, address `b_cidr`).
    pub b: Netns,
}

impl Pair {
    /// Builds the pair.
    pub fn new(a_cidr: &str, b_cidr: &str) -> anyhow::Result<Self> {
        let a = Netns::new("a")?;
        let b = Netns::new("b")?;
        veth(&a, "eth0", &b, "eth0")?;
        a.addr("eth0", a_cidr)?;
        b.addr("eth0", b_cidr)?;
        Ok(Self { a, b })
    }
}

fn run_ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    check_output(&format!("ip {}", args.join(" ")), &out)
}

pub(crate) fn check_output(what: &str, out: &Output) -> anyhow::Result<()> {
    if !out.status.success() {
        bail!(
            "{what}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Deletes `mcst<pid>...` namespaces whose test process is gone.
pub(crate) fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for entry in dir.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if crate::owner_pid(&name).is_some_and(|p| !crate::pid_alive(p)) {
            let _ = run_ip(&["netns", "del", &name]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_test_address;

    #[test]
    #[should_panic(expected = "outside 198.18.0.0/15")]
    fn other_addresses_are_refused_before_touching_the_system() {
        super::check_cidr("10.0.0.1/8");
    }

    #[test]
    fn only_benchmarking_ranges_and_loopback_are_test_addresses() {
        for ok in [
            "198.18.0.1",
            "198.19.255.254",
            "127.0.0.1",
            "::1",
            "2001:2::1",
            "2001:2:0:ff::1",
        ] {
            assert!(is_test_address(ok.parse().unwrap()), "{ok}");
        }
        for bad in [
            "10.0.0.1",
            "192.168.1.1",
            "198.20.0.1",
            "8.8.8.8",
            "2001:2:1::1",
            "fe80::1",
        ] {
            assert!(!is_test_address(bad.parse().unwrap()), "{bad}");
        }
    }
}
