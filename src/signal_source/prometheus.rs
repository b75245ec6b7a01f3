//! Reads a pipeline's [`Signals`] from Prometheus. The only I/O of the autoscaler.
//!
//! Every query is a template in [`QueryTemplates`] (the chart exposes them) with these
//! placeholders, substituted as PromQL string or regex literals:
//! - `{namespace}`, `{pipeline}`: the `DataPipeline`; the PodMonitors copy the pods' namespace
//!   and `stoker.dev/pipeline` label into the `namespace` and `pipeline` labels, and
//!   `stoker.dev/role` into `role`;
//! - `{window}`: the rate window, e.g. `60s`;
//! - `{trainer_pods}`, `{nodes}`: regex alternations of the trainer pods and of the nodes
//!   that run the pipeline's pods (node-exporter and dcgm-exporter carry no pipeline label).
//!   The default node queries read every node: new decoders must avoid any node whose NIC is
//!   past the limit, not only the pipeline's; `node=~"{nodes}"` narrows them on big clusters.
//!
//! Queries that return one value per pod are keyed by `pod_label`, per node by `node_label`.
//! `data_wait` returns one value per trainer rank, reduced here to the rank that gates the step.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use prometheus_http_query::Client;
use prometheus_http_query::response::Data;

use crate::autoscale::signals::{
    DecoderSignal, NodeNetwork, SignalScope, Signals, gating_data_wait,
};

/// The PromQL the autoscaler sends. Defaults match the loader's metric names
/// (`loader/src/metrics.rs`, `loader/src/sidecar/metrics.rs`), node-exporter and dcgm-exporter.
/// Deserializes from camelCase YAML or JSON (the chart's values); a field left out keeps its
/// default.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, rename_all = "camelCase")]
pub struct QueryTemplates {
    /// Per trainer rank (the sidecar's `rank` label, per pod): share of wall time it waited for
    /// data, seconds waited per second. [`gating_data_wait`] makes the one signal of them; a
    /// template that returns one series is taken as it is.
    pub data_wait: String,
    /// Samples per second the sidecars delivered to trainers, summed.
    pub consumption: String,
    /// Number of trainer ranks reporting.
    pub trainers_reporting: String,
    /// Mean GPU utilization (percent) of the trainer pods; empty when dcgm-exporter is absent.
    pub gpu_utilization: String,
    /// Per decoder pod: samples decoded and returned per second.
    pub decoder_samples: String,
    /// Per decoder pod: busy share of its decode pool (0..=1).
    pub decoder_busy: String,
    /// Decoded bytes returned per sample (what crosses the trainer node's NIC).
    pub decoded_bytes_per_sample: String,
    /// Encoded bytes read per sample (what local decode would pull instead).
    pub encoded_bytes_per_sample: String,
    /// S3 throttle answers per second, all decoders.
    pub s3_throttles: String,
    /// S3 requests per second, all decoders.
    pub s3_requests: String,
    /// Per node: bytes received per second.
    pub node_receive: String,
    /// Per node: bytes transmitted per second.
    pub node_transmit: String,
    /// Per node: link speed in bytes per second.
    pub node_link_speed: String,
    /// Label that names the pod in per-pod results.
    pub pod_label: String,
    /// Label that names the node in node-exporter results (relabelled from the pod's node).
    pub node_label: String,
}

/// Physical interfaces: loopback, bridges and veths would count traffic twice or not at all.
const NIC_DEVICES: &str = r#"device=~"eth.*|en.*|ib.*|bond.*""#;

