//! The simulated nodes' network: one network namespace per node, joined to a bridge in the root
//! namespace by a veth pair whose two ends are rate-limited with `tc tbf` to the node's (scaled)
//! NIC speed, so that traffic between nodes, and between nodes and the S3 namespace, crosses
//! the sending node's NIC and the receiving node's NIC like on a real cluster.
//!
//! Addresses: a runtime takes a *slot* `s` (0..8, held with a lock file so that runtimes of
//! concurrent test binaries never collide) and the subnet 10.213.(32s).0/19 in it:
//! - the bridge `stk<s>br` is 10.213.(32s).1;
//! - node `i` (1-based) has the pod CIDR 10.213.(32s+i).0/24, its `eth0` is .254 in it, and every
//!   pod of the node gets one address from that /24 as a secondary address on `eth0`;
//! - the S3 namespace `stk<s>-s3` is 10.213.(32s+31).1.
//!
//! Every name starts with `stk<s>`: namespaces `stk<s>-<node>`, host-side veths `stk<s>n<i>`.
//! Leftovers of a slot whose lock is free (a runtime that was killed) are removed at start.

use anyhow::{Context, Result, anyhow, bail};
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Slots available on one machine: 10.213.0.0/16 split in /19s.
pub const SLOTS: u8 = 8;
/// Node indexes per slot: .1 is the bridge's /24, .31 the S3 namespace's.
pub const MAX_NODES: usize = 30;
const LOCK_DIR: &str = "/run/stoker-testenv";

/// A slot held for the life of a runtime; the lock is released when the file is closed, also
/// when the process dies.
pub struct Slot {
    pub index: u8,
    _lock: File,
}

/// `ip` or `tc` with arguments; fails with the command's stderr.
pub fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} (iproute2 installed? see scripts/deps.sh)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program).args(args).output()?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn try_lock(index: u8) -> Result<Option<File>> {
    std::fs::create_dir_all(LOCK_DIR)?;
    let path = PathBuf::from(LOCK_DIR).join(format!("slot-{index}.lock"));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock(2) on a file descriptor we own.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    Ok((rc == 0).then_some(file))
}

impl Slot {
    /// Takes `wanted`, or the first free slot, after removing the leftovers of every free slot.
    pub fn acquire(wanted: Option<u8>) -> Result<Slot> {
        let mut mine = None;
        for index in 0..SLOTS {
            let Some(lock) = try_lock(index)? else {
                continue;
            };
            remove_leftovers(index);
            if mine.is_none() && wanted.is_none_or(|w| w == index) {
                mine = Some(Slot { index, _lock: lock });
            }
        }
        mine.ok_or_else(|| match wanted {
            Some(w) => anyhow!(
                "network slot {w} (10.213.{}.0/19) is held by another runtime; \
                 the cluster's nodes already have pod CIDRs from that slot",
                u32::from(w) * 32
            ),
            None => anyhow!("all {SLOTS} network slots are held by other runtimes"),
        })
    }

    pub fn prefix(&self) -> String {
        prefix(self.index)
    }

    fn third_octet(&self, offset: usize) -> u8 {
        (usize::from(self.index) * 32 + offset) as u8
    }

    pub fn bridge_name(&self) -> String {
        format!("{}br", self.prefix())
    }

    pub fn bridge_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.third_octet(0), 1)
    }

    /// The pod CIDR of node `index` (1-based).
    pub fn pod_cidr(&self, index: usize) -> String {
        format!("10.213.{}.0/24", self.third_octet(index))
    }

    pub fn node_ip(&self, index: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.third_octet(index), 254)
    }

    pub fn s3_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.third_octet(31), 1)
    }

    /// The slot a pod CIDR made by [`Slot::pod_cidr`] belongs to.
    pub fn of_pod_cidr(cidr: &str) -> Option<u8> {
        let mut octets = cidr.split('/').next()?.split('.');
        let (a, b, c) = (octets.next()?, octets.next()?, octets.next()?);
        if a != "10" || b != "213" {
            return None;
        }
        let c: u8 = c.parse().ok()?;
        Some(c / 32)
    }
}

