//! Two operator replicas share one Lease: one runs the controller, the other takes over when the
//! leader shuts down, without restarting the fleet.

mod operator_support;

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use operator_support::*;
use serde_json::json;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::build::BuildDefaults;
use stoker_operator::leader::LeaseConfig;
use stoker_testenv::cluster::{ControlPlane, PodsEverSeen};

async fn replica(client: &Client, ns: &str, identity: &str) -> Operator {
    let mut lease = LeaseConfig::new(ns, "stoker-leader", identity);
    lease.lease_duration = Duration::from_secs(4);
    lease.renew_deadline = Duration::from_secs(3);
    lease.retry_period = Duration::from_millis(500);
    let config = Config {
        watch_namespace: Some(ns.to_string()),
        lease: Some(lease),
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.into(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        },
        webhook: None,
        metrics_listen: None,
        installation: None,
        autoscaler: None,
    };
    Operator::start_with(client.clone(), config).await
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt("stoker-leader")
        .await
        .ok()??
        .spec?
        .holder_identity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_the_other_takes_over() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-leader").await;
    install_crd(&ns.client).await;
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);

    let a = replica(&ns.client, &ns.name, "replica-a").await;
    eventually("a leads", Duration::from_secs(20), || async {
        (holder(&leases).await.as_deref() == Some("replica-a")).then_some(())
    })
    .await;
    let b = replica(&ns.client, &ns.name, "replica-b").await;

    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("shared", 2, 1))
        .await
        .expect("create pipeline");
    let before = wait_ready_decoders(&ns.client, &ns.name, "shared", 2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(a.metrics.encode().contains("stoker_leader 1"));
    assert!(b.metrics.encode().contains("stoker_leader 0"));
    assert!(
        b.metrics.encode().contains("stoker_reconciles_total 0"),
        "the follower must not reconcile:\n{}",
        b.metrics.encode()
    );

    // The leader shuts down and releases the Lease; the follower takes over and reconciles.
    a.stop().await;
    eventually("b leads", Duration::from_secs(20), || async {
        (holder(&leases).await.as_deref() == Some("replica-b")).then_some(())
    })
    .await;
    dps.patch(
        "shared",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"autoscaling": {"replicas": 3}}})),
    )
    .await
    .expect("scale");
    let after = wait_ready_decoders(&ns.client, &ns.name, "shared", 3).await;
    assert!(
        uids(&before).is_subset(&uids(&after)),
        "failover restarted decoders"
    );
    b.stop().await;
}

/// A real operator process of this test's namespace; SIGKILLed when dropped.
struct ReplicaProcess(std::process::Child);

impl ReplicaProcess {
    fn start(cp: &ControlPlane, ns: &str, identity: &str) -> Self {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_stoker-operator"))
            .args(["run", "--namespace", ns, "--watch-namespace", ns])
            .args(["--identity", identity, "--lease-name", "stoker-failover"])
            .args(["--loader-image", LOADER_IMAGE, "--no-webhook"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .env("KUBECONFIG", cp.kubeconfig_path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("stoker-operator starts");
        Self(child)
    }

    /// SIGKILL: no Lease release, no graceful shutdown.
    fn kill9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The leading replica is killed -9 in the middle of a scale-up: the follower takes the Lease
/// once it expires (15 s by default) and the fleet ends exactly as asked, with no decoder
/// created twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_is_replaced_within_the_lease_and_the_fleet_ends_as_asked() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-failover").await;
    install_crd(&ns.client).await;
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    let held_by = |who: &'static str| {
        let leases = leases.clone();
        move || {
            let leases = leases.clone();
            async move {
                let lease = leases.get_opt("stoker-failover").await.ok()??;
                (lease.spec?.holder_identity.as_deref() == Some(who)).then_some(())
            }
        }
    };
    let mut a = ReplicaProcess::start(cp, &ns.name, "replica-a");
    eventually("a leads", Duration::from_secs(30), held_by("replica-a")).await;
    let _b = ReplicaProcess::start(cp, &ns.name, "replica-b");
    let selector = "stoker.dev/pipeline=failover,stoker.dev/role=decoder";
    let ever = PodsEverSeen::watch(&ns.client, &ns.name, selector).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("failover", 2, 1))
        .await
        .expect("create pipeline");
    wait_ready_decoders(&ns.client, &ns.name, "failover", 2).await;
    dps.patch(
        "failover",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"autoscaling": {"replicas": 8}}})),
    )
    .await
    .expect("scale");
    // Mid-reconcile: the leader has seen the change and is creating pods.
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill9();
    let killed = std::time::Instant::now();
    eventually("b leads", Duration::from_secs(40), held_by("replica-b")).await;
    let took = killed.elapsed();
    eprintln!("the follower took the Lease {took:?} after the kill");
    // The Lease's 15 s, plus one 2 s retry of the follower and the API server's latency.
    assert!(
        took < Duration::from_secs(20),
        "took the Lease after {took:?}"
    );
    wait_ready_decoders(&ns.client, &ns.name, "failover", 8).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        ever.count(),
        8,
        "8 decoders ever existed: none lost, none surplus"
    );
    let now = wait_ready_decoders(&ns.client, &ns.name, "failover", 8).await;
    assert_eq!(now.len(), 8);
}
