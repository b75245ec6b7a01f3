//! The Helm chart's whole path, as a user on a GPU cluster takes it: `helm install` the chart
//! with stoker's image (built here by `scripts/image.sh --debug`, as a user builds and pushes
//! it) and the Prometheus URL, into a restricted namespace. The operator then runs as two pods
//! from that image in runc, elects a leader and serves its webhook through the chart's Service;
//! an `auto` DataPipeline's decoders run from the same image on the CPU nodes; a trainer running
//! as uid 1000 gets the injected sidecar and every sample; the autoscaler, reading Prometheus
//! that found the pods through the chart's PodMonitors, scales the starved trainer's decoders
//! up. `helm uninstall` then leaves none of the chart's objects behind (the CRD stays, as Helm
//! keeps CRDs); what the operator made at run time still stays (see the end of the test).

mod common;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use stoker_demo::{NAMESPACE, Operator, PIPELINE, StoryOptions};
use stoker_testenv::cluster::{ControlPlane, restricted_namespace_labels};
use stoker_testenv::eventually;
use stoker_testenv::runtime::{ImageSource, RuntimeOptions};

const RELEASE: &str = "stoker";
const RELEASE_NAMESPACE: &str = "stoker-system";
/// Where the user pushed the image; the runtime's nodes pull it from the archive.
const IMAGE_REPOSITORY: &str = "registry.example/stoker";
const IMAGE_TAG: &str = "e2e";
/// Enough epochs for the trainer to outlast the scale-up (the autoscaler decides every 6 s).
const EPOCHS: u32 = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_feeds_a_trainer_and_helm_uninstall_removes_the_chart() {
    let archive = build_image();
    let world = common::World::start_with(RuntimeOptions {
        loader_image: format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}"),
        loader: Some(ImageSource::Oci(archive)),
        ..RuntimeOptions::default()
    });
    let cp = ControlPlane::shared();
    let client = cp.client().await.expect("client");

    // The release namespace is restricted too: the operator's own pods must pass.
    let ns: Namespace = serde_json::from_value(json!({"metadata": {
        "name": RELEASE_NAMESPACE, "labels": restricted_namespace_labels(),
    }}))
    .unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create the release namespace");
    let installed = Instant::now();
    helm(
        cp,
        &[
            "install",
            RELEASE,
            &common::repo().join("charts/stoker").display().to_string(),
            "--namespace",
            RELEASE_NAMESPACE,
            "--set",
            &format!("image.repository={IMAGE_REPOSITORY}"),
            "--set",
            &format!("image.tag={IMAGE_TAG}"),
            "--set",
            &format!("autoscaler.prometheusUrl={}", world.prometheus.url()),
            // Prometheus scrapes every 2 s here, not every 15 s: rates over 12 s, a decision
            // every 6 s, so that the story fits a test (the values a fast-scraping cluster sets).
            "--set",
            "autoscaler.windowSeconds=12",
            "--set",
            "autoscaler.periodSeconds=6",
            // Both operator replicas Ready (their readiness probes, from the pods' IPs).
            "--wait",
            "--timeout",
            "180s",
        ],
    );
    eprintln!(
        "helm install: both replicas ready after {:.0}s",
        installed.elapsed().as_secs_f64()
    );

    // Leader elected: one of the two operator pods holds the Lease.
    let operators: Vec<String> = Api::<Pod>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/instance=stoker"))
        .await
        .expect("operator pods")
        .items
        .iter()
        .map(|p| {
            let image = p.spec.as_ref().unwrap().containers[0].image.clone();
            assert_eq!(
                image.as_deref(),
                Some(format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}").as_str()),
                "the operator runs from the image helm was given"
            );
            p.metadata.name.clone().unwrap()
        })
        .collect();
    assert_eq!(operators.len(), 2, "two operator replicas: {operators:?}");
    let leases: Api<Lease> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let holder = eventually(
        "an operator replica to hold the Lease",
        Duration::from_secs(60),
        || async {
            leases
                .get_opt("stoker-leader")
                .await
                .ok()
                .flatten()
                .and_then(|l| l.spec?.holder_identity)
        },
    )
    .await;
    assert!(
        operators.contains(&holder),
        "the leader {holder} is one of {operators:?}"
    );
    // The webhook is called through the chart's Service, not a URL.
    let mwc = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get(RELEASE)
        .await
        .expect("the chart's webhook configuration");
    let hook = &mwc.webhooks.as_ref().unwrap()[0].client_config;
    assert!(hook.url.is_none() && hook.service.is_some(), "{hook:?}");

    // An auto pipeline, from one decoder, feeding a starved trainer (uid 1000, runAsNonRoot)
    // on the GPU node through its injected sidecar.
    let opts = StoryOptions {
        bucket: "story".into(),
        baseline: Duration::ZERO,
        recover_timeout: Duration::from_secs(240),
        epochs: EPOCHS,
        work_dir: world.out.clone(),
        operator: Operator::Installed,
        ..StoryOptions::default()
    };
    let report = stoker_demo::run(
        &world.stage(),
        &opts,
        |t| eprintln!("{t:?}"),
        |d| eprintln!("{d:?}"),
    )
    .await
    .expect("the pipeline phase runs with the installed operator");
    world.assert_every_sample_once(&report.keys_file, EPOCHS);
    assert!(
        report.decisions.iter().any(|d| d.to > d.from),
        "the installed autoscaler scaled the decoders up: {:?}",
        report.decisions
    );
    assert!(
        report.decoder_nodes.iter().all(|n| n.starts_with("cpu-")),
        "decoders on the CPU nodes: {:?}",
        report.decoder_nodes
    );
    eprintln!(
        "decisions {:?}; fed at {:.1}% busy at the end",
        report
            .decisions
            .iter()
            .map(|d| format!("{} → {}", d.from, d.to))
            .collect::<Vec<_>>(),
        report.final_busy_pct
    );

    audit_says_each_identity_kept_to_its_rights(cp);

    // The pipelines' namespace goes first (what a user does before uninstalling the operator
    // that reconciles it); then the release.
    wait_until_gone(&client, NAMESPACE).await;
    helm(
        cp,
        &[
            "uninstall",
            RELEASE,
            "--namespace",
            RELEASE_NAMESPACE,
            "--wait",
        ],
    );
    // The operator's own Secrets and Lease belong to the webhook configuration Helm deletes, so
    // the garbage collector removes them too.
    eventually(
        "helm uninstall to remove every stoker object",
        Duration::from_secs(60),
        || async {
            let left = stoker_objects(cp);
            if !left.is_empty() {
                eprintln!("left after helm uninstall: {left:?}");
            }
            left.is_empty().then_some(())
        },
    )
    .await;
    world.runtime.shutdown();
}

