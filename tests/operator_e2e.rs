//! The operator against a real control plane (kube-apiserver, scheduler, controller-manager with
//! its garbage collector, KWOK nodes): the fleet, scaling, replacement, restarts, deletion.

mod operator_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use operator_support::*;
use serde_json::json;
use stoker_operator::api::DataPipeline;
use stoker_testenv::cluster::{ControlPlane, PodsEverSeen};

async fn set_replicas(api: &Api<DataPipeline>, name: &str, n: i32) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"autoscaling": {"replicas": n}}})),
    )
    .await
    .expect("scale pipeline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoders_spread_scale_without_restarts_and_drain() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-scale").await;
    install_crd(&ns.client).await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let ever = PodsEverSeen::watch(
        &ns.client,
        &ns.name,
        "stoker.dev/pipeline=imagenet,stoker.dev/role=decoder",
    )
    .await;
    dps.create(&PostParams::default(), &pipeline("imagenet", 4, 3))
        .await
        .expect("create pipeline");

    let four = wait_ready_decoders(&ns.client, &ns.name, "imagenet", 4).await;
    // The reconciles that follow a create read pods from a cache that may not show them yet:
    // none may create a pod twice.
    assert_eq!(ever.count(), 4, "pods created beyond the four asked for");
    assert!(
        skew_over_cpu_nodes(&four) <= 1,
        "spread: {:?}",
        per_node(&four)
    );
    assert_eq!(
        per_node(&four).len(),
        4,
        "four decoders on four different nodes"
    );

    // Status and `kubectl get dp` columns.
    let status = eventually("status ready", Duration::from_secs(30), || async {
        let dp = dps.get("imagenet").await.ok()?;
        let s = dp.status?;
        let ready = s
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && s.decoders.ready == 4).then_some(s)
    })
    .await;
    assert_eq!((status.decoders.desired, status.decoders.nodes), (4, 4));
    assert_eq!(status.observed_generation, Some(1));
    let out = ns
        .kubectl()
        .args(["get", "dp", "imagenet"])
        .output()
        .expect("kubectl");
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "READY",
            "DECODERS",
            "DESIRED",
            "TRAINERS",
            "DATA-WAIT",
            "SAMPLES/S",
            "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..5], ["imagenet", "True", "4", "4", "0"], "{table}");

    // 4 → 10: the first four keep running (same UIDs), all ten spread with skew ≤ 1.
    set_replicas(&dps, "imagenet", 10).await;
    let ten = wait_ready_decoders(&ns.client, &ns.name, "imagenet", 10).await;
    assert!(
        uids(&four).is_subset(&uids(&ten)),
        "scale-up restarted a decoder"
    );
    assert_eq!(ever.count(), 10, "pods created beyond the ten asked for");
    assert!(
        skew_over_cpu_nodes(&ten) <= 1,
        "spread: {:?}",
        per_node(&ten)
    );

    // 10 → 3: seven decoders leave discovery first (draining label), then are deleted.
    set_replicas(&dps, "imagenet", 3).await;
    let drained = eventually(
        "seven draining decoders",
        Duration::from_secs(30),
        || async {
            let pods = decoders(&ns.client, &ns.name, "imagenet").await;
            let d: Vec<Pod> = pods.into_iter().filter(is_draining).collect();
            (d.len() == 7).then_some(d)
        },
    )
    .await;
    for p in &drained {
        assert!(p.annotations().contains_key("stoker.dev/drain-started"));
    }
    let svc: Api<Service> = Api::namespaced(ns.client.clone(), &ns.name);
    let selector = svc
        .get("imagenet-decoders")
        .await
        .expect("service")
        .spec
        .and_then(|s| s.selector)
        .expect("selector");
    assert_eq!(
        selector.get("stoker.dev/draining").map(String::as_str),
        Some("false")
    );
    let three = eventually("three decoders left", Duration::from_secs(60), || async {
        let pods = decoders(&ns.client, &ns.name, "imagenet").await;
        (pods.len() == 3 && pods.iter().all(|p| is_ready(p) && !is_draining(p))).then_some(pods)
    })
    .await;
    assert!(
        uids(&three).is_subset(&uids(&ten)),
        "scale-down restarted a decoder"
    );
    assert_eq!(ever.count(), 10, "scale-down created pods");
    assert_eq!(
        per_node(&three).len(),
        3,
        "survivors come from the most crowded nodes last"
    );
    let s = dps
        .get("imagenet")
        .await
        .expect("dp")
        .status
        .expect("status");
    let last = s.last_scale.expect("lastScale");
    assert_eq!((last.from, last.to), (10, 3));

    // Deleting the pipeline garbage-collects every child.
    dps.delete("imagenet", &DeleteParams::foreground())
        .await
        .expect("delete");
    let c = ns.client.clone();
    let n = ns.name.clone();
    eventually("children collected", Duration::from_secs(90), || {
        let (c, n) = (c.clone(), n.clone());
        async move {
            let pods = decoders(&c, &n, "imagenet").await.len();
            let svc = Api::<Service>::namespaced(c.clone(), &n)
                .get_opt("imagenet-decoders")
                .await
                .ok()?;
            let np = Api::<NetworkPolicy>::namespaced(c.clone(), &n)
                .get_opt("imagenet-decoders")
                .await
                .ok()?;
            let role = Api::<Role>::namespaced(c.clone(), &n)
                .get_opt("stoker-imagenet-sidecar")
                .await
                .ok()?;
            let rb = Api::<RoleBinding>::namespaced(c.clone(), &n)
                .get_opt("stoker-imagenet-sidecar")
                .await
                .ok()?;
            (pods == 0 && svc.is_none() && np.is_none() && role.is_none() && rb.is_none())
                .then_some(())
        }
    })
    .await;
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_decoder_is_replaced_and_restart_changes_nothing() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-restart").await;
    install_crd(&ns.client).await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("coco", 3, 1))
        .await
        .expect("create pipeline");
    let before = wait_ready_decoders(&ns.client, &ns.name, "coco", 3).await;

    // The pipeline's certificate (mutual TLS with its sidecars): a Secret the DataPipeline
    // owns, so that it goes with it, mounted by every decoder.
    let tls = Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .get("coco-decoders-tls")
        .await
        .expect("the pipeline's TLS Secret");
    let owner = dps.get("coco").await.expect("pipeline").uid();
    assert!(
        tls.owner_references()
            .iter()
            .any(|o| Some(&o.uid) == owner.as_ref() && o.controller == Some(true)),
        "the TLS Secret is owned by the DataPipeline: {:?}",
        tls.owner_references()
    );
    let data = tls.data.clone().unwrap_or_default();
    for key in ["ca.crt", "tls.crt", "tls.key"] {
        assert!(data.contains_key(key), "{key} in the TLS Secret");
    }
    for p in &before {
        let mounts_it = p
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .any(|v| {
                v.secret.as_ref().and_then(|s| s.secret_name.as_deref())
                    == Some("coco-decoders-tls")
            });
        assert!(mounts_it, "{} mounts the TLS Secret", p.name_any());
    }

    // A deleted decoder is replaced; the other two are untouched.
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let victim = before[0].name_any();
    pods.delete(&victim, &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    let after = eventually("replacement decoder", Duration::from_secs(60), || async {
        let now = decoders(&ns.client, &ns.name, "coco").await;
        let fresh = now.iter().all(|p| p.name_any() != victim);
        (fresh && now.len() == 3 && now.iter().all(is_ready)).then_some(now)
    })
    .await;
    let survivors: std::collections::BTreeSet<String> = uids(&before[1..]);
    assert!(
        survivors.is_subset(&uids(&after)),
        "replacement touched healthy decoders"
    );

    // Wait for the status to settle, then restart the operator: nothing may change.
    eventually("status settled", Duration::from_secs(30), || async {
        let s = dps.get("coco").await.ok()?.status?;
        (s.decoders.ready == 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let snapshot = snapshot(&ns.client, &ns.name, "coco").await;
    op.stop().await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        snapshot,
        crate::snapshot(&ns.client, &ns.name, "coco").await,
        "restart changed objects"
    );

    // Children edited or deleted by hand are put back (the reconcile skips only children that
    // are still as it built them).
    let svcs: Api<Service> = Api::namespaced(ns.client.clone(), &ns.name);
    let built = svcs
        .get("coco-decoders")
        .await
        .expect("service")
        .spec
        .and_then(|s| s.selector);
    svcs.patch(
        "coco-decoders",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"selector": {"stoker.dev/draining": "true"}}})),
    )
    .await
    .expect("edit the service by hand");
    let nps: Api<NetworkPolicy> = Api::namespaced(ns.client.clone(), &ns.name);
    nps.delete("coco-decoders", &DeleteParams::default())
        .await
        .expect("delete the network policy");
    eventually("hand edits undone", Duration::from_secs(30), || async {
        let restored = svcs.get("coco-decoders").await.ok()?.spec?.selector == built;
        let recreated = nps.get_opt("coco-decoders").await.ok()??;
        (restored && recreated.metadata.deletion_timestamp.is_none()).then_some(())
    })
    .await;

    // A changed pod spec rolls the fleet one decoder at a time.
    dps.patch(
        "coco",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"decoders": {"resources": {"requests": {"cpu": "200m", "memory": "128Mi"}}}}})),
    )
    .await
    .expect("change decoder resources");
    let old = uids(&after);
    let fewest_ready = std::sync::atomic::AtomicUsize::new(usize::MAX);
    let rolled = eventually(
        "fleet rolled to the new spec",
        Duration::from_secs(120),
        || {
            let pods = decoders(&ns.client, &ns.name, "coco");
            let fewest = &fewest_ready;
            let old = &old;
            async move {
                let pods = pods.await;
                let serving_ready = pods
                    .iter()
                    .filter(|p| !is_draining(p) && is_ready(p))
                    .count();
                fewest.fetch_min(serving_ready, std::sync::atomic::Ordering::Relaxed);
                let serving: Vec<Pod> = pods.into_iter().filter(|p| !is_draining(p)).collect();
                let done = serving.len() == 3
                    && serving.iter().all(is_ready)
                    && uids(&serving).is_disjoint(old);
                done.then_some(serving)
            }
        },
    )
    .await;
    assert!(
        fewest_ready.into_inner() >= 2,
        "rollout took more than one decoder out at a time"
    );
    for p in &rolled {
        let cpu = p
            .spec
            .as_ref()
            .and_then(|s| s.containers[0].resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .map(|r| r["cpu"].0.clone());
        assert_eq!(cpu.as_deref(), Some("200m"));
    }
    op.stop().await;
}

