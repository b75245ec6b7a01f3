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
        &stoker_operator::webhook::url_configuration(&mwc_name, &ns.name, "https://127.0.0.1:1"),
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
    let hook = &mwc.webhooks.as_ref().expect("webhooks")[0];
    assert_eq!(
        hook.client_config.ca_bundle.as_ref(),
        Some(&ca),
        "operator wrote its CA into caBundle"
    );
    stoker_operator::webhook::serve_from(&mut mwc, &format!("https://127.0.0.1:{port}"));
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
        &stoker_operator::webhook::url_configuration(&mwc_name, &ns.name, "https://127.0.0.1:1"),
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

/// A client of the test API server acting as `user` (impersonation, as `kubectl --as` does):
/// the API server hands the webhook this user's name and groups.
async fn client_as(cp: &ControlPlane, user: &str) -> Client {
    client_as_who(cp, |auth| {
        auth.impersonate = Some(user.to_string());
        auth.impersonate_groups = Some(vec!["system:authenticated".into()]);
    })
    .await
}

/// A Role granting `rules` in `ns`, bound to `user`.
async fn grant(client: &Client, ns: &str, user: &str, rules: serde_json::Value) {
    let name = format!("{user}-rights");
    let role: k8s_openapi::api::rbac::v1::Role =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).expect("role");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .expect("binding");
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
}

/// The admission refusal's message, or `None` when the pipeline was admitted.
async fn refusal(api: &Api<DataPipeline>, dp: &DataPipeline) -> Option<String> {
    match api.create(&PostParams::default(), dp).await {
        Ok(_) => None,
        Err(kube::Error::Api(s)) => Some(s.message),
        Err(e) => panic!("create {}: {e}", dp.name_any()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_grants_its_author_nothing_the_author_could_not_do_alone() {
    let cp = ControlPlane::shared();
    let ns = cp.namespace("op-authz").await;
    install_crd(&ns.client).await;
    Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "s3-keys"},
                "stringData": {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}}))
            .expect("secret"),
        )
        .await
        .expect("secret");
    // alice may write DataPipelines and nothing else; bob may also create pods and read the
    // one Secret.
    let pipelines = json!({"apiGroups": ["stoker.dev"], "resources": ["datapipelines"],
                           "verbs": ["get", "create", "update", "patch"]});
    grant(&ns.client, &ns.name, "alice", json!([pipelines])).await;
    grant(&ns.client, &ns.name, "bob", json!([pipelines,
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["s3-keys"], "verbs": ["get"]}
    ]))
    .await;

    let mwc_name = format!("stoker-{}", ns.name);
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(ns.client.clone());
    let cfg =
        stoker_operator::webhook::url_configuration(&mwc_name, &ns.name, "https://127.0.0.1:1");
    mwcs.create(&PostParams::default(), &cfg)
        .await
        .expect("create webhook configuration");
    let mut config = test_config(
        &ns.name,
        Some(WebhookConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            tls: TlsSource::SelfManaged(self_managed(&ns.name, &mwc_name)),
            refresh_interval: Duration::from_secs(60),
        }),
    );
    config.defaults.allowed_images = vec!["registry.example/ml/*".into()];
    let op = Operator::start_with(ns.client.clone(), config).await;
    let port = op.webhook_addr.expect("webhook address").port();
    let mut mwc = mwcs.get(&mwc_name).await.expect("get mwc");
    stoker_operator::webhook::serve_from(&mut mwc, &format!("https://127.0.0.1:{port}"));
    mwcs.replace(&mwc_name, &PostParams::default(), &mwc)
        .await
        .expect("point at webhook");

    let as_alice: Api<DataPipeline> = Api::namespaced(client_as(cp, "alice").await, &ns.name);
    let as_bob: Api<DataPipeline> = Api::namespaced(client_as(cp, "bob").await, &ns.name);
    let named = |name: &str, edit: &dyn Fn(&mut DataPipeline)| {
        let mut dp = pipeline(name, 1, 1);
        dp.spec.decoders.node_selector.clear();
        edit(&mut dp);
        dp
    };
    // A pipeline of defaults asks for nothing; the webhook answers once it has its port.
    let defaults = named("defaults", &|_| {});
    eventually(
        "the webhook admits a pipeline of defaults",
        Duration::from_secs(30),
        || async { refusal(&as_alice, &defaults).await.is_none().then_some(()) },
    )
    .await;

    let image = |dp: &mut DataPipeline| {
        dp.spec.decoders.image = Some("registry.example/ml/loader:2".into())
    };
    let account =
        |dp: &mut DataPipeline| dp.spec.decoders.service_account_name = Some("s3-reader".into());
    let keys = |dp: &mut DataPipeline| {
        dp.spec.source.s3.credentials_secret_ref =
            serde_json::from_value(json!({"name": "s3-keys"})).expect("ref");
    };
    let tolerations = |dp: &mut DataPipeline| {
        dp.spec.decoders.tolerations =
            serde_json::from_value(json!([{"key": "reserved", "operator": "Exists"}]))
                .expect("tolerations");
    };
    type Edit<'a> = &'a dyn Fn(&mut DataPipeline);
    let cases: [(&str, Edit, String); 4] = [
        (
            "image",
            &image,
            format!(
                "decoders.image: user alice may not create pods in namespace {}",
                ns.name
            ),
        ),
        (
            "account",
            &account,
            format!(
                "decoders.serviceAccountName: user alice may not create pods in namespace {}",
                ns.name
            ),
        ),
        (
            "keys",
            &keys,
            format!(
                "source.s3.credentialsSecretRef: user alice may not get secret \"s3-keys\" in namespace {}",
                ns.name
            ),
        ),
        (
            "tolerations",
            &tolerations,
            format!(
                "decoders.tolerations: user alice may not create pods in namespace {}",
                ns.name
            ),
        ),
    ];
    for (name, edit, expected) in cases {
        let refused = refusal(&as_alice, &named(&format!("alice-{name}"), edit)).await;
        let message = refused.unwrap_or_else(|| panic!("alice's {name} pipeline was admitted"));
        assert!(message.contains(&expected), "{name}: {message}");
        // The same pipeline, from a user who holds the rights.
        assert_eq!(
            refusal(&as_bob, &named(&format!("bob-{name}"), edit)).await,
            None,
            "bob's {name}"
        );
    }

    // An update asks for what it changes: alice may scale her pipeline, not give it a Secret.
    let mut mine = as_alice.get("defaults").await.expect("alice's pipeline");
    mine.spec.decoders.max_replicas = 8;
    mine = as_alice
        .replace("defaults", &PostParams::default(), &mine)
        .await
        .expect("scale");
    keys(&mut mine);
    let refused = as_alice
        .replace("defaults", &PostParams::default(), &mine)
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.message.contains("source.s3.credentialsSecretRef: user alice may not get secret")),
        "{refused:?}"
    );

    // No right makes an image the installation does not allow acceptable.
    let foreign = named("bob-foreign", &|dp| {
        dp.spec.decoders.image = Some("docker.io/miner:1".into())
    });
    let message = refusal(&as_bob, &foreign)
        .await
        .expect("a foreign image is refused");
    assert!(
        message
            .contains("decoders.image: docker.io/miner:1 is not an image this installation allows"),
        "{message}"
    );
    op.stop().await;
}