impl Default for QueryTemplates {
    fn default() -> Self {
        let sidecar = r#"namespace="{namespace}",pipeline="{pipeline}""#;
        let decoder = r#"namespace="{namespace}",pipeline="{pipeline}",role="decoder""#;
        Self {
            data_wait: format!("rate(stoker_trainer_data_wait_seconds_total{{{sidecar}}}[{{window}}])"),
            consumption: format!("sum(rate(stoker_sidecar_samples_delivered_total{{{sidecar}}}[{{window}}]))"),
            trainers_reporting: format!("count(rate(stoker_trainer_data_wait_seconds_total{{{sidecar}}}[{{window}}]))"),
            gpu_utilization: r#"avg(avg_over_time(DCGM_FI_DEV_GPU_UTIL{namespace="{namespace}",pod=~"{trainer_pods}"}[{window}]))"#.to_string(),
            decoder_samples: format!("sum by (pod) (rate(stoker_loader_samples_out_total{{{decoder}}}[{{window}}]))"),
            decoder_busy: format!(
                "sum by (pod) (rate(stoker_loader_busy_seconds_total{{{decoder}}}[{{window}}])) / sum by (pod) (stoker_loader_pool_threads{{{decoder}}} > 0)"
            ),
            decoded_bytes_per_sample: format!(
                "sum(rate(stoker_loader_bytes_out_total{{{decoder}}}[{{window}}])) / sum(rate(stoker_loader_samples_out_total{{{decoder}}}[{{window}}]))"
            ),
            encoded_bytes_per_sample: format!(
                "sum(rate(stoker_loader_bytes_in_total{{{decoder}}}[{{window}}])) / sum(rate(stoker_loader_samples_out_total{{{decoder}}}[{{window}}]))"
            ),
            s3_throttles: format!("sum(rate(stoker_loader_s3_throttles_total{{{decoder}}}[{{window}}]))"),
            s3_requests: format!("sum(rate(stoker_loader_s3_requests_total{{{decoder}}}[{{window}}]))"),
            node_receive: format!(
                r#"sum by (node) (rate(node_network_receive_bytes_total{{{NIC_DEVICES}}}[{{window}}]))"#
            ),
            node_transmit: format!(
                r#"sum by (node) (rate(node_network_transmit_bytes_total{{{NIC_DEVICES}}}[{{window}}]))"#
            ),
            node_link_speed: format!(r#"sum by (node) (node_network_speed_bytes{{{NIC_DEVICES}}})"#),
            pod_label: "pod".to_string(),
            node_label: "node".to_string(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("Prometheus URL {url}: {source}")]
    Url {
        url: String,
        source: prometheus_http_query::Error,
    },
    #[error("HTTP client for Prometheus: {0}")]
    Client(String),
    #[error("Prometheus unreachable for query {query}: {source}")]
    Unreachable {
        query: &'static str,
        source: prometheus_http_query::Error,
    },
    #[error("Prometheus rejected query {query}: {source}")]
    Rejected {
        query: &'static str,
        source: prometheus_http_query::Error,
    },
    #[error("query {query} returned a {kind}, not an instant vector")]
    UnexpectedResult {
        query: &'static str,
        kind: &'static str,
    },
}

impl SignalError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Url { .. } => "prometheus_url",
            Self::Client(_) => "prometheus_client",
            Self::Unreachable { .. } => "prometheus_unreachable",
            Self::Rejected { .. } => "prometheus_query",
            Self::UnexpectedResult { .. } => "prometheus_result",
        }
    }
}

/// A Prometheus server and the queries to send it.
#[derive(Clone)]
pub struct PrometheusSignals {
    client: Client,
    templates: QueryTemplates,
}

impl std::fmt::Debug for PrometheusSignals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrometheusSignals")
            .field("url", &self.client.base_url().as_str())
            .finish_non_exhaustive()
    }
}

impl PrometheusSignals {
    /// `timeout` bounds each query, so that a hung Prometheus cannot stall reconciles.
    pub fn new(
        url: &str,
        templates: QueryTemplates,
        timeout: Duration,
    ) -> Result<Self, SignalError> {
        let http = http_client(timeout).map_err(|e| SignalError::Client(e.to_string()))?;
        let client = Client::from(http, url).map_err(|source| SignalError::Url {
            url: url.to_string(),
            source,
        })?;
        Ok(Self { client, templates })
    }

    pub fn templates(&self) -> &QueryTemplates {
        &self.templates
    }