fn prefix(index: u8) -> String {
    format!("stk{index}")
}

/// Deletes the namespaces (killing what runs in them) and links of slot `index`.
pub fn remove_leftovers(index: u8) {
    let prefix = prefix(index);
    if let Ok(list) = output("ip", &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if name.starts_with(&format!("{prefix}-")) {
                kill_netns_pids(name);
                let _ = run("ip", &["netns", "del", name]);
            }
        }
    }
    if let Ok(links) = output("ip", &["-o", "link", "show"]) {
        for line in links.lines() {
            // "12: stk0n1@if11: <...>"
            let Some(name) = line.split(':').nth(1) else {
                continue;
            };
            let name = name.trim().split('@').next().unwrap_or_default();
            if name.starts_with(&prefix) {
                let _ = run("ip", &["link", "del", name]);
            }
        }
    }
}

/// SIGKILL to every process in a namespace (the node's pods, when a runtime died).
pub fn kill_netns_pids(ns: &str) {
    if let Ok(pids) = output("ip", &["netns", "pids", ns]) {
        for pid in pids.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2); the pids are in a namespace only this runtime's slot uses.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The bridge in the root namespace that every node's veth joins.
pub struct Bridge {
    pub name: String,
    removed: AtomicBool,
}

impl Bridge {
    pub fn create(slot: &Slot) -> Result<Bridge> {
        let name = slot.bridge_name();
        run("ip", &["link", "add", &name, "type", "bridge"])?;
        let bridge = Bridge {
            name,
            removed: AtomicBool::new(false),
        };
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/19", slot.bridge_ip()),
                "dev",
                &bridge.name,
            ],
        )?;
        run("ip", &["link", "set", &bridge.name, "up"])?;
        Ok(bridge)
    }
}

