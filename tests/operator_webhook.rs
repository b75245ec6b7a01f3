//! Sidecar injection through the real API server: a MutatingWebhookConfiguration pointing at the
//! in-process operator's webhook over TLS with its self-managed certificate.

mod operator_support;

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use operator_support::*;
use serde_json::json;
use stoker_operator::api::DataPipeline;
use stoker_operator::build::sidecar::quantity_bytes;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::webhook::tls::{SelfManaged, TlsSource};
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_pod_security,
};

fn trainer(name: &str, pipeline: Option<&str>) -> Pod {
    let labels = match pipeline {
        Some(p) => json!({"stoker.dev/pipeline": p, "app": "trainer"}),
        None => json!({"app": "trainer"}),
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"stoker.dev/world-size": "2", "stoker.dev/rank": "0"}},
        "spec": {
            "securityContext": restricted_pod_security(1000),
            "containers": [{"name": "trainer", "image": "registry.invalid/trainer:1",
                            "securityContext": restricted_container_security()}],
            "nodeSelector": {"stoker.dev/pool": "cpu"}
        }
    }))
    .expect("pod")
}

fn count<T>(items: Option<&Vec<T>>, pred: impl Fn(&T) -> bool) -> usize {
    items.map_or(0, |v| v.iter().filter(|x| pred(x)).count())
}

fn self_managed(ns: &str, mwc: &str) -> SelfManaged {
    SelfManaged {
        secret_namespace: ns.to_string(),
        secret_name: "stoker-webhook-tls".into(),
        dns_names: vec![format!("stoker-webhook.{ns}.svc")],
        ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
        webhook_configuration: mwc.to_string(),
        validity: Duration::from_secs(90 * 86_400),
        renew_before: Duration::from_secs(30 * 86_400),
    }
}