/// The API server's audit log of the run so far (before uninstall, which takes the operator's
/// Role while its replicas still renew their Lease): the operator read no Secret but its own two in its namespace and touched
/// nothing in the cluster's namespaces; the sidecar stayed in its namespace and was refused
/// nothing; the decoders, which mount no token, made no request at all.
fn audit_says_each_identity_kept_to_its_rights(cp: &ControlPlane) {
    use stoker_operator::build::sidecar_rbac::{
        decoder_service_account_name, sidecar_service_account_name,
    };
    use stoker_testenv::audit;
    let events = cp.audit_events();
    let account = |ns: &str, name: &str| format!("system:serviceaccount:{ns}:{name}");
    let operator = audit::requests_of(&events, &account(RELEASE_NAMESPACE, RELEASE));
    assert!(
        operator
            .iter()
            .any(|r| r.verb == "create" && r.resource == "pods"),
        "the audit log holds the operator's requests ({} events)",
        events.len()
    );
    let breaches = audit::operator_breaches(
        &operator,
        RELEASE_NAMESPACE,
        &["stoker-ca", "stoker-webhook-tls"],
    );
    assert!(
        breaches.is_empty(),
        "the operator went beyond its rights:\n{}",
        breaches.join("\n")
    );
    let sidecar = audit::requests_of(
        &events,
        &account(NAMESPACE, &sidecar_service_account_name(PIPELINE)),
    );
    assert!(
        !sidecar.is_empty(),
        "the sidecar read its decoders from the API server"
    );
    let breaches = audit::confinement_breaches(&sidecar, NAMESPACE);
    assert!(
        breaches.is_empty(),
        "the sidecar went beyond its Role:\n{}",
        breaches.join("\n")
    );
    let decoder = audit::requests_of(
        &events,
        &account(NAMESPACE, &decoder_service_account_name(PIPELINE)),
    );
    assert!(decoder.is_empty(), "decoders made requests: {decoder:?}");
    eprintln!(
        "audit: operator {} requests, sidecar {}, decoders 0; none beyond their rights",
        operator.len(),
        sidecar.len()
    );
}

