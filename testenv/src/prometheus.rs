//! A real Prometheus server on loopback, scraping what a production Prometheus would.
//!
//! - With [`KubernetesDiscovery`] (the way a cluster runs it): Prometheus built from its Go
//!   module with Kubernetes service discovery (`scripts/tools.sh`, `$STOKER_CACHE/bin`) finds the
//!   pods through the test API server (`kubernetes_sd_configs`, role pod) and relabels them with
//!   the chart's PodMonitors, rendered into scrape jobs as the Prometheus Operator renders them
//!   ([`pod_monitor_scrape_configs`]). Node-exporters are no pods here (the runtime serves their
//!   NIC counters on loopback), so they stay a file_sd job (`nodes.json`).
//!   The story and the demo run so.
//! - Without it: file_sd only ([`crate::runtime::NodeRuntime::sd_dir`]): `loaders.json`, one
//!   target per loader process with the labels the PodMonitors would give it, and `nodes.json`;
//!   or a test's own file (the autoscaler tests scrape an in-process exporter this way). Debian's
//!   `prometheus` (no Kubernetes discovery) serves here when the Go-built one is missing.

use crate::process::Component;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How to start Prometheus.
#[derive(Clone, Debug)]
pub struct PrometheusOptions {
    /// Directory holding `loaders.json` and `nodes.json` (file_sd target groups).
    pub sd_dir: PathBuf,
    /// 1s for tests, 2s for the demo.
    pub scrape_interval: Duration,
    /// The `prometheus` binary; `None`: `$STOKER_PROMETHEUS_BIN`, else the Go-built one in
    /// [`crate::cluster::bin_dir`] (needed for Kubernetes discovery), else `prometheus` on PATH.
    pub binary: Option<PathBuf>,
    /// Discover pods through the API server; `None` reads `loaders.json` instead.
    pub kubernetes: Option<KubernetesDiscovery>,
    /// The address it listens on: loopback, or the runtime's [`host_ip`] for pods to query it.
    ///
    /// [`host_ip`]: crate::runtime::NodeRuntime::host_ip
    pub listen_ip: std::net::Ipv4Addr,
}

/// Pod discovery as on a cluster: `kubernetes_sd_configs` against the test API server, one
/// scrape job per PodMonitor endpoint.
#[derive(Clone, Debug)]
pub struct KubernetesDiscovery {
    /// The kubeconfig Prometheus reads pods with (API server address, CA, client certificate).
    pub kubeconfig: PathBuf,
    /// PodMonitor objects as `helm template` renders them (`kind: PodMonitor`).
    pub pod_monitors: Vec<Value>,
}

impl PrometheusOptions {
    pub fn new(sd_dir: impl Into<PathBuf>) -> Self {
        Self {
            sd_dir: sd_dir.into(),
            scrape_interval: Duration::from_secs(1),
            binary: None,
            kubernetes: None,
            listen_ip: std::net::Ipv4Addr::LOCALHOST,
        }
    }

    /// Discovers pods through the API server with `discovery` (see [`KubernetesDiscovery`]).
    pub fn with_kubernetes(mut self, discovery: KubernetesDiscovery) -> Self {
        self.kubernetes = Some(discovery);
        self
    }
}

pub struct Prometheus {
    addr: SocketAddr,
    component: Mutex<Option<Component>>,
    dir: Mutex<Option<tempfile::TempDir>>,
    log: PathBuf,
}

/// Scrape configuration for the two jobs: `stoker-loaders` and `node-exporter`.
pub fn config_yaml(sd_dir: &Path, interval: Duration) -> String {
    let secs = interval.as_secs().max(1);
    format!(
        "global:\n  scrape_interval: {secs}s\n  scrape_timeout: {secs}s\n  evaluation_interval: {secs}s\n\
         scrape_configs:\n\
         - job_name: stoker-loaders\n  file_sd_configs:\n  - files: ['{loaders}']\n    refresh_interval: {secs}s\n\
         - job_name: node-exporter\n  file_sd_configs:\n  - files: ['{nodes}']\n    refresh_interval: {secs}s\n",
        loaders = sd_dir.join("loaders.json").display(),
        nodes = sd_dir.join("nodes.json").display(),
    )
}

