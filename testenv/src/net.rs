//! Loopback ports for the components the tests start.

use std::hash::{BuildHasher, RandomState};
use std::io;
use std::net::TcpListener;

/// A loopback port that is free now and that no outgoing connection will take.
///
/// `bind(0)` hands out a port from the kernel's ephemeral range, the same range outgoing
/// connections take their source ports from. Between releasing that port and the component
/// binding it, a connection (kube-apiserver to etcd opens dozens) can take it, and the
/// component exits with "address already in use". Ports below the ephemeral range are never
/// chosen for outgoing connections, so a free one stays free unless another test picks it too:
/// unlikely among ~10 000 random candidates, and checked by binding.
pub fn free_port() -> io::Result<u16> {
    let (low, _) = ephemeral_range();
    let first = 10_000u16;
    let last = low.saturating_sub(1).max(first + 1_000);
    let random = RandomState::new();
    for attempt in 0u32..200 {
        let span = u64::from(last - first) + 1;
        let port = first + (random.hash_one((attempt, std::process::id())) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The kernel's range for outgoing source ports (Linux's default when unreadable).
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut parts = s.split_whitespace().map(str::parse::<u16>);
            Some((parts.next()?.ok()?, parts.next()?.ok()?))
        })
        .unwrap_or((32_768, 60_999))
}