/// stoker's image from the test build's binaries, as `scripts/image.sh --debug` writes it
/// (cached: a no-op when the binaries did not change).
fn build_image() -> PathBuf {
    let out = Command::new(common::repo().join("scripts/image.sh"))
        .arg("--debug")
        .output()
        .expect("run scripts/image.sh");
    assert!(
        out.status.success(),
        "scripts/image.sh --debug: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let archive = String::from_utf8_lossy(&out.stdout).trim().to_string();
    PathBuf::from(archive)
}

fn helm(cp: &ControlPlane, args: &[&str]) {
    let out = cp.helm().args(args).output().expect("run helm");
    assert!(
        out.status.success(),
        "helm {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn wait_until_gone(client: &kube::Client, namespace: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    eventually(
        &format!("namespace {namespace} to be deleted"),
        Duration::from_secs(120),
        || async { matches!(namespaces.get_opt(namespace).await, Ok(None)).then_some(()) },
    )
    .await;
}

/// Every object of every listable kind that is stoker's: in the release namespace (but the
/// `default` ServiceAccount and `kube-root-ca.crt` ConfigMap every namespace gets), labelled
/// with the release, or named after stoker. Not: Events (they expire), the CRD (Helm keeps
/// CRDs) and the local APIService the API server registers for it, the release namespace
/// itself (the test made it, as `--create-namespace` would).
fn stoker_objects(cp: &ControlPlane) -> Vec<String> {
    let kinds = kubectl(cp, &["api-resources", "--verbs=list", "-o", "name"]);
    let kinds: Vec<&str> = kinds
        .lines()
        .filter(|k| {
            !k.starts_with("events") && *k != "customresourcedefinitions.apiextensions.k8s.io"
        })
        .collect();
    let list: Value = serde_json::from_str(&kubectl(
        cp,
        &["get", &kinds.join(","), "--all-namespaces", "-o", "json"],
    ))
    .expect("kubectl get -o json");
    let mut found = Vec::new();
    for item in list["items"].as_array().into_iter().flatten() {
        let kind = item["kind"].as_str().unwrap_or_default();
        let meta = &item["metadata"];
        let name = meta["name"].as_str().unwrap_or_default();
        let namespace = meta["namespace"].as_str().unwrap_or_default();
        // What every namespace gets, and the local APIService registered for the CRD.
        let everyones = matches!(
            (kind, name),
            ("ServiceAccount", "default") | ("ConfigMap", "kube-root-ca.crt")
        ) || (kind == "APIService" && item["spec"]["service"].is_null());
        let ours = namespace == RELEASE_NAMESPACE
            || meta["labels"]["app.kubernetes.io/instance"] == RELEASE
            || (name.contains("stoker") && !(kind == "Namespace" && name == RELEASE_NAMESPACE));
        if ours && !everyones {
            found.push(format!("{kind} {namespace}/{name}"));
        }
    }
    found
}

fn kubectl(cp: &ControlPlane, args: &[&str]) -> String {
    let out = cp.kubectl().args(args).output().expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
