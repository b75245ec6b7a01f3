//! The Helm chart: lint, render, apply to the real API server, and run the operator with exactly
//! the RBAC the chart grants (a ServiceAccount token, not admin).

mod operator_support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use operator_support::*;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::build::BuildDefaults;
use stoker_operator::leader::LeaseConfig;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::webhook::tls::{SelfManaged, TlsSource};
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::http;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/stoker");

fn run(mut cmd: Command, stdin: Option<&str>) -> String {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    if stdin.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn().expect("spawn");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn template(cp: &ControlPlane, ns: &str, extra: &[&str]) -> String {
    let mut cmd = cp.helm();
    cmd.args([
        "template",
        "stoker",
        CHART,
        "--namespace",
        ns,
        "--include-crds",
    ])
    .args(extra);
    run(cmd, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_applies_and_its_rbac_runs_the_operator() {
    let cp = ControlPlane::shared();
    let release = cp.namespace("op-chart").await;
    let app = cp.namespace("op-chart-app").await;
    install_crd(&release.client).await;

    // Lint both TLS modes; the cert-manager rendering carries the CA-injection annotation.
    for values in [
        &[][..],
        &[
            "--set",
            "webhook.tls.mode=certManager",
            "--set",
            "podMonitor.enabled=true",
        ][..],
    ] {
        let mut lint = cp.helm();
        lint.args(["lint", "--strict", CHART]).args(values);
        run(lint, None);
    }
    let cm = template(
        cp,
        &release.name,
        &["--set", "webhook.tls.mode=certManager"],
    );
    assert!(cm.contains(&format!(
        "cert-manager.io/inject-ca-from: {}/stoker-webhook",
        release.name
    )));
    assert!(cm.contains("kind: Certificate"));

    // The default rendering applies cleanly to the real API server, then for real.
    let rendered = template(cp, &release.name, &[]);
    assert!(
        !rendered.contains("namespace: default"),
        "every object uses .Release.Namespace"
    );
    let mut dry = cp.kubectl();
    dry.args(["apply", "--dry-run=server", "-f", "-"]);
    run(dry, Some(&rendered));
    let mut apply = cp.kubectl();
    apply.args(["apply", "--server-side", "--force-conflicts", "-f", "-"]);
    run(apply, Some(&rendered));

    // The operator as the chart's ServiceAccount, configured as the chart's Deployment is.
    let client = cp
        .client_for_service_account(&release.name, "stoker")
        .await
        .expect("service account client");
    let ns = release.name.clone();
    let config = Config {
        watch_namespace: None,
        lease: Some(LeaseConfig::new(&ns, "stoker-leader", "stoker-test-0")),
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.into(),
            sidecar_resources: None,
        },
        webhook: Some(WebhookConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            tls: TlsSource::SelfManaged(SelfManaged {
                secret_namespace: ns.clone(),
                secret_name: "stoker-webhook-tls".into(),
                dns_names: vec![format!("stoker-webhook.{ns}.svc")],
                ip_addresses: vec![],
                webhook_configuration: "stoker".into(),
                validity: Duration::from_secs(90 * 86_400),
                renew_before: Duration::from_secs(30 * 86_400),
            }),
            refresh_interval: Duration::from_secs(60),
        }),
        metrics_listen: Some("127.0.0.1:0".parse().expect("addr")),
        autoscaler: None,
    };
    let op = Operator::start_with(client, config).await;

    // TLS: Secret written, caBundle patched, both through the chart's Role and ClusterRole.
    let secret = Api::<Secret>::namespaced(release.client.clone(), &ns)
        .get("stoker-webhook-tls")
        .await
        .expect("webhook Secret");
    let ca = secret
        .data
        .and_then(|d| d.get("ca.crt").cloned())
        .expect("ca.crt");
    let mwc = Api::<MutatingWebhookConfiguration>::all(release.client.clone())
        .get("stoker")
        .await
        .expect("webhook configuration");
    assert_eq!(
        mwc.webhooks.expect("webhooks")[0]
            .client_config
            .ca_bundle
            .as_ref(),
        Some(&ca)
    );

    // Leader election through the chart's Lease rule.
    let leases: Api<Lease> = Api::namespaced(release.client.clone(), &ns);
    eventually("lease held", Duration::from_secs(30), || async {
        let l = leases.get_opt("stoker-leader").await.ok()??;
        (l.spec?.holder_identity.as_deref() == Some("stoker-test-0")).then_some(())
    })
    .await;

    // A pipeline in another namespace is reconciled end to end with the chart's RBAC.
    let dps: Api<DataPipeline> = Api::namespaced(app.client.clone(), &app.name);
    dps.create(&PostParams::default(), &pipeline("chart-check", 3, 1))
        .await
        .expect("create pipeline");
    let pods = wait_ready_decoders(&app.client, &app.name, "chart-check", 3).await;
    assert!(skew_over_cpu_nodes(&pods) <= 1);
    eventually("status Ready", Duration::from_secs(30), || async {
        let s = dps.get("chart-check").await.ok()?.status?;
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(())
    })
    .await;
    let events: Api<Event> = Api::namespaced(app.client.clone(), &app.name);
    eventually(
        "an Event from the operator",
        Duration::from_secs(30),
        || async {
            let list = events.list(&ListParams::default()).await.ok()?;
            list.items
                .iter()
                .any(|e| e.reporting_controller.as_deref() == Some("stoker-operator"))
                .then_some(())
        },
    )
    .await;
    // The health and metrics endpoints the chart's probes and PodMonitor use.
    let addr = op.metrics_addr.expect("metrics address");
    assert_eq!(http::get(addr, "/healthz").await.unwrap().0, 200);
    assert_eq!(http::get(addr, "/readyz").await.unwrap().0, 200);
    let (code, body) = http::get(addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    for family in [
        "stoker_reconciles_total",
        "stoker_reconcile_duration_seconds_bucket",
        "stoker_decoders{",
    ] {
        assert!(
            body.contains(family),
            "{family} missing from /metrics:\n{body}"
        );
    }
    let metrics = op.metrics.encode();
    assert!(
        !metrics.contains("category=\"forbidden\""),
        "RBAC denied something:\n{metrics}"
    );
    assert!(metrics.contains("stoker_leader 1"), "{metrics}");
    op.stop().await;

    // Leave no cluster-scoped objects behind for other tests of this control plane.
    let mut delete = cp.kubectl();
    delete.args([
        "delete",
        "--ignore-not-found",
        "mutatingwebhookconfiguration/stoker",
        "clusterrole/stoker",
        "clusterrolebinding/stoker",
    ]);
    run(delete, None);
}
