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
use stoker_testenv::cluster::ControlPlane;

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
        },
        webhook: None,
        metrics_listen: None,
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
