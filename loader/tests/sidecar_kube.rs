//! Decoder discovery from a real Kubernetes API server (the test control plane, with KWOK
//! running the pods): Ready decode pods the pipeline owns are found with port 50051; pods
//! labelled `stoker.dev/draining=true`, outside the selector, or copying a decoder's labels
//! without being owned by the pipeline are not.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use stoker_loader::sidecar::discovery::{KubeWorkers, WorkerDiscovery};
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_pod_security,
};

/// A pod; `owner` (a ConfigMap's name and uid) standing in for the DataPipeline that controls
/// it (the garbage collector deletes pods whose owner does not exist).
fn pod(name: &str, labels: serde_json::Value, owner: Option<(&str, &str)>) -> Pod {
    let owners: Vec<serde_json::Value> = owner
        .map(|(owner, uid)| {
            serde_json::json!({ "apiVersion": "v1", "kind": "ConfigMap", "name": owner,
                                "uid": uid, "controller": true })
        })
        .into_iter()
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": { "name": name, "labels": labels, "ownerReferences": owners },
        "spec": {
            "securityContext": restricted_pod_security(65532),
            "containers": [{ "name": "decode", "image": "stoker-loader:test",
                             "securityContext": restricted_container_security() }]
        }
    }))
    .unwrap()
}

async fn wait_for(discovery: &KubeWorkers, want: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let found = discovery.discover().await.expect("discover");
        if found.len() == want {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "expected {want} decoders, found {found:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovers_ready_decoder_pods_and_skips_draining_ones() {
    let ns = ControlPlane::shared().namespace("sidecar-discovery").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let owner: ConfigMap = Api::namespaced(ns.client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({ "metadata": { "name": "pipeline-p" } }))
                .unwrap(),
        )
        .await
        .unwrap();
    let uid = owner.metadata.uid.clone().expect("uid");
    let owned = Some(("pipeline-p", uid.as_str()));
    let decoder = serde_json::json!({ "stoker.dev/pipeline": "p", "stoker.dev/role": "decoder" });
    for name in ["decoder-a", "decoder-b"] {
        pods.create(&PostParams::default(), &pod(name, decoder.clone(), owned))
            .await
            .unwrap();
    }
    // Anyone who may create pods can copy the labels; only the pipeline owns its decoders.
    pods.create(
        &PostParams::default(),
        &pod("impostor", decoder.clone(), None),
    )
    .await
    .unwrap();
    let draining = serde_json::json!({
        "stoker.dev/pipeline": "p", "stoker.dev/role": "decoder", "stoker.dev/draining": "true"
    });
    pods.create(
        &PostParams::default(),
        &pod("decoder-draining", draining, owned),
    )
    .await
    .unwrap();
    let other = serde_json::json!({ "stoker.dev/pipeline": "other", "stoker.dev/role": "decoder" });
    pods.create(&PostParams::default(), &pod("other-pipeline", other, owned))
        .await
        .unwrap();

    let discovery = KubeWorkers {
        client: ns.client.clone(),
        namespace: ns.name.clone(),
        selector: "stoker.dev/pipeline=p,stoker.dev/role=decoder".into(),
        owner_uid: Some(uid.clone()),
        port: 50051,
    };
    // The impostor is Ready too (the label-only view sees three): still not a decoder.
    let by_label = KubeWorkers {
        client: ns.client.clone(),
        namespace: ns.name.clone(),
        selector: discovery.selector.clone(),
        owner_uid: None,
        port: 50051,
    };
    wait_for(&by_label, 3).await;
    let found = wait_for(&discovery, 2).await;
    let mut expected = Vec::new();
    for name in ["decoder-a", "decoder-b"] {
        let p = pods.get(name).await.unwrap();
        let ip = p.status.and_then(|s| s.pod_ip).expect("pod IP");
        expected.push(format!("http://{ip}:50051"));
    }
    expected.sort();
    assert_eq!(found, expected);

    // The operator marks a pod for removal: the sidecar stops sending to it.
    let patch = serde_json::json!({ "metadata": { "labels": { "stoker.dev/draining": "true" } } });
    pods.patch("decoder-a", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let found = wait_for(&discovery, 1).await;
    let b_ip = pods
        .get("decoder-b")
        .await
        .unwrap()
        .status
        .and_then(|s| s.pod_ip)
        .unwrap();
    assert_eq!(found, vec![format!("http://{b_ip}:50051")]);
}