/// UIDs and resourceVersions of everything the operator writes for a pipeline.
async fn snapshot(client: &kube::Client, ns: &str, name: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let rv = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        (
            format!(
                "{}:{}",
                m.name.clone().unwrap_or_default(),
                m.uid.clone().unwrap_or_default()
            ),
            m.resource_version.clone().unwrap_or_default(),
        )
    };
    let mut pods = decoders(client, ns, name).await;
    pods.sort_by_key(|p| p.name_any());
    out.extend(pods.iter().map(|p| rv(&p.metadata)));
    let dp = Api::<DataPipeline>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .expect("dp");
    out.push(rv(&dp.metadata));
    let svc = Api::<Service>::namespaced(client.clone(), ns)
        .get(&format!("{name}-decoders"))
        .await
        .expect("svc");
    out.push(rv(&svc.metadata));
    let np = Api::<NetworkPolicy>::namespaced(client.clone(), ns)
        .get(&format!("{name}-decoders"))
        .await
        .expect("np");
    out.push(rv(&np.metadata));
    let role = Api::<Role>::namespaced(client.clone(), ns)
        .get(&format!("stoker-{name}-sidecar"))
        .await
        .expect("role");
    out.push(rv(&role.metadata));
    let rb = Api::<RoleBinding>::namespaced(client.clone(), ns)
        .get(&format!("stoker-{name}-sidecar"))
        .await
        .expect("rb");
    out.push(rv(&rb.metadata));
    // A restart reissues no certificate.
    let tls = Api::<Secret>::namespaced(client.clone(), ns)
        .get(&format!("{name}-decoders-tls"))
        .await
        .expect("tls secret");
    out.push(rv(&tls.metadata));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoders_spread_over_zones_when_asked() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-zones").await;
    install_crd(&ns.client).await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let mut dp = pipeline("zoned", 6, 1);
    dp.spec.decoders.spread.zones = true;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &dp)
        .await
        .expect("create pipeline");
    let pods = wait_ready_decoders(&ns.client, &ns.name, "zoned", 6).await;
    // cpu-0, 2, 4, 6 are in zone-a; cpu-1, 3, 5, 7 in zone-b.
    let mut zones = std::collections::BTreeMap::<&str, usize>::new();
    for (node, n) in per_node(&pods) {
        let index: usize = node.trim_start_matches("cpu-").parse().expect("cpu node");
        *zones
            .entry(if index.is_multiple_of(2) {
                "zone-a"
            } else {
                "zone-b"
            })
            .or_default() += n;
    }
    assert_eq!(
        zones.values().copied().collect::<Vec<_>>(),
        [3, 3],
        "{zones:?}"
    );
    assert!(skew_over_cpu_nodes(&pods) <= 1);
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decoder_is_replaced_and_reported() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-failed").await;
    install_crd(&ns.client).await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("flaky", 2, 1))
        .await
        .expect("create pipeline");
    let before = wait_ready_decoders(&ns.client, &ns.name, "flaky", 2).await;
    let victim = before[0].name_any();
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    pods.patch_status(
        &victim,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Failed", "reason": "Evicted"}})),
    )
    .await
    .expect("mark the decoder failed");
    let after = eventually(
        "failed decoder replaced",
        Duration::from_secs(60),
        || async {
            let now = decoders(&ns.client, &ns.name, "flaky").await;
            let gone = now.iter().all(|p| p.name_any() != victim);
            (gone && now.len() == 2 && now.iter().all(is_ready)).then_some(now)
        },
    )
    .await;
    assert!(uids(&before[1..]).is_subset(&uids(&after)));
    op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_whose_decoders_cannot_be_created_is_degraded_with_an_event() {
    use k8s_openapi::api::core::v1::ResourceQuota;
    use k8s_openapi::api::events::v1::Event;
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-quota").await;
    install_crd(&ns.client).await;
    // The CRD admits the pipeline; the namespace's quota forbids every pod it needs.
    let quotas: Api<ResourceQuota> = Api::namespaced(ns.client.clone(), &ns.name);
    quotas
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "no-pods"},
                "spec": {"hard": {"pods": "0"}}
            }))
            .expect("quota"),
        )
        .await
        .expect("create quota");
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("blocked", 2, 1))
        .await
        .expect("create pipeline");
    let degraded = eventually("Degraded=True", Duration::from_secs(60), || async {
        let dp = dps.get("blocked").await.ok()?;
        dp.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Degraded" && c.status == "True")
    })
    .await;
    assert_eq!(degraded.reason, "Forbidden", "{degraded:?}");
    assert!(
        degraded.message.contains("create Pod") && degraded.message.contains("quota"),
        "the API server's reason: {}",
        degraded.message
    );
    let events: Api<Event> = Api::namespaced(ns.client.clone(), &ns.name);
    let event = eventually("a Warning Event", Duration::from_secs(30), || async {
        events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("blocked")
                    && e.reason.as_deref() == Some("Forbidden")
            })
    })
    .await;
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    assert!(
        event.note.as_deref().unwrap_or("").contains("quota"),
        "{event:?}"
    );
    // Retries back off: in 20 s a pipeline failing every 5 s, 10 s, 20 s... makes one Event
    // series whose count grows slowly, never an Event per retry.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let forbidden: Vec<Event> = events
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Forbidden"))
        .collect();
    assert_eq!(forbidden.len(), 1, "one deduplicated Event: {forbidden:?}");
    let count = forbidden[0].series.as_ref().map_or(1, |s| s.count);
    assert!(
        count <= 4,
        "backoff, not a retry every 5 s: {count} failures in ~25 s"
    );
    // Lifting the quota heals the pipeline.
    quotas
        .delete("no-pods", &DeleteParams::default())
        .await
        .expect("delete quota");
    wait_ready_decoders(&ns.client, &ns.name, "blocked", 2).await;
    eventually("Degraded=False", Duration::from_secs(330), || async {
        let dp = dps.get("blocked").await.ok()?;
        dp.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Degraded" && c.status == "False")
    })
    .await;
    op.stop().await;
}