    /// Reads all signals of one pipeline. Any failure fails the whole read: a decision on
    /// half the signals could scale the wrong way.
    pub async fn read(&self, scope: &SignalScope) -> Result<Signals, SignalError> {
        let t = &self.templates;
        let q = |name: &'static str, template: &str| self.vector(name, render(template, scope));
        let (
            data_wait,
            consumption,
            trainers,
            gpu,
            samples,
            busy,
            out_bytes,
            in_bytes,
            throttles,
            requests,
        ) = futures::try_join!(
            q("data_wait", &t.data_wait),
            q("consumption", &t.consumption),
            q("trainers_reporting", &t.trainers_reporting),
            q("gpu_utilization", &t.gpu_utilization),
            q("decoder_samples", &t.decoder_samples),
            q("decoder_busy", &t.decoder_busy),
            q("decoded_bytes_per_sample", &t.decoded_bytes_per_sample),
            q("encoded_bytes_per_sample", &t.encoded_bytes_per_sample),
            q("s3_throttles", &t.s3_throttles),
            q("s3_requests", &t.s3_requests),
        )?;
        let (receive, transmit, link) = futures::try_join!(
            q("node_receive", &t.node_receive),
            q("node_transmit", &t.node_transmit),
            q("node_link_speed", &t.node_link_speed),
        )?;

        let mut decoders: BTreeMap<String, DecoderSignal> = BTreeMap::new();
        for (pod, v) in by_label(&samples, &t.pod_label) {
            decoders.entry(pod).or_default().samples_per_second = v;
        }
        for (pod, v) in by_label(&busy, &t.pod_label) {
            decoders.entry(pod).or_default().busy_share = v.clamp(0.0, 1.0);
        }
        let mut nodes: BTreeMap<String, NodeNetwork> = BTreeMap::new();
        for (node, v) in by_label(&receive, &t.node_label) {
            nodes.entry(node).or_default().receive_bytes_per_second = v;
        }
        for (node, v) in by_label(&transmit, &t.node_label) {
            nodes.entry(node).or_default().transmit_bytes_per_second = v;
        }
        for (node, v) in by_label(&link, &t.node_label) {
            if v > 0.0 {
                nodes.entry(node).or_default().link_bytes_per_second = Some(v);
            }
        }
        Ok(Signals {
            data_wait_share: gating_data_wait(data_wait.iter().map(|(_, w)| *w))
                .map(|w| w.clamp(0.0, 1.0)),
            consumption_per_second: scalar(&consumption),
            trainers_reporting: scalar(&trainers).map(|n| n.round().max(0.0) as u32),
            gpu_utilization_percent: scalar(&gpu),
            decoders,
            nodes,
            s3_throttles_per_second: scalar(&throttles),
            s3_requests_per_second: scalar(&requests),
            decoded_bytes_per_sample: scalar(&out_bytes),
            encoded_bytes_per_sample: scalar(&in_bytes),
        })
    }

    async fn vector(
        &self,
        query: &'static str,
        promql: String,
    ) -> Result<Vec<Series>, SignalError> {
        let result = self
            .client
            .query(promql)
            .get()
            .await
            .map_err(|source| match source {
                prometheus_http_query::Error::Prometheus(_) => {
                    SignalError::Rejected { query, source }
                }
                _ => SignalError::Unreachable { query, source },
            })?;
        match result.into_inner().0 {
            Data::Vector(v) => Ok(v
                .into_iter()
                .map(|iv| {
                    let (labels, sample) = iv.into_inner();
                    (labels, sample.value())
                })
                .collect()),
            Data::Scalar(s) => Ok(vec![(HashMap::new(), s.value())]),
            Data::Matrix(_) => Err(SignalError::UnexpectedResult {
                query,
                kind: "range vector",
            }),
        }
    }
}

type Series = (HashMap<String, String>, f64);

/// The value of a one-series result; absent (and NaN, from 0/0) is `None`.
fn scalar(series: &[Series]) -> Option<f64> {
    series.iter().map(|(_, v)| *v).find(|v| v.is_finite())
}