async fn start_with_webhook(client: &Client, ns: &str, mwc: &str) -> Operator {
    let webhook = WebhookConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        tls: TlsSource::SelfManaged(self_managed(ns, mwc)),
        refresh_interval: Duration::from_secs(60),
    };
    Operator::start(client.clone(), ns, Some(webhook)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_injects_the_sidecar_over_tls_and_trainers_show_in_status() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-webhook").await;
    install_crd(&ns.client).await;
    let dps: Api<DataPipeline> = Api::namespaced(ns.client.clone(), &ns.name);
    dps.create(&PostParams::default(), &pipeline("vision", 2, 1))
        .await
        .expect("create pipeline");

    // The configuration exists first (the operator writes its caBundle), then gets our port.
    let mwc_name = format!("stoker-{}", ns.name);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(ns.client.clone());
    mwcs.create(
        &PostParams::default(),
        &stoker_operator::webhook::url_configuration(
            &mwc_name,
            &ns.name,
            "https://127.0.0.1:1/mutate",
        ),
    )
    .await
    .expect("create webhook configuration");
    let op = start_with_webhook(&ns.client, &ns.name, &mwc_name).await;
    let port = op.webhook_addr.expect("webhook address").port();
    let mut mwc = mwcs.get(&mwc_name).await.expect("get mwc");
    let secret = Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .get("stoker-webhook-tls")
        .await
        .expect("self-managed Secret");
    let ca = secret
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .expect("ca.crt")
        .clone();
    let hook = &mut mwc.webhooks.as_mut().expect("webhooks")[0];
    assert_eq!(
        hook.client_config.ca_bundle.as_ref(),
        Some(&ca),
        "operator wrote its CA into caBundle"
    );
    hook.client_config.url = Some(format!("https://127.0.0.1:{port}/mutate"));
    mwcs.replace(&mwc_name, &PostParams::default(), &mwc)
        .await
        .expect("point at webhook");
    let decoders_before = uids(&wait_ready_decoders(&ns.client, &ns.name, "vision", 2).await);

    // A labelled trainer pod gets the native sidecar, the shared-memory volume and the env.
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let created = eventually("webhook reachable", Duration::from_secs(30), || async {
        pods.create(
            &PostParams::default(),
            &trainer("trainer-0", Some("vision")),
        )
        .await
        .ok()
    })
    .await;
    let spec = created.spec.clone().expect("spec");
    let inits = spec.init_containers.clone().expect("init containers");
    assert_eq!(inits[0].name, "stoker-loader");
    assert_eq!(inits[0].restart_policy.as_deref(), Some("Always"));
    assert!(inits[0].startup_probe.is_some());
    // The sidecar's memory covers its base and the pipeline's 512Mi ring.
    let limits = inits[0]
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .expect("limits");
    assert_eq!(limits["memory"].0, ((128u64 + 512) << 20).to_string());
    let rank = inits[0]
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "RANK")
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(
        rank.as_deref(),
        Some("metadata.annotations['stoker.dev/rank']"),
        "the sidecar shards by the pod's rank"
    );
    let shm = spec
        .volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == "stoker-shm"))
        .expect("shm volume");
    assert_eq!(
        shm.empty_dir.as_ref().and_then(|e| e.medium.as_deref()),
        Some("Memory")
    );
    let env = spec.containers[0].env.clone().expect("env");
    assert!(
        env.iter()
            .any(|e| e.name == "STOKER_SHM_DIR" && e.value.as_deref() == Some("/dev/shm/stoker"))
    );
    assert!(env.iter().all(|e| e.name != "STOKER_SOCKET"));
    assert_eq!(
        created.labels().get("stoker.dev/role").map(String::as_str),
        Some("trainer")
    );

    // Re-invocation on an already injected pod adds nothing twice.
    let mut again = created.clone();
    again.metadata = kube::api::ObjectMeta {
        name: Some("trainer-1".into()),
        labels: created.metadata.labels.clone(),
        annotations: created.metadata.annotations.clone(),
        ..Default::default()
    };
    again
        .annotations_mut()
        .insert("stoker.dev/rank".into(), "1".into());
    again.status = None;
    if let Some(s) = again.spec.as_mut() {
        s.node_name = None;
    }
    let again = pods
        .create(&PostParams::default(), &again)
        .await
        .expect("create injected copy");
    let s = again.spec.expect("spec");
    assert_eq!(
        count(s.init_containers.as_ref(), |c| c.name == "stoker-loader"),
        1
    );
    assert_eq!(count(s.volumes.as_ref(), |v| v.name == "stoker-shm"), 1);
    assert_eq!(
        count(s.containers[0].env.as_ref(), |e| e.name == "STOKER_SHM_DIR"),
        1
    );
    assert_eq!(
        count(s.containers[0].volume_mounts.as_ref(), |m| m.name
            == "stoker-shm"),
        1
    );

    // An unlabelled pod is never touched.
    let plain = pods
        .create(&PostParams::default(), &trainer("plain", None))
        .await
        .expect("plain pod");
    assert!(plain.spec.expect("spec").init_containers.is_none());
    assert!(
        !plain
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("stoker.dev/injected")
    );

    // A pod naming a pipeline that does not exist is refused, with a message that says why.
    let refused = pods
        .create(&PostParams::default(), &trainer("orphan", Some("missing")))
        .await;
    let message = match refused {
        Err(kube::Error::Api(s)) => s.message.clone(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(
        message.contains("DataPipeline \"missing\"") && message.contains("does not exist"),
        "{message}"
    );

    // The namespace enforces the restricted Pod Security Standard: the injected pods above passed
    // it, and a trainer that may run as root is refused after the webhook injected its sidecar.
    let mut root_trainer = trainer("root-trainer", Some("vision"));
    if let Some(s) = root_trainer.spec.as_mut() {
        s.security_context = None;
    }
    let message = match pods.create(&PostParams::default(), &root_trainer).await {
        Err(kube::Error::Api(s)) => s.message.clone(),
        other => panic!("expected Pod Security to refuse a root trainer, got {other:?}"),
    };
    assert!(
        message.contains("violates PodSecurity \"restricted:latest\"")
            && message.contains("runAsNonRoot")
            && message.contains("\"trainer\""),
        "{message}"
    );

    // Trainers are tracked in status; a change in their number leaves the decoders alone.
    eventually(
        "two trainers in status",
        Duration::from_secs(30),
        || async {
            let t = dps.get("vision").await.ok()?.status?.trainers;
            (t.pods == 2 && t.injected == 2 && t.world_size == 2 && t.ranks == [0, 1]).then_some(())
        },
    )
    .await;
    pods.delete("trainer-1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete trainer");
    eventually("one trainer in status", Duration::from_secs(30), || async {
        let t = dps.get("vision").await.ok()?.status?.trainers;
        (t.pods == 1 && t.ranks == [0]).then_some(())
    })
    .await;
    let decoders_after = uids(&wait_ready_decoders(&ns.client, &ns.name, "vision", 2).await);
    assert_eq!(
        decoders_before, decoders_after,
        "trainer changes restarted decoders"
    );

    // A torchrun pod of 8 processes: a ring and a socket for each, in a group they share.
    let torchrun = pods
        .create(
            &PostParams::default(),
            &torchrun_trainer("torchrun-0", "vision"),
        )
        .await
        .expect("create torchrun pod");
    assert_serves_eight_local_ranks(&torchrun);
    let message = match pods
        .create(&PostParams::default(), &{
            let mut p = torchrun_trainer("unreadable", "vision");
            p.annotations_mut()
                .insert("stoker.dev/local-ranks".into(), "eight".into());
            p
        })
        .await
    {
        Err(kube::Error::Api(s)) => s.message.clone(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert!(
        message.contains("the annotation stoker.dev/local-ranks is \"eight\""),
        "{message}"
    );

    op.stop().await;
    mwcs.delete(&mwc_name, &DeleteParams::default())
        .await
        .expect("delete mwc");
}

/// `torchrun --nproc-per-node 8` on a node's 8 GPUs, as a non-root user.
fn torchrun_trainer(name: &str, pipeline: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"stoker.dev/pipeline": pipeline}},
        "spec": {
            "securityContext": restricted_pod_security(1000),
            "containers": [{
                "name": "trainer", "image": "registry.invalid/trainer:1",
                "command": ["torchrun", "--nproc-per-node", "8", "train.py"],
                "securityContext": restricted_container_security(),
                "resources": {"limits": {"nvidia.com/gpu": "8"}}
            }],
            "nodeSelector": {"stoker.dev/pool": "gpu"}
        }
    }))
    .expect("pod")
}

