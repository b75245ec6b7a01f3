//! The Helm chart: lint, render, apply to the real API server, and run the operator with exactly
//! the RBAC the chart grants (a ServiceAccount token, not admin).

mod operator_support;

use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, ObjectMeta, PostParams};
use operator_support::*;
use stoker_operator::Config;
use stoker_operator::api::DataPipeline;
use stoker_operator::build::BuildDefaults;
use stoker_operator::leader::LeaseConfig;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::webhook::tls::{SelfManaged, TlsSource};
use stoker_testenv::audit;
use stoker_testenv::cluster::ControlPlane;
use stoker_testenv::http;

fn template(cp: &ControlPlane, ns: &str, extra: &[&str]) -> String {
    let mut cmd = cp.helm();
    cmd.args([
        "template",
        "stoker",
        chart().as_str(),
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
        lint.args(["lint", "--strict", chart().as_str()])
            .args(values);
        run(lint, None);
    }
    // A typo in a value fails `helm install` against the real cluster, before anything is made.
    let typo = cp
        .helm()
        .args([
            "install",
            "typo",
            chart().as_str(),
            "--namespace",
            &release.name,
            "--set",
            "webhook.failurPolicy=Ignore",
        ])
        .output()
        .expect("helm install");
    let stderr = String::from_utf8_lossy(&typo.stderr);
    assert!(
        !typo.status.success() && stderr.contains("failurPolicy"),
        "{stderr}"
    );
    let listed = run(
        {
            let mut l = cp.helm();
            l.args(["list", "--namespace", &release.name, "--short"]);
            l
        },
        None,
    );
    assert!(!listed.contains("typo"), "no release was made: {listed}");

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
    // As the chart's Deployment sets it: the installation's CA lives in the release namespace,
    // the one place the chart lets the operator read a Secret. (The only test of this binary
    // that starts an operator.)
    // SAFETY: set before the operator starts; nothing else reads the environment meanwhile.
    unsafe { std::env::set_var("POD_NAMESPACE", &ns) };
    let config = Config {
        watch_namespace: None,
        lease: Some(LeaseConfig::new(&ns, "stoker-leader", "stoker-test-0")),
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.into(),
            sidecar_resources: None,
            allowed_images: Vec::new(),
        },
        webhook: Some(WebhookConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            tls: TlsSource::SelfManaged(SelfManaged {
                secret_namespace: ns.clone(),
                secret_name: "stoker-webhook-tls".into(),
                dns_names: vec![format!("stoker-webhook.{ns}.svc")],
                ip_addresses: vec!["127.0.0.1".parse().expect("ip")],
                webhook_configuration: "stoker".into(),
                validity: Duration::from_secs(90 * 86_400),
                renew_before: Duration::from_secs(30 * 86_400),
            }),
            refresh_interval: Duration::from_secs(60),
        }),
        metrics_listen: Some("127.0.0.1:0".parse().expect("addr")),
        autoscaler: None,
        installation: Some("stoker".into()),
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
    let mwcs = Api::<MutatingWebhookConfiguration>::all(release.client.clone());
    let mut mwc = mwcs.get("stoker").await.expect("webhook configuration");
    for hook in mwc.webhooks.iter().flatten() {
        assert_eq!(
            hook.client_config.ca_bundle.as_ref(),
            Some(&ca),
            "{}",
            hook.name
        );
    }
    // The chart's Service has no endpoints here (the operator runs in this process): the
    // webhooks, which fail closed, are pointed at it.
    let port = op.webhook_addr.expect("webhook address").port();
    stoker_operator::webhook::serve_from(&mut mwc, &format!("https://127.0.0.1:{port}"));
    let mwc = mwcs
        .replace("stoker", &PostParams::default(), &mwc)
        .await
        .expect("point the webhooks at the operator");

    // Leader election through the chart's Lease rule.
    let leases: Api<Lease> = Api::namespaced(release.client.clone(), &ns);
    eventually("lease held", Duration::from_secs(30), || async {
        let l = leases.get_opt("stoker-leader").await.ok()??;
        (l.spec?.holder_identity.as_deref() == Some("stoker-test-0")).then_some(())
    })
    .await;

    // A pipeline in another namespace is reconciled end to end with the chart's RBAC.
    let dps: Api<DataPipeline> = Api::namespaced(app.client.clone(), &app.name);
    // Admitted by the chart's authorize webhook once the API server has its new address.
    eventually("pipeline admitted", Duration::from_secs(30), || async {
        dps.create(&PostParams::default(), &pipeline("chart-check", 3, 1))
            .await
            .ok()
    })
    .await;
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

    // What the operator made for itself belongs to the webhook configuration, set through the
    // chart's RBAC.
    let mwc_uid = mwc.metadata.uid.clone().expect("uid");
    let owned_by_mwc = |meta: &ObjectMeta| {
        meta.owner_references
            .iter()
            .flatten()
            .any(|r| r.uid == mwc_uid && r.kind == "MutatingWebhookConfiguration")
    };
    let secrets: Api<Secret> = Api::namespaced(release.client.clone(), &ns);
    eventually(
        "owners on the Secrets and the Lease",
        Duration::from_secs(30),
        || async {
            let webhook_tls = secrets.get("stoker-webhook-tls").await.ok()?;
            let ca = secrets.get("stoker-ca").await.ok()?;
            let lease = leases.get("stoker-leader").await.ok()?;
            [webhook_tls.metadata, ca.metadata, lease.metadata]
                .iter()
                .all(owned_by_mwc)
                .then_some(())
        },
    )
    .await;
    op.stop().await;

    // The API server's audit log of the operator's whole run (stopped: its watches are in it):
    // no Secret read but its own two in its namespace, nothing in the cluster's namespaces,
    // nothing refused — under the cluster-wide ClusterRole, which grants no Secret reads.
    let user = format!("system:serviceaccount:{ns}:stoker");
    let requests = eventually(
        "the operator's watches in the audit log",
        Duration::from_secs(10),
        || async {
            let requests = audit::requests_of(&cp.audit_events(), &user);
            requests
                .iter()
                .any(|r| r.verb == "watch" && r.resource == "pods")
                .then_some(requests)
        },
    )
    .await;
    let breaches = audit::operator_breaches(&requests, &ns, &["stoker-ca", "stoker-webhook-tls"]);
    assert!(
        breaches.is_empty(),
        "the operator went beyond its rights:\n{}",
        breaches.join("\n")
    );
    let probes = requests
        .iter()
        .filter(|r| r.verb == "create" && r.resource == "secrets");
    assert!(
        probes.count() > 0,
        "the certificate Secret was created (or probed) by create only"
    );

    // Leave no cluster-scoped objects behind for other tests of this control plane; the
    // garbage collector then removes what the operator made.
    let mut delete = cp.kubectl();
    delete.args([
        "delete",
        "--ignore-not-found",
        "mutatingwebhookconfiguration/stoker",
        "clusterrole/stoker",
        "clusterrolebinding/stoker",
    ]);
    run(delete, None);
    eventually(
        "the operator's Secrets and Lease to go with their owner",
        Duration::from_secs(60),
        || async {
            let gone = matches!(secrets.get_opt("stoker-webhook-tls").await, Ok(None))
                && matches!(secrets.get_opt("stoker-ca").await, Ok(None))
                && matches!(leases.get_opt("stoker-leader").await, Ok(None));
            gone.then_some(())
        },
    )
    .await;
}