fn by_label<'a>(series: &'a [Series], label: &'a str) -> impl Iterator<Item = (String, f64)> + 'a {
    series
        .iter()
        .filter(|(_, v)| v.is_finite())
        .filter_map(move |(labels, v)| labels.get(label).map(|l| (l.clone(), *v)))
}

/// An HTTP client whose every request gives up after `timeout`.
pub fn http_client(timeout: Duration) -> reqwest::Result<reqwest::Client> {
    // reqwest is built without its own crypto provider; the operator uses ring. Installing
    // fails harmlessly when a provider is already in place.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().timeout(timeout).build()
}

/// Fills a template's placeholders.
pub fn render(template: &str, scope: &SignalScope) -> String {
    template
        .replace("{namespace}", &escape(&scope.namespace))
        .replace("{pipeline}", &escape(&scope.pipeline))
        .replace("{window}", &format!("{}s", scope.window.as_secs().max(1)))
        .replace("{trainer_pods}", &alternation(&scope.trainer_pods))
        .replace("{nodes}", &alternation(&scope.nodes))
}

/// Escapes a value for a double-quoted PromQL string.
fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', r#"\""#)
}

/// `a|b|c` for a `=~` matcher, each name taken literally; matches nothing when empty.
fn alternation(names: &[String]) -> String {
    if names.is_empty() {
        // An empty regex would match series without the label; this matches no name.
        return "$^".to_string();
    }
    let quoted: Vec<String> = names.iter().map(|n| escape(&regex_literal(n))).collect();
    quoted.join("|")
}

fn regex_literal(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if r"\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> SignalScope {
        SignalScope {
            namespace: "training".into(),
            pipeline: "qwen3vl".into(),
            trainer_pods: vec!["trainer-0".into(), "trainer-1".into()],
            nodes: vec!["gpu-1.example".into(), "cpu-2".into()],
            window: Duration::from_secs(90),
        }
    }

    #[test]
    fn templates_render_the_pipeline_window_and_names() {
        let t = QueryTemplates::default();
        assert_eq!(
            render(&t.data_wait, &scope()),
            r#"rate(stoker_trainer_data_wait_seconds_total{namespace="training",pipeline="qwen3vl"}[90s])"#
        );
        assert_eq!(
            render(&t.node_receive, &scope()),
            r#"sum by (node) (rate(node_network_receive_bytes_total{device=~"eth.*|en.*|ib.*|bond.*"}[90s]))"#
        );
        assert_eq!(
            render(r#"up{node=~"{nodes}"}"#, &scope()),
            r#"up{node=~"gpu-1\\.example|cpu-2"}"#
        );
        assert!(render(&t.gpu_utilization, &scope()).contains(r#"pod=~"trainer-0|trainer-1""#));
    }

    #[test]
    fn templates_load_from_chart_values_over_the_defaults() {
        let t: QueryTemplates = serde_yaml::from_str(
            "gpuUtilization: avg(DCGM_FI_DEV_GPU_UTIL{exported_pod=~\"{trainer_pods}\"})\nnodeLabel: instance\n",
        )
        .expect("parses");
        assert_eq!(t.node_label, "instance");
        assert!(
            t.gpu_utilization
                .starts_with("avg(DCGM_FI_DEV_GPU_UTIL{exported_pod")
        );
        assert_eq!(t.data_wait, QueryTemplates::default().data_wait);
    }

    #[test]
    fn an_empty_name_list_matches_nothing() {
        let mut s = scope();
        s.trainer_pods.clear();
        assert!(render(&QueryTemplates::default().gpu_utilization, &s).contains(r#"pod=~"$^""#));
    }

    #[test]
    fn values_cannot_break_out_of_the_string() {
        let mut s = scope();
        s.pipeline = r#"a"}or vector(1)"#.into();
        assert!(render("{pipeline}", &s).starts_with(r#"a\""#));
    }
}
