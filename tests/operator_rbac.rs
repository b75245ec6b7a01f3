//! Least privilege, under exactly the chart's RBAC: with `watchNamespace` set, the operator runs
//! with its ServiceAccount's token and the objects `helm template` renders, reconciles a pipeline
//! in the watched namespace (the autoscaler included: nodes listed, Prometheus read), and may
//! do nothing outside it; the sidecar's identity reads pods of its own namespace and nothing
//! more. Without the chart's `nodes` rule the autoscaler degrades instead of aborting the
//! reconcile.

mod operator_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use operator_support::prometheus_stub::PrometheusStub;
use operator_support::*;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::api::v1alpha1::AutoscalingMode;
use stoker_operator::autoscale::AutoscalingPolicy;
use stoker_operator::build::BuildDefaults;
use stoker_operator::leader::LeaseConfig;
use stoker_operator::signal_source::AutoscalerSettings;
use stoker_testenv::cluster::ControlPlane;

/// Whether `result` is the API server's 403.
fn forbidden<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> bool {
    matches!(result, Err(kube::Error::Api(s)) if s.code == 403)
}

fn condition(dp: &DataPipeline, type_: &str) -> Option<(String, String)> {
    dp.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

fn trainer_pod(name: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "runAsUser": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "image": "registry.invalid/x",
                "securityContext": {"allowPrivilegeEscalation": false,
                                    "capabilities": {"drop": ["ALL"]}}}],
        }
    }))
    .expect("pod")
}