fn helm_template(values: &[&str]) -> Result<String, String> {
    let out = Command::new(stoker_testenv::cluster::bin_dir().join("helm"))
        .args([
            "template",
            "stoker",
            chart().as_str(),
            "--namespace",
            "stoker",
        ])
        .args(values)
        .output()
        .expect("run helm (scripts/tools.sh builds it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(text)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn documents(rendered: &str) -> Vec<serde_json::Value> {
    rendered
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str::<serde_json::Value>(d).ok())
        .filter(|d| d.is_object())
        .collect()
}

fn of_kind<'a>(docs: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The operator container's args in a rendering.
fn operator_args(rendered: &str) -> Vec<String> {
    let docs = documents(rendered);
    let deployment = of_kind(&docs, "Deployment")[0];
    serde_json::from_value(deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone())
        .expect("args")
}

#[test]
fn the_autoscaler_values_reach_flags_the_operator_knows() {
    let rendered = helm_template(&[
        "--set",
        "autoscaler.prometheusUrl=http://prometheus-operated.monitoring:9090",
        "--set",
        "autoscaler.windowSeconds=120",
        "--set",
        "autoscaler.periodSeconds=20",
    ])
    .expect("renders");
    let args = operator_args(&rendered);
    for want in [
        "--prometheus-url=http://prometheus-operated.monitoring:9090",
        "--autoscale-window-seconds=120",
        "--autoscale-period-seconds=20",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} missing: {args:?}");
    }
    // Without a URL no autoscaler runs, and no empty flag is passed.
    let off = operator_args(&helm_template(&[]).expect("renders"));
    assert!(
        !off.iter().any(|a| a.starts_with("--prometheus-url")),
        "{off:?}"
    );

    // Every flag the chart passes is one the operator's binary accepts.
    let help = Command::new(env!("CARGO_BIN_EXE_stoker-operator"))
        .args(["run", "--help"])
        .output()
        .expect("stoker-operator run --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        let flag = arg.split('=').next().unwrap_or(arg);
        assert!(
            help.contains(&format!("{flag} "))
                || help.contains(&format!("{flag}\n"))
                || help.contains(&format!("{flag} <")),
            "the chart passes {flag}, which `stoker-operator run` does not know:\n{help}"
        );
    }

    // One image for operator and loader, tagged with the chart's appVersion.
    let chart: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(format!("{}/Chart.yaml", chart())).expect("Chart.yaml"),
    )
    .expect("Chart.yaml parses");
    let image = format!(
        "ghcr.io/stoker-dev/stoker:{}",
        chart["appVersion"].as_str().expect("appVersion")
    );
    assert!(
        args.contains(&format!("--loader-image={image}")),
        "{args:?}"
    );
    assert!(
        rendered.contains(&format!("image: \"{image}\"")),
        "operator image {image}"
    );
}