/// What the API server stored for [`torchrun_trainer`] after the webhook.
fn assert_serves_eight_local_ranks(pod: &Pod) {
    let spec = pod.spec.as_ref().expect("spec");
    let sidecar = &spec.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(sidecar.name, "stoker-loader");
    let value = |name: &str| {
        sidecar
            .env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(value("STOKER_LOCAL_RANKS").as_deref(), Some("8"));
    assert_eq!(value("WORLD_SIZE").as_deref(), Some("8"));
    let args = sidecar.args.clone().expect("args").join(" ");
    assert!(!args.contains("--socket"), "{args}");
    for c in spec.containers.iter().chain([sidecar]) {
        assert!(
            c.env.iter().flatten().all(|e| e.name != "STOKER_SOCKET"),
            "{} has STOKER_SOCKET",
            c.name
        );
    }
    // Eight of the pipeline's 512Mi rings, in the volume and on the sidecar's 128Mi.
    let bytes = |q: Option<&Quantity>| q.and_then(|q| quantity_bytes(&q.0));
    let rings = 8 * (512u64 << 20);
    let shm = spec
        .volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == "stoker-shm"))
        .and_then(|v| v.empty_dir.as_ref())
        .expect("shm volume");
    assert_eq!(bytes(shm.size_limit.as_ref()), Some(rings));
    let resources = sidecar.resources.as_ref().expect("resources");
    for list in [&resources.limits, &resources.requests] {
        let memory = list.as_ref().and_then(|l| l.get("memory"));
        assert_eq!(bytes(memory), Some((128u64 << 20) + rings));
    }
    // The trainer (uid 1000) reaches the sidecar's 0660 sockets through the pod's fsGroup.
    let security = spec
        .security_context
        .as_ref()
        .expect("pod security context");
    assert_eq!(security.fs_group, Some(65532));
    assert_eq!(
        security.fs_group_change_policy.as_deref(),
        Some("OnRootMismatch")
    );
    assert_eq!(security.run_as_user, Some(1000));
    let own = sidecar.security_context.as_ref().expect("sidecar security");
    assert_eq!(
        (own.run_as_user, own.run_as_group),
        (Some(65532), Some(65532))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_near_expiry_is_renewed_with_the_same_ca() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-tls").await;
    let mwc_name = format!("stoker-{}", ns.name);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(ns.client.clone());
    mwcs.create(
        &PostParams::default(),
        &stoker_operator::webhook::url_configuration(
            &mwc_name,
            &ns.name,
            "https://127.0.0.1:1/mutate",
        ),
    )
    .await
    .expect("create webhook configuration");

    // A certificate with one day left, as a replica issued it long ago.
    let mut short = self_managed(&ns.name, &mwc_name);
    short.validity = Duration::from_secs(86_400);
    short.renew_before = Duration::ZERO;
    let old = stoker_operator::webhook::tls::ensure_secret(&ns.client, &short, None)
        .await
        .expect("seed the Secret");

    let op = start_with_webhook(&ns.client, &ns.name, &mwc_name).await;
    let secret = Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .get("stoker-webhook-tls")
        .await
        .expect("Secret");
    let field = |k: &str| {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .expect(k)
            .0
            .clone();
        String::from_utf8(bytes).expect("PEM")
    };
    assert_ne!(
        field("tls.crt"),
        old.cert_pem,
        "the serving certificate was renewed"
    );
    assert_eq!(
        field("ca.crt"),
        old.ca_pem,
        "renewal keeps the CA the API server trusts"
    );
    let not_after: k8s_openapi::jiff::Timestamp = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("stoker.dev/not-after"))
        .expect("not-after")
        .parse()
        .expect("timestamp");
    let left = not_after.duration_since(k8s_openapi::jiff::Timestamp::now());
    assert!(
        left.as_secs_f64() > 60.0 * 86_400.0,
        "renewed for 90 days, {left:?} left"
    );
    let mwc = mwcs.get(&mwc_name).await.expect("mwc");
    let bundle = mwc.webhooks.expect("webhooks")[0]
        .client_config
        .ca_bundle
        .clone();
    assert_eq!(bundle.map(|b| b.0), Some(old.ca_pem.into_bytes()));
    op.stop().await;
    mwcs.delete(&mwc_name, &DeleteParams::default())
        .await
        .expect("delete mwc");
}