impl Bridge {
    /// Deletes the bridge (once).
    pub fn remove(&self) {
        if !self.removed.swap(true, Ordering::SeqCst) {
            let _ = run("ip", &["link", "del", &self.name]);
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A namespace joined to the bridge: a simulated node, or the S3 namespace.
pub struct NetNode {
    /// Network namespace name (`stk<s>-<node>`).
    pub netns: String,
    /// Host end of the veth pair, in the root namespace, on the bridge.
    pub host_veth: String,
    /// The namespace's own address (`eth0`).
    pub ip: Ipv4Addr,
    /// The enforced rate in each direction, Mbit/s; `None`: unlimited.
    pub mbit: Option<u32>,
    removed: AtomicBool,
}

impl NetNode {
    /// Creates namespace `netns` with `eth0` at `ip`/19 on the bridge, loopback up, and, when
    /// `mbit` is given, a tbf qdisc on both veth ends (host end: traffic into the node; `eth0`:
    /// traffic out of it).
    pub fn create(
        bridge: &Bridge,
        netns: String,
        host_veth: String,
        ip: Ipv4Addr,
        mbit: Option<u32>,
    ) -> Result<NetNode> {
        run("ip", &["netns", "add", &netns])?;
        let node = NetNode {
            netns,
            host_veth,
            ip,
            mbit,
            removed: AtomicBool::new(false),
        };
        let peer = format!("{}p", node.host_veth);
        run(
            "ip",
            &[
                "link",
                "add",
                &node.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
                "netns",
                &node.netns,
            ],
        )?;
        run(
            "ip",
            &["link", "set", &node.host_veth, "master", &bridge.name, "up"],
        )?;
        node.exec(&["ip", "link", "set", &peer, "name", "eth0"])?;
        node.exec(&["ip", "addr", "add", &format!("{ip}/19"), "dev", "eth0"])?;
        node.exec(&["ip", "link", "set", "eth0", "up"])?;
        node.exec(&["ip", "link", "set", "lo", "up"])?;
        // No default route: from a node, only the slot's /19 (nodes, S3, the bridge) and the
        // node's own loopback are reachable.
        if let Some(mbit) = mbit {
            let tbf = tbf_args(mbit);
            let tbf: Vec<&str> = tbf.iter().map(String::as_str).collect();
            let mut host = vec!["qdisc", "replace", "dev", &node.host_veth, "root"];
            host.extend(&tbf);
            run("tc", &host)?;
            let mut inner = vec!["tc", "qdisc", "replace", "dev", "eth0", "root"];
            inner.extend(&tbf);
            node.exec(&inner)?;
        }
        Ok(node)
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    pub fn exec(&self, command: &[&str]) -> Result<()> {
        let mut args = vec!["netns", "exec", &self.netns];
        args.extend(command);
        run("ip", &args)
    }

    /// Adds a pod's address to `eth0` (idempotent).
    pub fn add_address(&self, ip: Ipv4Addr) -> Result<()> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.netns, "ip", "addr", "add"])
            .arg(format!("{ip}/32"))
            .args(["dev", "eth0"])
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Older iproute2 says "File exists", newer "Address already assigned": either way the
        // address is on this node, e.g. reused by KWOK from a pod that stopped here.
        if out.status.success()
            || stderr.contains("File exists")
            || stderr.contains("already assigned")
        {
            Ok(())
        } else {
            bail!("adding {ip} in {}: {}", self.netns, stderr.trim())
        }
    }

    pub fn remove_address(&self, ip: Ipv4Addr) {
        let _ = self.exec(&["ip", "addr", "del", &format!("{ip}/32"), "dev", "eth0"]);
    }

    /// Binds a TCP listener inside the namespace. Sockets keep the namespace they were made in,
    /// so the listener can be served from any thread.
    pub fn bind(&self, addr: SocketAddr) -> Result<std::net::TcpListener> {
        bind_in_netns(&self.netns, addr)
    }

    /// Bytes the node received and sent: the host end's counters, mirrored (what the node sends
    /// arrives at the host end).
    pub fn counters(&self) -> Result<(u64, u64)> {
        let read = |name: &str| -> Result<u64> {
            let path = format!("/sys/class/net/{}/statistics/{name}", self.host_veth);
            let text = std::fs::read_to_string(&path).with_context(|| path.clone())?;
            Ok(text.trim().parse()?)
        };
        Ok((read("tx_bytes")?, read("rx_bytes")?))
    }
}

impl NetNode {
    /// Kills what still runs in the namespace, deletes it and the veth pair (once).
    pub fn remove(&self) {
        if !self.removed.swap(true, Ordering::SeqCst) {
            kill_netns_pids(&self.netns);
            let _ = run("ip", &["netns", "del", &self.netns]);
            let _ = run("ip", &["link", "del", &self.host_veth]);
        }
    }
}

impl Drop for NetNode {
    fn drop(&mut self) {
        self.remove();
    }
}

/// tbf with a 10 ms bucket (at least a few full-size frames) and 50 ms of queue.
fn tbf_args(mbit: u32) -> Vec<String> {
    let bytes_per_sec = u64::from(mbit) * 1_000_000 / 8;
    let burst = (bytes_per_sec / 100).max(16 * 1024);
    [
        "tbf".to_string(),
        "rate".into(),
        format!("{mbit}mbit"),
        "burst".into(),
        burst.to_string(),
        "latency".into(),
        "50ms".into(),
    ]
    .to_vec()
}

/// Binds `addr` from a short-lived thread that has entered namespace `netns`.
pub fn bind_in_netns(netns: &str, addr: SocketAddr) -> Result<std::net::TcpListener> {
    let path = format!("/run/netns/{netns}");
    std::thread::scope(|s| {
        s.spawn(|| -> Result<std::net::TcpListener> {
            let ns = File::open(&path).with_context(|| format!("opening {path}"))?;
            // SAFETY: setns(2) on this thread only; the thread ends right after the bind.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error()).context("setns");
            }
            std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr} in {netns}"))
        })
        .join()
        .map_err(|_| anyhow!("bind thread panicked"))?
    })
}