#[test]
fn webhook_replicas_have_a_disruption_budget() {
    let docs = documents(&helm_template(&["--set", "replicaCount=3"]).expect("renders"));
    let pdbs = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(pdbs.len(), 1);
    assert_eq!(pdbs[0]["spec"]["minAvailable"], 1);
    let deployment = of_kind(&docs, "Deployment")[0];
    assert_eq!(
        pdbs[0]["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
        "the budget covers the operator's pods"
    );
    let single = documents(&helm_template(&["--set", "replicaCount=1"]).expect("renders"));
    assert!(
        of_kind(&single, "PodDisruptionBudget").is_empty(),
        "one replica: a budget of 1 would block every drain"
    );
}

#[test]
fn a_typo_in_a_value_fails_the_rendering() {
    for (values, names) in [
        (&["--set", "replicaCont=2"][..], "replicaCont"),
        (
            &["--set", "autoscaler.prometheusURL=http://p:9090"][..],
            "prometheusURL",
        ),
        (&["--set", "replicaCount=two"][..], "replicaCount"),
        (&["--set", "webhook.tls.mode=selfmanaged"][..], "mode"),
        (&["--set-string", "podMonitor.enabled=yes"][..], "enabled"),
    ] {
        let err = helm_template(values).expect_err(&format!("{values:?} must fail"));
        assert!(
            err.contains(names),
            "{values:?}: the error names {names}: {err}"
        );
    }
    // Every value in values.yaml is in the schema (the defaults pass it).
    helm_template(&[]).expect("the defaults pass the schema");
}

/// The metric names the README's Metrics tables document (`_suffix` entries expanded with the
/// cell's first name's prefix, e.g. `_desired_decoders` → `stoker_autoscaler_desired_decoders`).
fn documented_metrics() -> std::collections::BTreeSet<String> {
    let readme = std::fs::read_to_string(stoker_testenv::manifest_dir().join("README.md"))
        .expect("README.md");
    let section = readme
        .split("\n## Metrics")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Metrics section");
    let mut names = std::collections::BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with('|')) {
        let cell = row.split('|').nth(1).unwrap_or_default();
        let mut prefix = None;
        for token in cell.split('`').skip(1).step_by(2) {
            let name: String = token
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.starts_with("stoker_") {
                prefix = Some(name.splitn(3, '_').take(2).collect::<Vec<_>>().join("_"));
                names.insert(name);
            } else if let (Some(p), true) = (&prefix, name.starts_with('_')) {
                names.insert(format!("{p}{name}"));
            }
        }
    }
    names
}

