//! The node runtime runs pods from images with runc as strictly as a kubelet: memory and CPU
//! limits as cgroup limits (OOM kills by the kernel, CFS quota), `runAsNonRoot` refusals,
//! read-only roots, users and capabilities, sized memory-backed emptyDirs, and the projected
//! service-account token. Needs root and runc.
//!
//! The test image is a host-rootfs image (test images only): this machine's `/usr`, `/etc`...
//! read-only in an otherwise empty root, so the containers can run `sh` and `python3`.

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use std::time::Duration;
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::eventually;
use stoker_testenv::runtime::{
    ImageConfig, ImageMapping, ImageSource, NodeRuntime, RuntimeOptions, default_loader_bin,
    stoker_image_source,
};

const IMAGE: &str = "stoker.test/host-rootfs:1";

fn runtime() -> &'static NodeRuntime {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "stoker_testenv=info".into()),
        )
        .with_test_writer()
        .try_init();
    NodeRuntime::shared(|| RuntimeOptions {
        // stoker's loader as the operator's pods run it: from its image (or the stand-in root
        // filesystem when scripts/image.sh has not run), never as a host process.
        loader: Some(stoker_image_source(&default_loader_bin())),
        images: vec![ImageMapping::container(
            IMAGE,
            ImageSource::HostRootfs {
                binds: Vec::new(),
                writable: Vec::new(),
                config: ImageConfig::default(),
            },
        )],
        max_grace: Duration::from_secs(3),
        ..RuntimeOptions::default()
    })
}

/// What the restricted Pod Security Standard asks of a container.
fn restricted(uid: i64) -> Value {
    json!({
        "runAsNonRoot": true, "runAsUser": uid, "runAsGroup": uid,
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    })
}

fn pod(name: &str, restart: &str, container: Value, volumes: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "cpu-1"},
            "restartPolicy": restart,
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": 1,
        }
    }))
    .unwrap()
}

fn status_of(pod: &Pod) -> Value {
    serde_json::to_value(
        pod.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|s| s.first()),
    )
    .unwrap()
}

async fn create(pods: &Api<Pod>, pod: &Pod) {
    pods.create(&PostParams::default(), pod).await.unwrap();
}

