//! Production-shaped metrics for the simulated nodes: node-exporter's NIC counters per node, and
//! Prometheus file-based discovery files for the nodes and for every running loader process.

use super::net::NetNode;
use super::pods::LoaderTarget;
use anyhow::{Context, Result};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// node-exporter's text for one node; the device is the node's `eth0`.
pub fn node_metrics(node: &NetNode) -> Result<String> {
    let (rx, tx) = node.counters()?;
    // node-exporter reports the link speed; here it is the enforced (scaled) rate.
    let speed = node.mbit.map(|m| u64::from(m) * 1_000_000 / 8).unwrap_or(0);
    Ok(format!(
        "# HELP node_network_receive_bytes_total Network device statistic receive_bytes.\n\
         # TYPE node_network_receive_bytes_total counter\n\
         node_network_receive_bytes_total{{device=\"eth0\"}} {rx}\n\
         # HELP node_network_transmit_bytes_total Network device statistic transmit_bytes.\n\
         # TYPE node_network_transmit_bytes_total counter\n\
         node_network_transmit_bytes_total{{device=\"eth0\"}} {tx}\n\
         # HELP node_network_speed_bytes Value of /sys/class/net/<iface>/speed in bytes.\n\
         # TYPE node_network_speed_bytes gauge\n\
         node_network_speed_bytes{{device=\"eth0\"}} {speed}\n"
    ))
}

/// Serves `/nodes/<name>/metrics` for every node until the task is dropped.
pub async fn serve(listener: TcpListener, nodes: Arc<Vec<(String, NetNode)>>) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            continue;
        };
        let nodes = nodes.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                match socket.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let request = String::from_utf8_lossy(&buf);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let path = path.split('?').next().unwrap_or(path);
            let node = path
                .strip_prefix("/nodes/")
                .and_then(|p| p.strip_suffix("/metrics"))
                .and_then(|name| nodes.iter().find(|(n, _)| n == name));
            let (status, body) = match node.map(|(_, n)| node_metrics(n)) {
                Some(Ok(body)) => ("200 OK", body),
                Some(Err(err)) => ("500 Internal Server Error", format!("{err:#}\n")),
                None => ("404 Not Found", "not found\n".to_string()),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(body.as_bytes()).await;
            let _ = socket.shutdown().await;
        });
    }
}

/// Writes `path` through a temporary file and a rename, so Prometheus never reads half a file.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| tmp.display().to_string())?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())?;
    Ok(())
}

/// `nodes.json`: one target group per node, on the exporter's address, labelled `node`.
pub fn write_node_targets(path: &Path, exporter: &str, nodes: &[String]) -> Result<()> {
    let groups: Vec<_> = nodes
        .iter()
        .map(|n| {
            json!({
                "targets": [exporter],
                "labels": {"node": n, "__metrics_path__": format!("/nodes/{n}/metrics")},
            })
        })
        .collect();
    write_atomic(path, &serde_json::to_string_pretty(&groups)?)
}

/// `loaders.json`: one target per running loader process.
pub fn write_loader_targets(path: &Path, targets: &[LoaderTarget]) -> Result<()> {
    let groups: Vec<_> = targets
        .iter()
        .map(|t| {
            json!({
                "targets": [t.address],
                "labels": {
                    "pod": t.pod, "namespace": t.namespace, "node": t.node,
                    "container": t.container, "role": t.role, "pipeline": t.pipeline,
                },
            })
        })
        .collect();
    write_atomic(path, &serde_json::to_string_pretty(&groups)?)
}