/// Whether the code registers `name`: the operator's by encoding its registry, the autoscaler's,
/// loader's and sidecar's by their registration names in their metrics modules.
fn exported_by_the_code(name: &str, operator: &str) -> bool {
    let base = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    let root = stoker_testenv::manifest_dir();
    let source = |file: &str| std::fs::read_to_string(root.join(file)).expect(file);
    if let Some(rest) = base.strip_prefix("stoker_loader_") {
        source("loader/src/metrics.rs").contains(&format!("\"{rest}\""))
    } else if let Some(rest) = base.strip_prefix("stoker_sidecar_") {
        source("loader/src/sidecar/metrics.rs").contains(&format!("\"{rest}\""))
    } else if let Some(rest) = base.strip_prefix("stoker_autoscaler_") {
        // Families with no series yet encode nothing, so the registration names tell.
        source("src/autoscale/metrics.rs").contains(&format!("\"{rest}\""))
    } else if base.starts_with("stoker_trainer_") {
        source("loader/src/sidecar/metrics.rs").contains(&format!("\"{base}\""))
    } else {
        // Families with no series yet encode nothing: their registration names tell.
        let rest = base.strip_prefix("stoker_").unwrap_or(base);
        operator.contains(&format!("# TYPE {base} "))
            || source("src/telemetry.rs").contains(&format!("\"{rest}\""))
    }
}

#[test]
fn every_dashboard_panel_reads_a_documented_exported_metric() {
    let docs = documents(&helm_template(&[]).expect("renders"));
    let dashboards: Vec<_> = of_kind(&docs, "ConfigMap")
        .into_iter()
        .filter(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    assert_eq!(
        dashboards.len(),
        1,
        "one ConfigMap with Grafana's sidecar label"
    );
    let json = dashboards[0]["data"]["stoker.json"]
        .as_str()
        .expect("stoker.json");
    let dashboard: serde_json::Value = serde_json::from_str(json).expect("dashboard JSON");
    let documented = documented_metrics();
    assert!(
        documented.contains("stoker_autoscaler_desired_decoders"),
        "{documented:?}"
    );
    let operator = stoker_operator::telemetry::Metrics::default().encode();
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8, "{} panels", panels.len());
    let mut read = std::collections::BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default();
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} has no query");
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            let names: Vec<String> = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|t| t.starts_with("stoker_"))
                .map(str::to_string)
                .collect();
            assert!(
                !names.is_empty(),
                "panel {title}: {expr} reads no stoker metric"
            );
            for name in names {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name);
                assert!(
                    documented.contains(&name) || documented.contains(base),
                    "panel {title}: {name} is not in the README's metrics tables"
                );
                assert!(
                    exported_by_the_code(&name, &operator),
                    "panel {title}: no code exports {name}"
                );
                read.insert(name);
            }
        }
    }
    // The autoscaler's own inputs are on it.
    for name in [
        "stoker_autoscaler_data_wait_percent",
        "stoker_decoders",
        "stoker_loader_samples_out_total",
    ] {
        assert!(read.contains(name), "{name} is on no panel");
    }
}