/// The container's log once it contains `needle`.
async fn log_with(rt: &NodeRuntime, ns: &str, pod: &str, needle: &str) -> String {
    eventually(
        &format!("{needle:?} in the log of {pod}"),
        Duration::from_secs(60),
        || async {
            let log = rt.container_log(ns, pod, "main");
            log.contains(needle).then_some(log)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_over_its_memory_limit_is_oom_killed_and_restarted() {
    let _rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-oom").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let container = json!({
        "name": "main", "image": IMAGE,
        "command": ["python3", "-c", "b = b'x' * (256 << 20); print(len(b))"],
        "resources": {"limits": {"memory": "64Mi", "cpu": "1"}},
        "securityContext": restricted(1000),
    });
    create(&pods, &pod("hog", "OnFailure", container, json!([]))).await;
    let status = eventually(
        "OOMKilled with a restart in the pod status",
        Duration::from_secs(90),
        || async {
            let s = status_of(&pods.get("hog").await.ok()?);
            (s["lastState"]["terminated"]["reason"] == "OOMKilled"
                && s["restartCount"].as_i64() >= Some(1))
            .then_some(s)
        },
    )
    .await;
    assert_eq!(
        status["lastState"]["terminated"]["exitCode"], 137,
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_limit_is_a_cfs_quota() {
    let rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-cpu").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    // Two spinning shells could use both of this machine's cores; the limit is half of one.
    let container = json!({
        "name": "main", "image": IMAGE,
        "command": ["sh", "-c", "echo spinning; (while :; do :; done) & while :; do :; done"],
        "resources": {"limits": {"cpu": "500m", "memory": "64Mi"}},
        "securityContext": restricted(1000),
    });
    create(&pods, &pod("spin", "Never", container, json!([]))).await;
    log_with(rt, &ns.name, "spin", "spinning").await;
    let uid = pods
        .get("spin")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap_or_default();
    let before = rt
        .container_cpu(&uid, "main")
        .expect("the container's cgroup");
    let wall = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let used = rt
        .container_cpu(&uid, "main")
        .expect("the container's cgroup")
        - before;
    let wall = wall.elapsed();
    let share = used.as_secs_f64() / wall.as_secs_f64();
    eprintln!("CPU used {used:?} in {wall:?} of wall time ({share:.2} CPUs, limit 0.5)");
    assert!(
        (0.4..=0.6).contains(&share),
        "used {used:?} of CPU in {wall:?}: {share:.2} CPUs against a 500m limit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_as_non_root_refuses_an_image_that_runs_as_root() {
    let _rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-nonroot").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    // No runAsUser: the image's user (root) decides, and the kubelet refuses it.
    let mut sc = restricted(0);
    sc.as_object_mut().unwrap().remove("runAsUser");
    sc.as_object_mut().unwrap().remove("runAsGroup");
    let container = json!({
        "name": "main", "image": IMAGE, "command": ["sh", "-c", "echo ran"],
        "securityContext": sc,
    });
    create(&pods, &pod("root", "Never", container, json!([]))).await;
    let waiting = eventually(
        "CreateContainerConfigError in the pod status",
        Duration::from_secs(60),
        || async {
            let s = status_of(&pods.get("root").await.ok()?);
            (s["state"]["waiting"]["reason"] == "CreateContainerConfigError")
                .then(|| s["state"]["waiting"].clone())
        },
    )
    .await;
    let message = waiting["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("container has runAsNonRoot and image will run as root"),
        "{waiting}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_root_refuses_writes_and_the_user_has_no_capabilities() {
    let rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-ro").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut sc = restricted(1000);
    sc["readOnlyRootFilesystem"] = true.into();
    let container = json!({
        "name": "main", "image": IMAGE,
        "command": ["sh", "-c",
            "echo uid=$(id -u) groups=\"$(id -G)\"; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; touch /probe"],
        "securityContext": sc,
    });
    let mut ro = pod("ro", "Never", container, json!([]));
    ro.spec.as_mut().unwrap().security_context =
        Some(serde_json::from_value(json!({"fsGroup": 2000})).unwrap());
    create(&pods, &ro).await;
    let status = eventually("the container to end", Duration::from_secs(60), || async {
        let s = status_of(&pods.get("ro").await.ok()?);
        s["state"]["terminated"].is_object().then_some(s)
    })
    .await;
    let log = rt.container_log(&ns.name, "ro", "main");
    assert_eq!(
        status["state"]["terminated"]["exitCode"], 1,
        "{status}\n{log}"
    );
    assert!(log.contains("Read-only file system"), "{log}");
    assert!(log.contains("uid=1000 groups=1000 2000"), "{log}");
    assert!(log.contains("CapEff:\t0000000000000000"), "{log}");
    assert!(log.contains("NoNewPrivs:\t1"), "{log}");
    // 2: a seccomp filter is installed (RuntimeDefault).
    assert!(log.contains("Seccomp:\t2"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_projected_token_authenticates_as_the_pods_service_account() {
    let rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-token").await;
    let accounts: Api<ServiceAccount> = Api::namespaced(ns.client.clone(), &ns.name);
    accounts
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "reader"}})).unwrap(),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let script = r#"
import json, os, ssl, urllib.request
d = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(d + "/token").read()
ctx = ssl.create_default_context(cafile=d + "/ca.crt")
url = "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (
    os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
req = urllib.request.Request(url, data=body.encode(), method="POST", headers={
    "Authorization": "Bearer " + token, "Content-Type": "application/json"})
user = json.load(urllib.request.urlopen(req, context=ctx))["status"]["userInfo"]["username"]
print("namespace=" + open(d + "/namespace").read())
print("user=" + user, flush=True)
"#;
    let container = json!({
        "name": "main", "image": IMAGE,
        "command": ["python3", "-c", script],
        "securityContext": restricted(1000),
    });
    let mut p = pod("who", "Never", container, json!([]));
    p.spec.as_mut().unwrap().service_account_name = Some("reader".into());
    create(&pods, &p).await;
    let log = log_with(rt, &ns.name, "who", "user=").await;
    assert!(
        log.contains(&format!("user=system:serviceaccount:{}:reader", ns.name)),
        "{log}"
    );
    assert!(log.contains(&format!("namespace={}", ns.name)), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_backed_empty_dir_fills_to_its_size_limit() {
    let rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-shm").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let container = json!({
        "name": "main", "image": IMAGE,
        "command": ["sh", "-c",
            "dd if=/dev/zero of=/cache/fill bs=1M count=64 2>&1; echo size=$(stat -c %s /cache/fill)"],
        "securityContext": restricted(1000),
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
    });
    let volumes = json!([{"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": "8Mi"}}]);
    create(&pods, &pod("fill", "Never", container, volumes)).await;
    let log = log_with(rt, &ns.name, "fill", "size=").await;
    assert!(log.contains("No space left on device"), "{log}");
    assert!(log.contains(&format!("size={}", 8 << 20)), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stokers_loader_runs_from_its_image_as_the_images_non_root_user() {
    let rt = runtime();
    let ns = ControlPlane::shared().namespace("runc-loader").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    // No runAsUser: the image's own user (65532) must satisfy runAsNonRoot.
    let mut sc = restricted(0);
    sc.as_object_mut().unwrap().remove("runAsUser");
    sc.as_object_mut().unwrap().remove("runAsGroup");
    sc["readOnlyRootFilesystem"] = true.into();
    let container = json!({
        "name": "decoder", "image": "ghcr.io/stoker-dev/stoker-loader:test",
        "command": ["/usr/local/bin/stoker-loader"],
        "args": ["decode", "--help"],
        "securityContext": sc,
    });
    create(&pods, &pod("loader", "Never", container, json!([]))).await;
    let status = eventually("the loader to end", Duration::from_secs(60), || async {
        let s = status_of(&pods.get("loader").await.ok()?);
        s["state"]["terminated"].is_object().then_some(s)
    })
    .await;
    let log = rt.container_log(&ns.name, "loader", "decoder");
    assert_eq!(
        status["state"]["terminated"]["exitCode"], 0,
        "{status}\n{log}"
    );
    assert!(log.contains("Usage: stoker-loader decode"), "{log}");
}
