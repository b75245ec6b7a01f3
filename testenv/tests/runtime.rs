//! The node runtime runs pods bound to simulated nodes as local processes in per-node network
//! namespaces with rate-limited NICs, and a real Prometheus scrapes them. Needs root.
//!
//! These are tests of host-process mode (the containers are root processes of this machine),
//! so their namespaces admit privileged pods; `runc_runtime.rs` tests the strict mode.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::http;
use stoker_testenv::metrics::Exposition;
use stoker_testenv::prometheus::{Prometheus, PrometheusOptions};
use stoker_testenv::runtime::{ImageMapping, ImageSource, NodeRuntime, RuntimeOptions};

/// Image whose containers run their own `command` on this machine.
const HOST_IMAGE: &str = "stoker.test/host-command:1";
/// The node whose NIC the rate test limits, and its limit.
const SLOW_NODE: &str = "cpu-2";
const SLOW_MBIT: u32 = 80;

/// A stand-in for `stoker-loader` (building the real one is another crate's job): serves
/// `/metrics` as the text exposition format (Prometheus 3 refuses a scrape without its
/// Content-Type) on `$STOKER_HTTP_ADDR`, which the runtime sets to the pod IP.
fn fake_loader() -> PathBuf {
    let dir = std::env::temp_dir().join("stoker-runtime-test");
    std::fs::create_dir_all(&dir).unwrap();
    let server = dir.join("metrics_server.py");
    std::fs::write(
        &server,
        r##"import http.server, os
BODY = b"# TYPE stoker_fake_loader_up gauge\nstoker_fake_loader_up 1\n"
class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)
port = int(os.environ["STOKER_HTTP_ADDR"].rsplit(":", 1)[1])
http.server.HTTPServer((os.environ["POD_IP"], port), Metrics).serve_forever()
"##,
    )
    .unwrap();
    let script = dir.join("stoker-loader");
    let tmp = dir.join(format!("stoker-loader.{}", std::process::id()));
    std::fs::write(
        &tmp,
        format!("#!/bin/sh\nexec python3 {}\n", server.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, &script).unwrap();
    script
}

fn runtime() -> &'static NodeRuntime {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "stoker_testenv=info".into()),
        )
        .with_test_writer()
        .try_init();
    NodeRuntime::shared(|| RuntimeOptions {
        // A shell-script stand-in, run as the host process these tests are about.
        loader: Some(ImageSource::HostProcess(vec![
            fake_loader().display().to_string(),
        ])),
        images: vec![ImageMapping::host_command(HOST_IMAGE)],
        nic_mbit: BTreeMap::from([(SLOW_NODE.to_string(), SLOW_MBIT)]),
        max_grace: Duration::from_secs(5),
        ..RuntimeOptions::default()
    })
}

use stoker_testenv::eventually;

fn pod_ip(pod: &Pod) -> Option<Ipv4Addr> {
    pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()
}