#[test]
fn pod_monitors_give_the_labels_the_autoscaler_queries_use() {
    let docs = documents(&helm_template(&["--set", "podMonitor.enabled=true"]).expect("renders"));
    let monitors = of_kind(&docs, "PodMonitor");
    assert_eq!(monitors.len(), 3);
    for m in monitors {
        let name = m["metadata"]["name"].as_str().unwrap_or_default();
        let ep = &m["spec"]["podMetricsEndpoints"][0];
        if name.ends_with("-operator") {
            assert_eq!(
                ep["honorLabels"], true,
                "the operator's series keep their pipeline's namespace"
            );
            continue;
        }
        let targets: std::collections::BTreeMap<&str, &str> = ep["relabelings"]
            .as_array()
            .expect("relabelings")
            .iter()
            .map(|r| {
                (
                    r["targetLabel"].as_str().unwrap_or_default(),
                    r["sourceLabels"][0].as_str().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            targets.get("pipeline"),
            Some(&"__meta_kubernetes_pod_label_stoker_dev_pipeline"),
            "{name}"
        );
        assert_eq!(
            targets.get("role"),
            Some(&"__meta_kubernetes_pod_label_stoker_dev_role"),
            "{name}"
        );
        let node = stoker_operator::signal_source::prometheus::QueryTemplates::default().node_label;
        assert_eq!(
            targets.get(node.as_str()),
            Some(&"__meta_kubernetes_pod_node_name"),
            "{name}"
        );
    }
}

/// One row of the RBAC table in docs/security.md: the roles its `where` cell names (a kind and
/// a backticked name each, `<release>` standing for the release's full name) and what it grants.
struct RbacRow {
    roles: Vec<(String, String)>,
    group: String,
    resources: Vec<String>,
    verbs: Vec<String>,
}

impl RbacRow {
    fn grants(&self, role: &(String, String), group: &str, resource: &str, verb: &str) -> bool {
        self.roles.contains(role)
            && self.group == group
            && self.resources.iter().any(|r| r == resource)
            && self.verbs.iter().any(|v| v == verb)
    }
}

/// The first table under "## The operator's RBAC, rule by rule" in docs/security.md; the
/// sidecar's Role, which the operator makes and the chart does not render, is a table below it.
fn documented_rbac_rows() -> Vec<RbacRow> {
    /// A comma-separated cell, backticks stripped.
    fn list(cell: &str) -> Vec<String> {
        cell.split(',')
            .map(|item| item.replace('`', "").trim().to_string())
            .filter(|item| !item.is_empty())
            .collect()
    }
    /// "ClusterRole `<release>`; with watchNamespace, Role `<release>-pipelines`": each
    /// backticked name with the word before it as its kind.
    fn roles(cell: &str) -> Vec<(String, String)> {
        let parts: Vec<&str> = cell.split('`').collect();
        parts
            .chunks(2)
            .filter_map(|pair| {
                let kind = pair.first()?.split_whitespace().last()?;
                let name = pair.get(1)?.trim();
                matches!(kind, "ClusterRole" | "Role").then(|| (kind.to_string(), name.to_string()))
            })
            .collect()
    }
    let page = std::fs::read_to_string(stoker_testenv::manifest_dir().join("docs/security.md"))
        .expect("docs/security.md");
    let section = page
        .split("\n## The operator's RBAC, rule by rule")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a section \"## The operator's RBAC, rule by rule\" in docs/security.md");
    section
        .lines()
        .map(str::trim)
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            // | where | apiGroup | resources | verbs | why |: cell 0 is before the first bar.
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let cell = |i: usize| cells.get(i).copied();
            let group = cell(2)?.replace('`', "");
            let group = group.trim();
            // The header row and the |---| row.
            if group == "apiGroup" || group.chars().all(|c| c == '-' || c == ':') {
                return None;
            }
            Some(RbacRow {
                roles: roles(cell(1)?),
                group: if group == "core" {
                    String::new()
                } else {
                    group.to_string()
                },
                resources: list(cell(3)?),
                verbs: list(cell(4)?),
            })
        })
        .collect()
}

