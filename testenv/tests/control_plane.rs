//! The test control plane is real: the scheduler binds, the controller-manager reconciles,
//! the garbage collector collects, KWOK runs pod lifecycles, CRD schemas are enforced.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_pod_security,
};
use stoker_testenv::nodes::POOL_LABEL;

use stoker_testenv::eventually;

fn pod_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod(name: &str, labels: serde_json::Value, extra_spec: serde_json::Value) -> Pod {
    let mut spec = json!({
        "securityContext": restricted_pod_security(65532),
        "containers": [{"name": "main", "image": "registry.invalid/stoker/none:1",
                        "securityContext": restricted_container_security()}],
        "nodeSelector": {POOL_LABEL: "cpu"},
    });
    spec.as_object_mut()
        .unwrap()
        .extend(extra_spec.as_object().unwrap().clone());
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }))
    .unwrap()
}

#[tokio::test]
async fn simulated_nodes_are_registered_and_ready() {
    let cp = ControlPlane::shared();
    let nodes: Api<Node> = Api::all(cp.client().await.unwrap());
    let list = nodes.list(&ListParams::default()).await.unwrap().items;
    let by_pool = |pool: &str| {
        list.iter()
            .filter(|n| {
                n.metadata
                    .labels
                    .as_ref()
                    .unwrap()
                    .get(POOL_LABEL)
                    .map(String::as_str)
                    == Some(pool)
            })
            .count()
    };
    assert_eq!(by_pool("gpu"), 4, "GPU nodes");
    assert_eq!(by_pool("cpu"), 8, "CPU nodes");
    for node in &list {
        let labels = node.metadata.labels.as_ref().unwrap();
        for key in [
            "kubernetes.io/hostname",
            "topology.kubernetes.io/zone",
            "node.kubernetes.io/instance-type",
        ] {
            assert!(
                labels.contains_key(key),
                "{:?} lacks {key}",
                node.metadata.name
            );
        }
        let ready = node.status.as_ref().unwrap().conditions.as_ref().unwrap();
        assert!(
            ready
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        );
    }
    let gpu = list
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some("gpu-0"))
        .unwrap();
    let allocatable = gpu.status.as_ref().unwrap().allocatable.as_ref().unwrap();
    assert_eq!(allocatable["nvidia.com/gpu"].0, "8");
    let zones: std::collections::BTreeSet<_> = list
        .iter()
        .map(|n| n.metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"].clone())
        .collect();
    assert_eq!(zones.len(), 2);

    // A person's view: kubectl lists the same nodes.
    let out = cp
        .kubectl()
        .args(["get", "nodes", "-o", "name"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 12);
}

/// Test namespaces enforce the restricted Pod Security Standard, as a hardened cluster's do: a pod
/// that may run as root (no securityContext) is refused with the rules it breaks.
#[tokio::test]
async fn test_namespaces_refuse_a_pod_that_breaks_the_restricted_standard() {
    let ns = ControlPlane::shared().namespace("restricted").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let loose: Pod = serde_json::from_value(json!({
        "metadata": {"name": "loose"},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/stoker/none:1"}]},
    }))
    .unwrap();
    let message = match pods.create(&PostParams::default(), &loose).await {
        Err(kube::Error::Api(s)) if s.code == 403 => s.message,
        other => panic!("expected Pod Security to refuse the pod, got {other:?}"),
    };
    for rule in [
        "violates PodSecurity \"restricted:latest\"",
        "allowPrivilegeEscalation != false",
        "unrestricted capabilities",
        "runAsNonRoot != true",
        "seccompProfile",
    ] {
        assert!(message.contains(rule), "{rule:?} not in: {message}");
    }
    pods.create(&PostParams::default(), &pod("strict", json!({}), json!({})))
        .await
        .expect("a restricted pod is admitted");
}

#[tokio::test]
async fn scheduler_binds_a_pod_and_kwok_runs_it() {
    let ns = ControlPlane::shared().namespace("bind").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    pods.create(
        &PostParams::default(),
        &pod("one", json!({"app": "one"}), json!({})),
    )
    .await
    .unwrap();
    let running = eventually("pod Running and Ready", Duration::from_secs(60), || async {
        pods.get("one").await.ok().filter(pod_ready)
    })
    .await;
    let node = running
        .spec
        .unwrap()
        .node_name
        .expect("bound by the scheduler");
    assert!(
        node.starts_with("cpu-"),
        "nodeSelector honoured, got {node}"
    );
    assert!(
        running.status.unwrap().pod_ip.is_some(),
        "KWOK assigns a pod IP"
    );
}

#[tokio::test]
async fn deployment_pods_come_from_the_controller_manager() {
    let ns = ControlPlane::shared().namespace("deploy").await;
    let deployments: Api<Deployment> = Api::namespaced(ns.client.clone(), &ns.name);
    let deployment: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"securityContext": restricted_pod_security(65532),
                         "containers": [{"name": "main", "image": "registry.invalid/web:1",
                                         "securityContext": restricted_container_security()}],
                         "nodeSelector": {POOL_LABEL: "cpu"}},
            },
        },
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let ready = eventually("3 ready pods", Duration::from_secs(90), || async {
        let list = pods
            .list(&ListParams::default().labels("app=web"))
            .await
            .ok()?;
        (list.items.iter().filter(|p| pod_ready(p)).count() == 3).then_some(list.items)
    })
    .await;
    for p in &ready {
        let owner = &p.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            owner.kind, "ReplicaSet",
            "created by the ReplicaSet controller"
        );
    }
    eventually(
        "deployment status ready 3",
        Duration::from_secs(60),
        || async {
            let d = deployments.get("web").await.ok()?;
            (d.status?.ready_replicas? == 3).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn topology_spread_places_twelve_pods_over_eight_cpu_nodes_with_skew_one() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("spread").await;
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let spread = json!({"topologySpreadConstraints": [{
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "spread"}},
    }]});
    for i in 0..12 {
        pods.create(
            &PostParams::default(),
            &pod(&format!("p{i}"), json!({"app": "spread"}), spread.clone()),
        )
        .await
        .unwrap();
    }
    let placed = eventually("12 pods bound", Duration::from_secs(90), || async {
        let list = pods.list(&ListParams::default()).await.ok()?;
        let nodes: Vec<String> = list
            .items
            .iter()
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect();
        (nodes.len() == 12).then_some(nodes)
    })
    .await;
    let mut per_node: BTreeMap<String, usize> = cp
        .nodes()
        .iter()
        .filter(|n| n.gpus == 0)
        .map(|n| (n.name.clone(), 0))
        .collect();
    for node in placed {
        *per_node
            .get_mut(&node)
            .unwrap_or_else(|| panic!("pod placed on non-CPU node {node}")) += 1;
    }
    let max = per_node.values().max().unwrap();
    let min = per_node.values().min().unwrap();
    assert!(max - min <= 1, "skew {} > 1: {per_node:?}", max - min);
}