impl KubernetesDiscovery {
    /// The pods of `cluster` as a cluster's Prometheus finds them: through its API server, with
    /// the PodMonitors the Helm chart at `chart` renders (`podMonitor.enabled=true`, and
    /// `podMonitor.interval`), scraped at their pod IPs.
    pub fn from_chart(
        cluster: &crate::cluster::ControlPlane,
        chart: &Path,
        interval: Duration,
    ) -> Result<Self> {
        let out = cluster
            .helm()
            .args(["template", "stoker"])
            .arg(chart)
            .args([
                "--namespace",
                "stoker-system",
                "--set",
                "podMonitor.enabled=true",
                "--set",
                &format!("podMonitor.interval={}s", interval.as_secs().max(1)),
                "--show-only",
                "templates/podmonitor.yaml",
            ])
            .output()
            .context("running helm template")?;
        if !out.status.success() {
            bail!(
                "helm template {}: {}",
                chart.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8(out.stdout)?;
        let pod_monitors = text
            .split("\n---")
            .map(|doc| {
                serde_yaml::from_str::<Value>(doc).context("a PodMonitor from helm template")
            })
            .filter(|doc| !matches!(doc, Ok(Value::Null)))
            .collect::<Result<Vec<Value>>>()?;
        if pod_monitors.is_empty() {
            bail!(
                "helm template rendered no PodMonitor from {}",
                chart.display()
            );
        }
        Ok(KubernetesDiscovery {
            kubeconfig: cluster.kubeconfig_path().to_path_buf(),
            pod_monitors,
        })
    }
}

/// Scrape configuration with Kubernetes discovery: the node-exporter file_sd job and one job
/// per PodMonitor endpoint.
pub fn kubernetes_config_yaml(
    sd_dir: &Path,
    interval: Duration,
    discovery: &KubernetesDiscovery,
) -> Result<String> {
    let secs = format!("{}s", interval.as_secs().max(1));
    let mut jobs = vec![json!({
        "job_name": "node-exporter",
        "file_sd_configs": [{
            "files": [sd_dir.join("nodes.json").display().to_string()],
            "refresh_interval": secs,
        }],
    })];
    for monitor in &discovery.pod_monitors {
        jobs.extend(pod_monitor_scrape_configs(monitor, discovery)?);
    }
    let config = json!({
        "global": {"scrape_interval": secs, "scrape_timeout": secs, "evaluation_interval": secs},
        "scrape_configs": jobs,
    });
    Ok(serde_yaml::to_string(&config)?)
}

/// A PodMonitor's scrape jobs as the Prometheus Operator writes them
/// (`generatePodMonitorConfig` in its `pkg/prometheus/promcfg.go`): keep running pods that match
/// the selector and the endpoint's port name, label `namespace`, `container`, `pod`, `job` and
/// `endpoint`, then the endpoint's own relabelings, then the shard filter (one shard).
/// The endpoint's `interval`, `path`, `scheme` and `honorLabels` carry over; TLS and auth do not
/// (nothing in the chart uses them).
pub fn pod_monitor_scrape_configs(
    monitor: &Value,
    discovery: &KubernetesDiscovery,
) -> Result<Vec<Value>> {
    let name = monitor["metadata"]["name"]
        .as_str()
        .context("PodMonitor without metadata.name")?;
    let namespace = monitor["metadata"]["namespace"]
        .as_str()
        .with_context(|| format!("PodMonitor {name} without metadata.namespace"))?;
    let spec = &monitor["spec"];
    let mut sd = json!({
        "role": "pod",
        "kubeconfig_file": discovery.kubeconfig.display().to_string(),
    });
    let ns_selector = &spec["namespaceSelector"];
    if ns_selector["any"] != json!(true) {
        let names: Vec<Value> = match ns_selector["matchNames"].as_array() {
            Some(names) if !names.is_empty() => names.clone(),
            _ => vec![json!(namespace)],
        };
        sd["namespaces"] = json!({"names": names});
    }
    let endpoints = spec["podMetricsEndpoints"]
        .as_array()
        .with_context(|| format!("PodMonitor {namespace}/{name} has no podMetricsEndpoints"))?;
    let mut jobs = Vec::new();
    for (i, ep) in endpoints.iter().enumerate() {
        let mut job = json!({
            "job_name": format!("podMonitor/{namespace}/{name}/{i}"),
            "honor_labels": ep["honorLabels"].as_bool().unwrap_or(false),
            "kubernetes_sd_configs": [sd.clone()],
        });
        for (from, to) in [
            ("interval", "scrape_interval"),
            ("scrapeTimeout", "scrape_timeout"),
            ("path", "metrics_path"),
            ("scheme", "scheme"),
        ] {
            if let Some(v) = ep[from].as_str() {
                job[to] = json!(v);
            }
        }
        let mut relabel =
            vec![json!({"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"})];
        if ep["filterRunning"] != json!(false) {
            relabel.push(json!({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}));
        }
        relabel.extend(selector_relabelings(&spec["selector"])?);
        let port = ep["port"].as_str();
        if let Some(port) = port {
            relabel.push(json!({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port}));
        }
        relabel.extend([
            json!({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}),
            json!({"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"}),
            json!({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}),
        ]);
        for label in spec["podTargetLabels"].as_array().into_iter().flatten() {
            let label = label.as_str().unwrap_or_default();
            relabel.push(json!({
                "source_labels": [format!("__meta_kubernetes_pod_label_{}", sanitize(label))],
                "target_label": sanitize(label), "regex": "(.+)", "replacement": "${1}",
            }));
        }
        relabel.push(json!({"target_label": "job", "replacement": format!("{namespace}/{name}")}));
        if let Some(label) = spec["jobLabel"].as_str() {
            relabel.push(json!({
                "source_labels": [format!("__meta_kubernetes_pod_label_{}", sanitize(label))],
                "target_label": "job", "regex": "(.+)", "replacement": "${1}",
            }));
        }
        if let Some(port) = port {
            relabel.push(json!({"target_label": "endpoint", "replacement": port}));
        }
        for r in ep["relabelings"].as_array().into_iter().flatten() {
            relabel.push(relabel_config(r).with_context(|| {
                format!("PodMonitor {namespace}/{name} endpoint {i}: relabeling {r}")
            })?);
        }
        relabel.extend([
            json!({"source_labels": ["__address__"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"}),
            json!({"source_labels": ["__tmp_hash"], "regex": "0", "action": "keep"}),
        ]);
        job["relabel_configs"] = Value::Array(relabel);
        jobs.push(job);
    }
    Ok(jobs)
}

/// Prometheus label names from Kubernetes label keys (`stoker.dev/role` → `stoker_dev_role`).
fn sanitize(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The selector as keep and drop rules on the pods' label meta labels.
fn selector_relabelings(selector: &Value) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    if let Some(labels) = selector["matchLabels"].as_object() {
        // Sorted by key, as the operator sorts them.
        let sorted: std::collections::BTreeMap<_, _> = labels.iter().collect();
        for (k, v) in sorted {
            let k = sanitize(k);
            out.push(json!({
                "action": "keep",
                "source_labels": [format!("__meta_kubernetes_pod_label_{k}"), format!("__meta_kubernetes_pod_labelpresent_{k}")],
                "regex": format!("({});true", v.as_str().unwrap_or_default()),
            }));
        }
    }
    for exp in selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let k = sanitize(exp["key"].as_str().unwrap_or_default());
        let values: Vec<&str> = exp["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let label = format!("__meta_kubernetes_pod_label_{k}");
        let present = format!("__meta_kubernetes_pod_labelpresent_{k}");
        let rule = match exp["operator"].as_str() {
            Some("In") => {
                json!({"action": "keep", "source_labels": [label, present], "regex": format!("({});true", values.join("|"))})
            }
            Some("NotIn") => {
                json!({"action": "drop", "source_labels": [label, present], "regex": format!("({});true", values.join("|"))})
            }
            Some("Exists") => {
                json!({"action": "keep", "source_labels": [present], "regex": "true"})
            }
            Some("DoesNotExist") => {
                json!({"action": "drop", "source_labels": [present], "regex": "true"})
            }
            other => bail!("selector operator {other:?} is not In, NotIn, Exists or DoesNotExist"),
        };
        out.push(rule);
    }
    Ok(out)
}

/// A PodMonitor relabeling (camelCase, the CRD's spelling) in Prometheus' spelling.
fn relabel_config(r: &Value) -> Result<Value> {
    let fields = r.as_object().context("not an object")?;
    let mut out = serde_json::Map::new();
    for (k, v) in fields {
        let key = match k.as_str() {
            "sourceLabels" => "source_labels",
            "targetLabel" => "target_label",
            "separator" | "regex" | "modulus" | "replacement" => k.as_str(),
            "action" => {
                let action = v.as_str().context("action is not a string")?.to_lowercase();
                out.insert("action".into(), json!(action));
                continue;
            }
            other => bail!("unknown relabeling field {other}"),
        };
        out.insert(key.into(), v.clone());
    }
    Ok(Value::Object(out))
}

impl Prometheus {
    /// Starts Prometheus on a free loopback port and waits until it is ready.
    pub fn start(options: PrometheusOptions) -> Result<Prometheus> {
        let built = crate::cluster::bin_dir().join("prometheus");
        let binary = options
            .binary
            .clone()
            .or_else(|| {
                std::env::var("STOKER_PROMETHEUS_BIN")
                    .ok()
                    .map(PathBuf::from)
            })
            .or_else(|| built.is_file().then_some(built))
            .unwrap_or_else(|| PathBuf::from("prometheus"));
        let dir = tempfile::Builder::new()
            .prefix("stoker-prometheus-")
            .tempdir()?;
        let config = dir.path().join("prometheus.yml");
        let text = match &options.kubernetes {
            Some(discovery) => {
                kubernetes_config_yaml(&options.sd_dir, options.scrape_interval, discovery)?
            }
            None => config_yaml(&options.sd_dir, options.scrape_interval),
        };
        std::fs::write(&config, text)?;
        let port = crate::net::free_port()?;
        let addr = SocketAddr::from((options.listen_ip, port));
        let component = Component::start(
            "prometheus",
            &binary,
            &[
                format!("--config.file={}", config.display()),
                format!("--storage.tsdb.path={}", dir.path().join("data").display()),
                format!("--web.listen-address={addr}"),
                "--storage.tsdb.retention.time=1d".into(),
                "--web.enable-lifecycle".into(),
                "--log.level=warn".into(),
            ],
            dir.path(),
        )
        .with_context(|| {
            format!(
                "starting {} (built? see scripts/tools.sh; or Debian's, scripts/deps.sh)",
                binary.display()
            )
        })?;
        let log = component.log.clone();
        let prometheus = Prometheus {
            addr,
            component: Mutex::new(Some(component)),
            dir: Mutex::new(Some(dir)),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if crate::http::blocking::get(addr, "/-/ready").is_ok_and(|(status, _)| status == 200) {
                return Ok(prometheus);
            }
            let exited = prometheus
                .component
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                .and_then(|c| c.exited());
            if let Some(status) = exited {
                bail!(
                    "prometheus exited ({status}):\n{}",
                    crate::process::tail(&prometheus.log, 30)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "prometheus not ready after 60s:\n{}",
                    crate::process::tail(&prometheus.log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// One Prometheus per process for `sd_dir`, started on first use, stopped at exit.
    pub fn shared(options: impl FnOnce() -> PrometheusOptions) -> &'static Prometheus {
        static SHARED: OnceLock<Result<Prometheus, String>> = OnceLock::new();
        extern "C" fn stop_shared() {
            if let Some(Ok(p)) = SHARED.get() {
                p.stop();
            }
        }
        let result = SHARED.get_or_init(|| {
            let options = options();
            // Started from a thread of its own like the control plane: the spawner thread holds
            // PDEATHSIG, so this only keeps start-up off the test's runtime.
            let started = std::thread::spawn(move || {
                Prometheus::start(options).map_err(|e| format!("{e:#}"))
            })
            .join()
            .unwrap_or_else(|_| Err("prometheus start-up panicked".into()));
            if started.is_ok() {
                // SAFETY: registers a plain function to run at exit.
                unsafe { libc::atexit(stop_shared) };
            }
            started
        });
        match result {
            Ok(p) => p,
            Err(e) => panic!("prometheus failed to start: {e}"),
        }
    }

    /// `http://<listen_ip>:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        crate::process::tail(&self.log, lines)
    }

    /// An instant query through `/api/v1/query`: the `data.result` array.
    pub async fn query(&self, promql: &str) -> Result<Vec<serde_json::Value>> {
        let query =
            percent_encoding::utf8_percent_encode(promql, percent_encoding::NON_ALPHANUMERIC);
        let path = format!("/api/v1/query?query={query}");
        let (status, body) = crate::http::get(self.addr, &path).await?;
        let json: serde_json::Value =
            serde_json::from_str(&body).with_context(|| format!("prometheus answered: {body}"))?;
        if status != 200 || json["status"] != "success" {
            bail!("query {promql}: HTTP {status}: {body}");
        }
        Ok(json["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Stops the server and removes its data. Idempotent.
    pub fn stop(&self) {
        if let Some(mut c) = self
            .component
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            c.stop(Duration::from_secs(5));
        }
        self.dir.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoders() -> Value {
        serde_yaml::from_str(
            "apiVersion: monitoring.coreos.com/v1\nkind: PodMonitor\n\
             metadata: {name: stoker-decoders, namespace: stoker}\n\
             spec:\n  namespaceSelector: {any: true}\n  selector:\n    matchLabels: {stoker.dev/role: decoder}\n\
             \x20   matchExpressions: [{key: stoker.dev/draining, operator: DoesNotExist}]\n\
             \x20 podMetricsEndpoints:\n  - port: metrics\n    interval: 15s\n    relabelings:\n\
             \x20   - {sourceLabels: [__meta_kubernetes_pod_node_name], targetLabel: node}\n\
             \x20   - {action: LabelDrop, regex: container}\n",
        )
        .expect("PodMonitor YAML")
    }

    fn discovery() -> KubernetesDiscovery {
        KubernetesDiscovery {
            kubeconfig: PathBuf::from("/k/config"),
            pod_monitors: vec![],
        }
    }

    #[test]
    fn a_pod_monitor_renders_as_the_prometheus_operator_renders_it() {
        let jobs = pod_monitor_scrape_configs(&decoders(), &discovery()).expect("renders");
        assert_eq!(jobs.len(), 1);
        let job = &jobs[0];
        assert_eq!(job["job_name"], "podMonitor/stoker/stoker-decoders/0");
        assert_eq!(job["scrape_interval"], "15s");
        assert_eq!(job["honor_labels"], false);
        let sd = &job["kubernetes_sd_configs"][0];
        assert_eq!(sd["role"], "pod");
        assert!(sd.get("namespaces").is_none(), "namespaceSelector any");
        let r = job["relabel_configs"].as_array().expect("relabel_configs");
        let actions: Vec<&str> = r
            .iter()
            .map(|x| x["action"].as_str().unwrap_or("replace"))
            .collect();
        assert_eq!(
            actions,
            [
                "replace",
                "drop",
                "keep",
                "drop",
                "keep",
                "replace",
                "replace",
                "replace",
                "replace",
                "replace",
                "replace",
                "labeldrop",
                "hashmod",
                "keep"
            ]
        );
        assert_eq!(
            r[2]["source_labels"],
            json!([
                "__meta_kubernetes_pod_label_stoker_dev_role",
                "__meta_kubernetes_pod_labelpresent_stoker_dev_role"
            ])
        );
        assert_eq!(r[2]["regex"], "(decoder);true");
        assert_eq!(
            r[3]["source_labels"],
            json!(["__meta_kubernetes_pod_labelpresent_stoker_dev_draining"])
        );
        assert_eq!(r[4]["regex"], "metrics");
        // The endpoint's own relabelings come after the operator's, in Prometheus' spelling.
        assert_eq!(
            r[10],
            json!({"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"})
        );
    }

    #[test]
    fn a_namespaced_pod_monitor_discovers_its_own_namespace() {
        let mut m = decoders();
        m["spec"]
            .as_object_mut()
            .expect("spec")
            .remove("namespaceSelector");
        let jobs = pod_monitor_scrape_configs(&m, &discovery()).expect("renders");
        assert_eq!(
            jobs[0]["kubernetes_sd_configs"][0]["namespaces"],
            json!({"names": ["stoker"]})
        );
    }

    #[test]
    fn an_unknown_relabeling_field_is_named() {
        let mut m = decoders();
        m["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["targetLabels"] = json!("x");
        let err = pod_monitor_scrape_configs(&m, &discovery()).expect_err("refused");
        assert!(
            format!("{err:#}").contains("unknown relabeling field targetLabels"),
            "{err:#}"
        );
    }
}