/// Every (apiGroup, resource, verb) a rendered Role or ClusterRole grants, in both modes, has a
/// row naming that role in the security page's table, and every row is one the chart renders:
/// a rule added to rbac.yaml without its row, a verb moved between roles, or a row left behind
/// by a removed rule fails here.
#[test]
fn every_rendered_rbac_rule_is_explained_in_docs_security_md() {
    let rows = documented_rbac_rows();
    assert!(
        rows.len() >= 15 && rows.iter().all(|r| !r.roles.is_empty()),
        "the table parses, and each row's `where` names its Role or ClusterRole"
    );
    // The table spells the release's full name (`stoker` for helm_template's release) `<release>`.
    let as_documented = |name: &str| match name.strip_prefix("stoker") {
        Some(rest) => format!("<release>{rest}"),
        None => name.to_string(),
    };
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let mut missing = Vec::new();
    let mut rendered = std::collections::BTreeSet::new();
    for values in [&[][..], &["--set", "watchNamespace=team-a"][..]] {
        let docs = documents(&helm_template(values).expect("renders"));
        for kind in ["Role", "RoleBinding"] {
            for doc in of_kind(&docs, kind) {
                assert_ne!(
                    doc["metadata"]["namespace"], "kube-system",
                    "{values:?}: {kind} {} is in kube-system",
                    doc["metadata"]["name"]
                );
            }
        }
        let roles = of_kind(&docs, "ClusterRole")
            .into_iter()
            .chain(of_kind(&docs, "Role"));
        for role in roles {
            let kind = role["kind"].as_str().unwrap_or_default().to_string();
            let name = role["metadata"]["name"].as_str().unwrap_or_default();
            let documented_role = (kind.clone(), as_documented(name));
            for rule in role["rules"].as_array().into_iter().flatten() {
                let mut granted = Vec::new();
                for group in strings(&rule["apiGroups"]) {
                    for resource in strings(&rule["resources"]) {
                        for verb in strings(&rule["verbs"]) {
                            granted.push((group.clone(), resource.clone(), verb));
                        }
                    }
                }
                if granted.is_empty() {
                    missing.push(format!(
                        "{kind} {name}: the rule {rule} grants no apiGroup/resource/verb the table can explain"
                    ));
                }
                for (group, resource, verb) in granted {
                    if !rows
                        .iter()
                        .any(|row| row.grants(&documented_role, &group, &resource, &verb))
                    {
                        let shown = if group.is_empty() {
                            "core"
                        } else {
                            group.as_str()
                        };
                        missing.push(format!(
                            "{kind} {name}: {shown}/{resource} {verb} is not explained in docs/security.md"
                        ));
                    }
                    rendered.insert((documented_role.clone(), group, resource, verb));
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    for row in &rows {
        let shown = if row.group.is_empty() {
            "core"
        } else {
            row.group.as_str()
        };
        for role in &row.roles {
            for resource in &row.resources {
                for verb in &row.verbs {
                    let granted = (
                        role.clone(),
                        row.group.clone(),
                        resource.clone(),
                        verb.clone(),
                    );
                    if !rendered.contains(&granted) {
                        missing.push(format!(
                            "docs/security.md gives {} {} {shown}/{resource} {verb}, which the chart renders in neither mode",
                            role.0, role.1
                        ));
                    }
                }
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