#[tokio::test]
async fn deleting_an_owner_garbage_collects_what_it_owns() {
    let ns = ControlPlane::shared().namespace("gc").await;
    let maps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    let owner = maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap(),
        )
        .await
        .unwrap();
    let owned: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "owned", "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid.unwrap(),
    }]}}))
    .unwrap();
    maps.create(&PostParams::default(), &owned).await.unwrap();
    maps.delete("owner", &DeleteParams::background())
        .await
        .unwrap();
    eventually(
        "owned ConfigMap collected",
        Duration::from_secs(60),
        || async { matches!(maps.get_opt("owned").await, Ok(None)).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn a_crd_is_served_and_its_schema_enforced() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("crd").await;
    let group = format!("{}.harness.stoker.dev", ns.name);
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("widgets.{group}")},
        "spec": {
            "group": group, "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {"type": "object", "required": ["size"], "properties": {
                    "size": {"type": "integer", "minimum": 1, "maximum": 10},
                }}},
            }}}],
        },
    }))
    .unwrap();
    let crds: Api<CustomResourceDefinition> = Api::all(ns.client.clone());
    crds.create(&PostParams::default(), &crd).await.unwrap();
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&group, "v1", "Widget"),
        "widgets",
    );
    let widgets: Api<DynamicObject> = Api::namespaced_with(ns.client.clone(), &ns.name, &resource);
    let widget = |name: &str, size: i64| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": format!("{group}/v1"), "kind": "Widget",
            "metadata": {"name": name}, "spec": {"size": size},
        }))
        .unwrap()
    };
    // The new resource is served once the CRD is Established.
    eventually("CRD served", Duration::from_secs(30), || async {
        widgets
            .create(&PostParams::default(), &widget("ok", 3))
            .await
            .ok()
    })
    .await;
    let err = widgets
        .create(&PostParams::default(), &widget("big", 42))
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("expected an API error, got {err}")
    };
    assert_eq!(status.code, 422);
    assert!(
        status.message.contains("spec.size"),
        "message names the field: {}",
        status.message
    );
    assert!(
        status.message.contains("less than or equal to 10"),
        "{}",
        status.message
    );
    crds.delete(&format!("widgets.{group}"), &DeleteParams::default())
        .await
        .unwrap();
}