/// A sidecar whose S3 refuses the samples records a `SourceUnavailable` Event on the pipeline
/// (the loader's e2e test makes the real one); the operator shows it as the pipeline's
/// `SourceUnavailable` condition, with the sidecar's words, without waiting for a resync.
#[tokio::test]
async fn a_sidecars_source_report_becomes_the_pipelines_condition() {
    use k8s_openapi::api::events::v1::Event;
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-source").await;
    install_crd(&ns.client).await;
    let _op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let dp = dps
        .create(&PostParams::default(), &pipeline("refused", 1, 1))
        .await
        .expect("create pipeline");
    let condition = |want: &'static str| {
        let dps = dps.clone();
        move || {
            let dps = dps.clone();
            async move {
                dps.get("refused")
                    .await
                    .ok()?
                    .status?
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == "SourceUnavailable" && c.status == want)
            }
        }
    };
    eventually(
        "SourceUnavailable=False",
        Duration::from_secs(60),
        condition("False"),
    )
    .await;
    let note = "s3://data/a.jpg: access refused or no such bucket";
    let events: Api<Event> = Api::namespaced(ns.client.clone(), &ns.name);
    let event: Event = serde_json::from_value(json!({
        "metadata": {"name": "refused.sidecar"},
        "eventTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
            k8s_openapi::jiff::Timestamp::now()),
        "reportingController": "stoker-loader",
        "reportingInstance": "trainer-0",
        "action": "GetObject",
        "reason": "SourceUnavailable",
        "type": "Warning",
        "note": note,
        "regarding": {
            "apiVersion": "stoker.dev/v1alpha1",
            "kind": "DataPipeline",
            "name": "refused",
            "namespace": ns.name,
            "uid": dp.metadata.uid,
        }
    }))
    .expect("event");
    events
        .create(&PostParams::default(), &event)
        .await
        .expect("the sidecar's event");
    let shown = eventually(
        "SourceUnavailable=True",
        Duration::from_secs(30),
        condition("True"),
    )
    .await;
    assert_eq!(shown.message, note);
}