/// A client of the test API server that authenticates with `token` only.
async fn client_with_token(cp: &ControlPlane, token: &str) -> kube::Client {
    client_as_who(cp, |auth| {
        *auth = kube::config::AuthInfo {
            token: Some(token.to_string().into()),
            ..kube::config::AuthInfo::default()
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_runs_under_the_charts_namespaced_rbac_and_nothing_more() {
    let cp = ControlPlane::shared();
    let release = cp.namespace("rbac-release").await;
    let app = cp.namespace("rbac-app").await;
    let other = cp.namespace("rbac-other").await;
    install_crd(&release.client).await;

    // The chart's RBAC with watchNamespace, applied as rendered.
    let mut template = cp.helm();
    template.args([
        "template",
        "stoker",
        chart().as_str(),
        "--namespace",
        &release.name,
        "--set",
        &format!("watchNamespace={}", app.name),
        "--show-only",
        "templates/rbac.yaml",
        "--show-only",
        "templates/serviceaccount.yaml",
    ]);
    let rbac = run(template, None);
    assert!(rbac.contains(&format!("namespace: {}", app.name)));
    let mut apply = cp.kubectl();
    apply.args(["apply", "--server-side", "--force-conflicts", "-f", "-"]);
    run(apply, Some(&rbac));

    // As the chart's Deployment sets it: the installation's CA lives in the release namespace,
    // where the chart's Role grants it. (The only test of this binary reads the variable.)
    // SAFETY: set before the operator starts; nothing else reads the environment meanwhile.
    unsafe { std::env::set_var("POD_NAMESPACE", &release.name) };
    let prometheus = PrometheusStub::start(Duration::ZERO).await;
    let operator_client = cp
        .client_for_service_account(&release.name, "stoker")
        .await
        .expect("service account client");
    let config = Config {
        watch_namespace: Some(app.name.clone()),
        lease: Some(LeaseConfig::new(
            &release.name,
            "stoker-leader",
            "stoker-rbac-0",
        )),
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.into(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        },
        webhook: None,
        metrics_listen: None,
        installation: None,
        autoscaler: Some(AutoscalerSettings {
            prometheus_url: Some(prometheus.url()),
            period: Duration::from_secs(1),
            defaults: AutoscalingPolicy {
                window: Duration::from_secs(5),
                ..AutoscalingPolicy::default()
            },
            ..AutoscalerSettings::default()
        }),
    };
    let op = Operator::start_with(operator_client.clone(), config).await;

    // A pipeline in the watched namespace: decoders, status, and an autoscaler decision (the
    // node list and Prometheus both read).
    let dps: Api<DataPipeline> = Api::namespaced(app.client.clone(), &app.name);
    let mut dp = pipeline("rbac", 1, 1);
    dp.spec.autoscaling.mode = AutoscalingMode::Auto;
    dp.spec.autoscaling.replicas = None;
    dp.spec.decoders.min_replicas = 2;
    dps.create(&PostParams::default(), &dp)
        .await
        .expect("create pipeline");
    wait_ready_decoders(&app.client, &app.name, "rbac", 2).await;
    eventually(
        "Ready, and signals read",
        Duration::from_secs(30),
        || async {
            let dp = dps.get("rbac").await.ok()?;
            let ready = condition(&dp, "Ready")?.0 == "True";
            let read = condition(&dp, "MetricsUnavailable")?.0 == "False";
            let degraded = condition(&dp, "Degraded")?.0 == "False";
            (ready && read && degraded).then_some(())
        },
    )
    .await;
    let metrics = op.metrics.encode();
    assert!(
        !metrics.contains("category=\"forbidden\""),
        "RBAC denied the operator something:\n{metrics}"
    );

    // Outside the watched namespace the operator's identity can do nothing to pods, and
    // nowhere can it read Secrets beyond its own webhook certificate.
    let pods_other: Api<Pod> = Api::namespaced(operator_client.clone(), &other.name);
    assert!(
        forbidden(
            pods_other
                .create(&PostParams::default(), &trainer_pod("intruder"))
                .await
        ),
        "creating a pod in another namespace is forbidden"
    );
    assert!(forbidden(pods_other.list(&ListParams::default()).await));
    assert!(forbidden(
        Api::<Pod>::all(operator_client.clone())
            .list(&ListParams::default())
            .await
    ));
    assert!(forbidden(
        Api::<Secret>::namespaced(operator_client.clone(), &app.name)
            .list(&ListParams::default())
            .await
    ));
    assert!(forbidden(
        Api::<DataPipeline>::namespaced(operator_client.clone(), &other.name)
            .list(&ListParams::default())
            .await
    ));

    // The sidecar's identity: its own ServiceAccount per pipeline, whose token Secret the
    // operator created and kube-controller-manager filled; the webhook mounts it into the
    // sidecar only. It reads pods of its namespace, nothing else; the trainers' ServiceAccount
    // gets nothing.
    let secrets: Api<Secret> = Api::namespaced(app.client.clone(), &app.name);
    let token = eventually(
        "the sidecar's token Secret filled",
        Duration::from_secs(30),
        || async {
            let secret = secrets.get("stoker-rbac-sidecar-token").await.ok()?;
            let token = secret.data?.get("token")?.0.clone();
            String::from_utf8(token).ok()
        },
    )
    .await;
    let sidecar = client_with_token(cp, &token).await;
    eventually(
        "the sidecar's Role in effect",
        Duration::from_secs(20),
        || async {
            Api::<Pod>::namespaced(sidecar.clone(), &app.name)
                .list(&ListParams::default())
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
    let trainer = cp
        .client_for_service_account(&app.name, "default")
        .await
        .expect("trainer client");
    assert!(
        forbidden(
            Api::<Pod>::namespaced(trainer, &app.name)
                .list(&ListParams::default())
                .await
        ),
        "the trainers' own ServiceAccount is granted nothing"
    );
    assert!(forbidden(
        Api::<Secret>::namespaced(sidecar.clone(), &app.name)
            .list(&ListParams::default())
            .await
    ));
    assert!(forbidden(
        Api::<Pod>::namespaced(sidecar.clone(), &other.name)
            .list(&ListParams::default())
            .await
    ));
    let decoder = decoders(&app.client, &app.name, "rbac").await[0]
        .metadata
        .name
        .clone()
        .expect("name");
    assert!(
        forbidden(
            Api::<Pod>::namespaced(sidecar.clone(), &app.name)
                .patch(
                    &decoder,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"metadata": {"labels": {"x": "y"}}})),
                )
                .await
        ),
        "the sidecar cannot change a pod"
    );

    // Without the chart's nodes rule: no autoscaler decision, Degraded with the reason and a
    // Warning Event, and the reconcile still applies the spec (minReplicas 2 → 3).
    let mut drop_nodes = cp.kubectl();
    drop_nodes.args([
        "patch",
        "clusterrole/stoker",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/rules/0"}]"#,
    ]);
    let rules = {
        let mut get = cp.kubectl();
        get.args([
            "get",
            "clusterrole/stoker",
            "-o",
            "jsonpath={.rules[0].resources}",
        ]);
        run(get, None)
    };
    assert!(rules.contains("nodes"), "rule 0 is the nodes rule: {rules}");
    run(drop_nodes, None);
    let degraded = eventually(
        "Degraded: nodes unreadable",
        Duration::from_secs(30),
        || async {
            let dp = dps.get("rbac").await.ok()?;
            let (status, reason) = condition(&dp, "Degraded")?;
            (status == "True" && reason == "AutoscalerNodesUnreadable").then_some(dp)
        },
    )
    .await;
    let message = degraded
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Degraded"))
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("nodes"),
        "the message says what is missing: {message}"
    );
    let events: Api<Event> = Api::namespaced(app.client.clone(), &app.name);
    eventually(
        "a Warning Event for the degraded autoscaler",
        Duration::from_secs(20),
        || async {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("AutoscalerNodesUnreadable")
                        && e.type_.as_deref() == Some("Warning")
                })
                .then_some(())
        },
    )
    .await;
    dps.patch(
        "rbac",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"decoders": {"minReplicas": 3}}})),
    )
    .await
    .expect("raise minReplicas");
    wait_ready_decoders(&app.client, &app.name, "rbac", 3).await;

    // The rule back: decisions resume and Degraded clears.
    let mut apply = cp.kubectl();
    apply.args(["apply", "--server-side", "--force-conflicts", "-f", "-"]);
    run(apply, Some(&rbac));
    eventually("Degraded clears", Duration::from_secs(30), || async {
        let dp = dps.get("rbac").await.ok()?;
        (condition(&dp, "Degraded")?.0 == "False").then_some(())
    })
    .await;
    op.stop().await;

    let mut delete = cp.kubectl();
    delete.args([
        "delete",
        "--ignore-not-found",
        "clusterrole/stoker",
        "clusterrolebinding/stoker",
    ]);
    run(delete, None);
}