fn netns_pids(netns: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "pids", netns])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// A node's node-exporter NIC counters: (received, transmitted) bytes.
async fn node_counters(rt: &NodeRuntime, node: &str) -> (u64, u64) {
    let url = rt.node_metrics_url(node);
    let (status, body) = http::get_url(&url).await.unwrap();
    assert_eq!(status, 200, "{url}: {body}");
    let metrics = Exposition::parse(&body);
    let counter = |series: &str| {
        metrics
            .get(series)
            .unwrap_or_else(|| panic!("{series} not in:\n{body}")) as u64
    };
    (
        counter("node_network_receive_bytes_total{device=\"eth0\"}"),
        counter("node_network_transmit_bytes_total{device=\"eth0\"}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_runs_in_its_nodes_namespace_at_its_pod_ip_until_deleted() {
    let rt = runtime();
    let ns = ControlPlane::shared().privileged_namespace("rt-pod").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let kubectl = ns.cluster().bin_dir().join("kubectl");
    // The container asks the API server (through the node namespace's proxy) for its node,
    // writes the answer into an emptyDir, and serves that directory on its pod IP.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-0"},
            "containers": [{
                "name": "web", "image": HOST_IMAGE,
                "command": ["sh", "-c",
                    "\"$KUBECTL\" get node \"$NODE\" -o name > \"$OUT/api.txt\" 2>&1; cd \"$OUT\" && exec python3 -m http.server --bind \"$POD_IP\" 8080"],
                "env": [
                    {"name": "KUBECTL", "value": kubectl.display().to_string()},
                    {"name": "OUT", "value": "/out"},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                ],
                "volumeMounts": [{"name": "out", "mountPath": "/out"}],
            }],
            "volumes": [{"name": "out", "emptyDir": {}}],
            "terminationGracePeriodSeconds": 5,
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();

    let ip = eventually("pod IP", Duration::from_secs(60), || async {
        pods.get("web").await.ok().as_ref().and_then(pod_ip)
    })
    .await;
    let node_ip = rt.node_ip("cpu-0").unwrap();
    assert_eq!(
        ip.octets()[..3],
        node_ip.octets()[..3],
        "pod IP {ip} is from cpu-0's pod CIDR ({node_ip}/24)"
    );
    let netns = rt.netns("cpu-0").unwrap();
    let addrs = Command::new("ip")
        .args([
            "netns", "exec", &netns, "ip", "-o", "addr", "show", "dev", "eth0",
        ])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&addrs.stdout).contains(&format!("{ip}/32")),
        "{ip} is an address inside {netns}"
    );

    let addr = SocketAddr::from((ip, 8080));
    let answer = eventually(
        "the pod's server, from the root namespace",
        Duration::from_secs(60),
        || async {
            http::get(addr, "/api.txt")
                .await
                .ok()
                .filter(|(s, _)| *s == 200)
        },
    )
    .await;
    assert_eq!(
        answer.1.trim(),
        "node/cpu-0",
        "the pod reached the API server from inside its node's namespace\n{}",
        rt.container_log(&ns.name, "web", "web")
    );
    assert!(
        !netns_pids(&netns).is_empty(),
        "the process runs in {netns}"
    );

    pods.delete("web", &DeleteParams::default()).await.unwrap();
    // (A dying multi-threaded process leaves `ip netns pids` before its sockets close, so
    // both are checked.)
    eventually(
        "the pod's processes to stop and its port to close",
        Duration::from_secs(30),
        || async {
            (netns_pids(&netns).is_empty()
                && TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err())
            .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_a_nodes_nic_limit_holds_and_its_counters_count_the_bytes() {
    let rt = runtime();
    let to = "cpu-3";
    assert_eq!(rt.nic_mbit(SLOW_NODE).unwrap(), SLOW_MBIT);
    let to_ip = rt.node_ip(to).unwrap();
    let listener = rt.bind(to, SocketAddr::from((to_ip, 5001))).unwrap();
    const BYTES: usize = 12_000_000;
    let receiver = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut buf = vec![0u8; 256 * 1024];
        let mut total = 0usize;
        let mut first = None;
        loop {
            let n = socket.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            first.get_or_insert_with(Instant::now);
            total += n;
        }
        (total, first.unwrap().elapsed())
    });
    let before_from = node_counters(rt, SLOW_NODE).await;
    let before_to = node_counters(rt, to).await;
    let sender = Command::new("timeout")
        .args(["60", "ip", "netns", "exec", &rt.netns(SLOW_NODE).unwrap()])
        .args([
            "python3",
            "-c",
            &format!(
                "import socket; s = socket.create_connection(('{to_ip}', 5001)); s.sendall(bytes({BYTES})); s.close()"
            ),
        ])
        .output()
        .unwrap();
    assert!(
        sender.status.success(),
        "sender: {}",
        String::from_utf8_lossy(&sender.stderr)
    );
    let (received, elapsed) = receiver.join().unwrap();
    assert_eq!(received, BYTES);
    let mbit = received as f64 * 8.0 / elapsed.as_secs_f64() / 1e6;
    eprintln!(
        "{SLOW_NODE} -> {to}: {received} bytes in {elapsed:?} = {mbit:.1} Mbit/s (limit {SLOW_MBIT})"
    );
    let limit = f64::from(SLOW_MBIT);
    assert!(
        (limit * 0.7..=limit * 1.3).contains(&mbit),
        "{mbit:.1} Mbit/s is not within 30% of the {SLOW_MBIT} Mbit/s limit"
    );

    let after_from = node_counters(rt, SLOW_NODE).await;
    let after_to = node_counters(rt, to).await;
    let sent = after_from.1 - before_from.1;
    let got = after_to.0 - before_to.0;
    eprintln!("node exporter: {SLOW_NODE} transmitted {sent} bytes, {to} received {got} bytes");
    let payload = BYTES as u64;
    // TCP/IP headers add a few percent; ACKs flow the other way.
    assert!(
        (payload..payload * 11 / 10).contains(&sent),
        "{SLOW_NODE} transmit counter grew by {sent}, payload {payload}"
    );
    assert!(
        (payload..payload * 11 / 10).contains(&got),
        "{to} receive counter grew by {got}, payload {payload}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_prometheus_scrapes_node_nics_and_loader_pods() {
    let rt = runtime();
    let prometheus = Prometheus::shared(|| PrometheusOptions::new(rt.sd_dir()));
    let ns = ControlPlane::shared().privileged_namespace("rt-prom").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "decoder-0",
                     "labels": {"stoker.dev/role": "decoder", "stoker.dev/pipeline": "p1"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-4"},
            "containers": [{
                "name": "decoder", "image": "ghcr.io/stoker-dev/stoker-loader:test",
                "args": ["decode", "--metrics", "0.0.0.0:9090"],
                "ports": [{"name": "metrics", "containerPort": 9090}],
                "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 1},
            }],
            "terminationGracePeriodSeconds": 5,
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    // Same, but its readiness probe asks a port nothing listens on: it never becomes Ready.
    let mut unready = pod.clone();
    unready.metadata.name = Some("decoder-1".into());
    unready.spec.as_mut().unwrap().containers[0]
        .readiness_probe
        .as_mut()
        .unwrap()
        .http_get
        .as_mut()
        .unwrap()
        .port = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9999);
    pods.create(&PostParams::default(), &unready).await.unwrap();
    // A trainer with the loader as a native sidecar: the sidecar runs and is scraped too.
    let trainer: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trainer-0",
                     "labels": {"stoker.dev/role": "trainer", "stoker.dev/pipeline": "p1"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-4"},
            "initContainers": [{
                "name": "stoker-sidecar", "image": "ghcr.io/stoker-dev/stoker-loader:test",
                "restartPolicy": "Always", "args": ["sidecar"],
            }],
            "containers": [{"name": "trainer", "image": HOST_IMAGE, "command": ["sleep", "600"]}],
            "terminationGracePeriodSeconds": 5,
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &trainer).await.unwrap();

    let nic = eventually(
        "Prometheus to have cpu-4's NIC counter",
        Duration::from_secs(60),
        || async {
            prometheus
                .query("node_network_transmit_bytes_total{job=\"node-exporter\",node=\"cpu-4\",device=\"eth0\"}")
                .await
                .ok()
                .filter(|r| r.len() == 1)
        },
    )
    .await;
    let scraped: f64 = nic[0]["value"][1].as_str().unwrap().parse().unwrap();
    let (_, now) = node_counters(rt, "cpu-4").await;
    assert!(scraped <= now as f64, "scraped {scraped} <= current {now}");
    let nodes = rt.node_names().len().to_string();
    eventually(
        "one NIC exporter per node in Prometheus",
        Duration::from_secs(60),
        || async {
            let count = prometheus
                .query("count(node_network_speed_bytes{job=\"node-exporter\"})")
                .await
                .ok()?;
            (count.first()?["value"][1].as_str()? == nodes).then_some(())
        },
    )
    .await;
    let slow = prometheus
        .query(&format!("node_network_speed_bytes{{node=\"{SLOW_NODE}\"}}"))
        .await
        .unwrap();
    assert_eq!(
        slow[0]["value"][1].as_str().unwrap(),
        (u64::from(SLOW_MBIT) * 1_000_000 / 8).to_string()
    );

    let query = format!(
        "stoker_fake_loader_up{{job=\"stoker-loaders\",namespace=\"{}\",pod=\"decoder-0\",node=\"cpu-4\",role=\"decoder\",pipeline=\"p1\"}}",
        ns.name
    );
    eventually(
        "Prometheus to scrape the loader pod",
        Duration::from_secs(60),
        || async { prometheus.query(&query).await.ok().filter(|r| r.len() == 1) },
    )
    .await;

    let query = format!(
        "stoker_fake_loader_up{{namespace=\"{}\",pod=\"trainer-0\",container=\"stoker-sidecar\",role=\"trainer\"}}",
        ns.name
    );
    eventually(
        "Prometheus to scrape the trainer's loader sidecar",
        Duration::from_secs(60),
        || async { prometheus.query(&query).await.ok().filter(|r| r.len() == 1) },
    )
    .await;

    let ready = |pod: &Pod| {
        pod.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status == "True")
    };
    eventually(
        "decoder-1 to be not Ready (its probe fails)",
        Duration::from_secs(30),
        || async { (!ready(&pods.get("decoder-1").await.ok()?)?).then_some(()) },
    )
    .await;
    eventually(
        "decoder-0 to be Ready (its probe passes)",
        Duration::from_secs(30),
        || async { ready(&pods.get("decoder-0").await.ok()?)?.then_some(()) },
    )
    .await;

    for name in ["decoder-0", "decoder-1", "trainer-0"] {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let sd = rt.sd_dir().join("loaders.json");
    eventually(
        "the loader target to leave file_sd",
        Duration::from_secs(30),
        || async {
            let text = std::fs::read_to_string(&sd).unwrap_or_default();
            (!text.contains(&ns.name)).then_some(())
        },
    )
    .await;
}

/// `python3 -c SIGNED_GET /bucket/key`: a SigV4-signed GET to `$S3` with the standard library
/// only; prints `got <bytes>`.
const SIGNED_GET: &str = r#"
import datetime, hashlib, hmac, os, sys, urllib.request
ep, path = os.environ['S3'], sys.argv[1]
host = ep.split('://')[1]
ak, sk = os.environ['AWS_ACCESS_KEY_ID'], os.environ['AWS_SECRET_ACCESS_KEY']
amz = datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%dT%H%M%SZ')
empty = hashlib.sha256(b'').hexdigest()
signed = 'host;x-amz-content-sha256;x-amz-date'
canon = f'GET\n{path}\n\nhost:{host}\nx-amz-content-sha256:{empty}\nx-amz-date:{amz}\n\n{signed}\n{empty}'
scope = f'{amz[:8]}/us-east-1/s3/aws4_request'
to_sign = f'AWS4-HMAC-SHA256\n{amz}\n{scope}\n' + hashlib.sha256(canon.encode()).hexdigest()
key = ('AWS4' + sk).encode()
for part in (amz[:8], 'us-east-1', 's3', 'aws4_request'):
    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
auth = f'AWS4-HMAC-SHA256 Credential={ak}/{scope}, SignedHeaders={signed}, Signature={sig}'
req = urllib.request.Request(ep + path, headers={'x-amz-date': amz, 'x-amz-content-sha256': empty, 'Authorization': auth})
print('got', len(urllib.request.urlopen(req).read()), flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_s3_gets_from_a_pod_cross_the_nodes_nic() {
    let rt = runtime();
    let root = tempfile::tempdir().unwrap();
    let s3 = rt
        .start_s3(stoker_testenv::s3::S3ServerConfig::new(root.path()))
        .unwrap();
    const SIZE: usize = 4_000_000;
    s3.create_bucket("data").unwrap();
    s3.put_object("data", "blob.bin", &vec![7u8; SIZE]).unwrap();
    let node = "cpu-5";
    let ns = ControlPlane::shared().privileged_namespace("rt-s3").await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ns.client.clone(), &ns.name);
    let secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key(), "AWS_SECRET_ACCESS_KEY": s3.secret_key()},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let before = node_counters(rt, node).await;
    // A SigV4-signed GET in plain Python, with credentials from the Secret (envFrom).
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "getter"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "containers": [{
                "name": "get", "image": HOST_IMAGE,
                "command": ["python3", "-c", SIGNED_GET, "/data/blob.bin"],
                "env": [{"name": "S3", "value": s3.endpoint()}],
                "envFrom": [{"secretRef": {"name": "s3-creds"}}],
            }],
        }
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    eventually("the pod's GET", Duration::from_secs(90), || async {
        rt.container_log(&ns.name, "getter", "get")
            .contains(&format!("got {SIZE}"))
            .then_some(())
    })
    .await;
    eventually(
        "the pod to succeed (restartPolicy Never, exit 0)",
        Duration::from_secs(30),
        || async {
            let pod = pods.get("getter").await.ok()?;
            (pod.status?.phase.as_deref() == Some("Succeeded")).then_some(())
        },
    )
    .await;
    let after = node_counters(rt, node).await;
    let received = after.0 - before.0;
    eprintln!(
        "{node} received {received} bytes for a {SIZE}-byte GET from S3 at {}",
        s3.endpoint()
    );
    assert!(
        received >= SIZE as u64,
        "{node}'s NIC received {received} bytes, less than the {SIZE}-byte object"
    );
    pods.delete("getter", &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_a_container_that_exits_is_restarted_with_backoff() {
    let rt = runtime();
    let ns = ControlPlane::shared()
        .privileged_namespace("rt-restart")
        .await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-6"},
            "containers": [{"name": "crash", "image": HOST_IMAGE,
                            "command": ["sh", "-c", "echo run; exit 3"]}],
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let runs = |ns: &str| {
        std::fs::read_dir(rt.logs_dir())
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{ns}_crash_crash"))
            })
            .count()
    };
    let started = Instant::now();
    eventually("three runs", Duration::from_secs(30), || async {
        (runs(&ns.name) >= 3).then_some(())
    })
    .await;
    let pod = eventually(
        "pod status to show the restarts",
        Duration::from_secs(30),
        || async {
            let pod = pods.get("crash").await.ok()?;
            let restarts = pod.status.as_ref()?.container_statuses.as_ref()?[0].restart_count;
            (restarts >= 2).then_some(pod)
        },
    )
    .await;
    let status = &pod
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0];
    assert_eq!(
        status
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code),
        Some(3),
        "last state shows the exit code: {status:?}"
    );
    // Backoff 1 s then 2 s between runs.
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "three runs took only {:?}",
        started.elapsed()
    );
    pods.delete("crash", &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f_a_native_sidecar_ends_with_the_regular_containers() {
    let rt = runtime();
    let ns = ControlPlane::shared()
        .privileged_namespace("rt-sidecar")
        .await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    // As the webhook injects the loader: an init container with restartPolicy Always that
    // never exits on its own, beside a job that does (and a pod policy of Never).
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-7"},
            "restartPolicy": "Never",
            "initContainers": [{"name": "side", "image": HOST_IMAGE, "restartPolicy": "Always",
                                "command": ["sh", "-c", "trap 'echo bye; exit 0' TERM; echo up; while :; do sleep 0.1; done"]}],
            "containers": [{"name": "main", "image": HOST_IMAGE,
                            "command": ["sh", "-c", "sleep 1; echo done"]}],
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let pod = eventually(
        "the pod to succeed once its job ends",
        Duration::from_secs(60),
        || async {
            let pod = pods.get("job").await.ok()?;
            (pod.status.as_ref()?.phase.as_deref() == Some("Succeeded")).then_some(pod)
        },
    )
    .await;
    assert!(rt.container_log(&ns.name, "job", "main").contains("done"));
    assert!(
        rt.container_log(&ns.name, "job", "side").contains("bye"),
        "the sidecar was sent SIGTERM"
    );
    let side = &pod
        .status
        .as_ref()
        .unwrap()
        .init_container_statuses
        .as_ref()
        .unwrap()[0];
    assert!(
        side.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some(),
        "the sidecar shows as terminated: {side:?}"
    );
    pods.delete("job", &DeleteParams::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g_the_runtimes_own_binary_is_not_rewritten_into_a_mount() {
    runtime();
    let ns = ControlPlane::shared().privileged_namespace("rt-tmp").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    // The (fake) loader binary lives under /tmp, and the pod mounts an emptyDir at /tmp, as
    // the decoders do: container paths under /tmp go to the volume, the binary's must not.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "loader"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-3"},
            "containers": [{"name": "loader", "image": "registry.invalid/stoker-loader:test",
                            "ports": [{"name": "metrics", "containerPort": 9090}],
                            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            "terminationGracePeriodSeconds": 5,
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let ip = eventually("pod IP", Duration::from_secs(60), || async {
        pods.get("loader").await.ok().as_ref().and_then(pod_ip)
    })
    .await;
    eventually(
        "the loader serving /metrics on its pod IP",
        Duration::from_secs(30),
        || async move {
            let (status, body) = http::get(SocketAddr::new(ip.into(), 9090), "/metrics")
                .await
                .ok()?;
            (status == 200 && body.contains("stoker_fake_loader_up")).then_some(())
        },
    )
    .await;
    pods.delete("loader", &DeleteParams::default())
        .await
        .unwrap();
}