/// A `webDataset` pipeline gets the Job that builds its index: owned by the pipeline, admitted
/// under the restricted standard, running `stoker-loader index` over the pipeline's shards into
/// its index location with the pipeline's S3 settings; the Job controller runs it (KWOK
/// completes its pod) and the pipeline reports `IndexReady`. A resync or a restarted operator
/// runs no second Job; the reindex annotation does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_dataset_pipeline_builds_its_index_with_one_job() {
    use k8s_openapi::api::batch::v1::Job;
    use stoker_contract::{IndexArgs, LoaderCommand};
    use stoker_operator::build::index_job::{ANNOTATION_REINDEX, LABEL_INDEX_OF};

    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-index").await;
    install_crd(&ns.client).await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    let jobs: Api<Job> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut dp = pipeline("shards", 1, 1);
    dp.spec.source.s3.prefix = Some("wds/".into());
    dp.spec.source.web_dataset = serde_json::from_value(json!({
        "shards": "s3://train-data/wds/{00000..00003}.tar",
        "index": "s3://train-index/shards/",
    }))
    .expect("webDataset");
    dps.create(&PostParams::default(), &dp)
        .await
        .expect("create pipeline");

    let index_jobs = || async {
        jobs.list(&Default::default())
            .await
            .expect("list jobs")
            .items
    };
    let job = eventually("the index Job", Duration::from_secs(30), || async {
        index_jobs().await.into_iter().next()
    })
    .await;
    let owner = &job.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("DataPipeline", Some(true))
    );
    let template = job.spec.as_ref().expect("spec").template.clone();
    let pod = template.spec.expect("pod spec");
    let args = pod.containers[0].args.clone().expect("args");
    let parsed = IndexArgs::parse_flags(&args[1..]).expect("the loader parses the Job's args");
    assert_eq!(args[0], "index");
    assert_eq!(
        parsed.shards.as_deref(),
        Some("s3://train-data/wds/{00000..00003}.tar")
    );
    assert_eq!(parsed.out, "s3://train-index/shards/");
    assert_eq!(parsed.s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!(
        parsed.summary_file.as_deref(),
        Some(std::path::Path::new("/dev/termination-log"))
    );
    let labels = template
        .metadata
        .expect("pod metadata")
        .labels
        .expect("labels");
    assert_eq!(
        labels.get(LABEL_INDEX_OF).map(String::as_str),
        Some("shards")
    );
    assert!(
        !labels.contains_key("stoker.dev/pipeline"),
        "the webhook must not inject a sidecar into the index pod"
    );
    assert_eq!(pod.automount_service_account_token, Some(false));

    // Restricted admission let the Job's pod in; it ran; the pipeline says so.
    let index_ready = || async {
        let status = dps.get("shards").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "IndexReady" && c.status == "True");
        status.index.filter(|i| ready && i.phase == "Ready")
    };
    let index = eventually("IndexReady=True", Duration::from_secs(60), index_ready).await;
    assert_eq!(index.job, job.name_any());
    assert_eq!(index.location, "s3://train-index/shards/");

    // A restarted operator finds the finished Job and runs no other.
    op.stop().await;
    let op = Operator::start(ns.client.clone(), &ns.name, None).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(index_jobs().await.len(), 1, "one Job per index");

    // Asking for a rebuild makes a second Job, and the status follows it.
    dps.patch(
        "shards",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {ANNOTATION_REINDEX: "1"}}})),
    )
    .await
    .expect("annotate");
    let rebuilt = eventually("a second index Job", Duration::from_secs(30), || async {
        let all = index_jobs().await;
        all.into_iter().find(|j| j.name_any() != job.name_any())
    })
    .await;
    eventually(
        "status.index follows the new Job",
        Duration::from_secs(60),
        || async { index_ready().await.filter(|i| i.job == rebuilt.name_any()) },
    )
    .await;
    // The replaced Job left the desired state: it is pruned, the new one stays.
    let names = || async {
        let jobs = index_jobs().await;
        let live = jobs
            .iter()
            .filter(|j| j.metadata.deletion_timestamp.is_none());
        live.map(|j| j.name_any()).collect::<Vec<_>>()
    };
    eventually(
        "the replaced index Job pruned",
        Duration::from_secs(30),
        || async { (names().await == [rebuilt.name_any()]).then_some(()) },
    )
    .await;

    // A source without an index and decoders under the team's own ServiceAccount: the index
    // Job and the operator's decoder ServiceAccount leave the desired state and are pruned;
    // the sidecar's ServiceAccount and the team's stay.
    let accounts: Api<ServiceAccount> = Api::namespaced(ns.client.clone(), &ns.name);
    let own = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("own-decoders".into()),
            ..ObjectMeta::default()
        },
        ..ServiceAccount::default()
    };
    accounts
        .create(&PostParams::default(), &own)
        .await
        .expect("the team's ServiceAccount");
    let operators = stoker_operator::build::sidecar_rbac::decoder_service_account(&dp);
    assert!(accounts.get_opt(&operators).await.expect("get").is_some());
    dps.patch(
        "shards",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {
            "source": {"webDataset": null},
            "decoders": {"serviceAccountName": "own-decoders"},
        }})),
    )
    .await
    .expect("drop the index, name an own ServiceAccount");
    eventually("no index Job", Duration::from_secs(30), || async {
        names().await.is_empty().then_some(())
    })
    .await;
    eventually(
        "the decoder ServiceAccount pruned",
        Duration::from_secs(30),
        || async {
            let gone = accounts.get_opt(&operators).await.expect("get").is_none();
            gone.then_some(())
        },
    )
    .await;
    let left: Vec<String> = accounts
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .iter()
        .map(|a| a.name_any())
        .collect();
    assert!(left.contains(&"own-decoders".to_string()), "{left:?}");
    let sidecar = stoker_operator::build::sidecar_rbac::sidecar_service_account_name("shards");
    assert!(left.contains(&sidecar), "the sidecar's stays: {left:?}");
    op.stop().await;
}
