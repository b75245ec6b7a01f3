//! The whole story on one machine, as a library so that the demo command and its end-to-end test
//! run the same code:
//!
//! (a) a trainer pod on a GPU node loads its own batches synchronously: the GPU mostly waits;
//! (a') optionally, the same trainer on a PyTorch DataLoader with worker processes on its node;
//! (b) a `DataPipeline` with autoscaling starts one decoder, on one CPU node whose NIC saturates;
//! (c) the autoscaler scales the decoders in one step and spreads them over more nodes until
//!     the trainer is fed.
//!
//! Every part is real: the control plane and its scheduler, the operator (in this process) with
//! its webhook and autoscaler, Prometheus, the S3 server, and the pods: `stoker-loader` decode
//! workers and sidecars from stoker's image and the trainer as its non-root user, each in runc
//! with its securityContext and CPU and memory limits, inside per-node network namespaces whose
//! NICs `tc` limits.

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stoker_operator::api::DataPipeline;
use stoker_operator::autoscale::AutoscalingPolicy;
use stoker_operator::build::BuildDefaults;
use stoker_operator::build::sidecar::SIDECAR_NAME;
use stoker_operator::signal_source::AutoscalerSettings;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::webhook::tls::{SelfManaged, TlsSource};
use stoker_operator::{CancellationToken, Config};
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_namespace_labels,
    restricted_pod_security,
};
use stoker_testenv::prometheus::{KubernetesDiscovery, Prometheus, PrometheusOptions};
use stoker_testenv::runtime::{ImageConfig, ImageMapping, ImageSource, NodeRuntime};
use stoker_testenv::s3::S3Server;

pub const NAMESPACE: &str = "training";
pub const PIPELINE: &str = "demo";
/// The image the node runtime maps to the loader binary.
pub const LOADER_IMAGE: &str = "ghcr.io/stoker-dev/stoker-loader:0.1.0";
/// The image the node runtime maps to `demo/trainer.py` ([`trainer_image`]).
pub const TRAINER_IMAGE: &str = "ghcr.io/stoker-dev/stoker-sim-trainer:0.1.0";
/// The same trainer with torch (the DataLoader phase), from a venv that has it.
pub const TORCH_TRAINER_IMAGE: &str = "ghcr.io/stoker-dev/stoker-sim-trainer-torch:0.1.0";
/// The trainer's user: not root, and not the sidecar's 65532 (the ring is shared through a
/// group the webhook adds, as on a cluster).
pub const TRAINER_UID: i64 = 1000;

/// The injected sidecar's CPU request and limit in millicores: the chart's default (values.yaml
/// `loader.sidecar.cpu`).
pub const SIDECAR_CPU_MILLIS: u32 = 1000;

/// The simulated trainer's image `image`: `python trainer.py` in runc as [`TRAINER_UID`], from
/// a test image of this machine's system directories plus, read-only, the venv of `python`, the
/// Python installation it links to and the trainer's directory; `out` (the reports and keys the
/// story reads) is bound writable and handed to the trainer's user.
pub fn trainer_image(
    image: &str,
    python: &Path,
    trainer: &Path,
    out: &Path,
) -> Result<ImageMapping> {
    let prefixes = std::process::Command::new(python)
        .args([
            "-c",
            "import sys; print(sys.prefix); print(sys.base_prefix)",
        ])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !prefixes.status.success() {
        bail!("{} -c 'import sys' failed", python.display());
    }
    let mut binds: Vec<PathBuf> = String::from_utf8_lossy(&prefixes.stdout)
        .lines()
        .map(PathBuf::from)
        // /usr is in every host-rootfs image already.
        .filter(|p| !p.starts_with("/usr"))
        .collect();
    let dir = trainer.parent().context("the trainer script's directory")?;
    binds.push(dir.to_path_buf());
    binds.dedup();
    std::fs::create_dir_all(out)?;
    let uid = TRAINER_UID as u32;
    std::os::unix::fs::chown(out, Some(uid), Some(uid))
        .with_context(|| format!("chown {} to the trainer's user", out.display()))?;
    Ok(ImageMapping::container(
        image,
        ImageSource::HostRootfs {
            binds,
            writable: vec![out.to_path_buf()],
            config: ImageConfig {
                entrypoint: vec![python.display().to_string(), trainer.display().to_string()],
                ..ImageConfig::default()
            },
        },
    ))
}

/// Prometheus' scrape interval here (the autoscaler's rates are over 12 s).
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(2);

/// Prometheus as a cluster runs it: it finds the pods through the API server with the
/// PodMonitors of the Helm chart at `chart` (so the autoscaler's `pipeline`, `role` and `node`
/// labels come from the chart's relabelings), and the nodes' NIC counters from the runtime's
/// node-exporter file. It listens on the runtime's host address, where an operator running as
/// a pod reaches it too. Blocking.
pub fn start_prometheus(
    cluster: &ControlPlane,
    runtime: &NodeRuntime,
    chart: &Path,
) -> Result<Prometheus> {
    let pods = KubernetesDiscovery::from_chart(cluster, chart, SCRAPE_INTERVAL)?;
    Prometheus::start(
        PrometheusOptions {
            scrape_interval: SCRAPE_INTERVAL,
            listen_ip: runtime.host_ip(),
            ..PrometheusOptions::new(runtime.sd_dir())
        }
        .with_kubernetes(pods),
    )
}

/// CPU nodes' NICs in Mbit/s: 25 Gb/s scaled so that one decoder node cannot carry what the
/// trainer consumes (~190 images/s at ~280 KB each, ~45/s fit) while eight together can.
pub const CPU_NIC_MBIT: u32 = 100;
/// GPU nodes' NICs: never the bottleneck in the story.
pub const GPU_NIC_MBIT: u32 = 2000;

/// Each node's NIC in Mbit/s: `gpu` for nodes with GPUs, `cpu` for the others.
pub fn nic_mbit(cluster: &ControlPlane, cpu: u32, gpu: u32) -> BTreeMap<String, u32> {
    cluster
        .nodes()
        .iter()
        .map(|node| (node.name.clone(), if node.gpus > 0 { gpu } else { cpu }))
        .collect()
}

/// The story's knobs. The defaults fit a 2-core machine: demand that one throttled NIC cannot
/// carry, but that a few decoders spread over CPU nodes can.
#[derive(Clone, Debug)]
pub struct StoryOptions {
    pub bucket: String,
    /// Phase (a): how long the synchronous baseline runs; zero skips it (and phase (a')).
    pub baseline: Duration,
    /// Phases (b)+(c): the longest the autoscaler gets to feed the trainer.
    pub recover_timeout: Duration,
    /// The story ends once GPU busy stayed at or above `fed_busy_pct` this long.
    pub settle: Duration,
    pub fed_busy_pct: f64,
    /// Simulated GPU time per batch.
    pub step_ms: u32,
    pub batch_size: u32,
    pub image_size: u32,
    pub max_decoders: u32,
    /// Epochs the trainer runs in phase (b); 0 until the story ends.
    pub epochs: u32,
    /// Kill one decoder pod this long into phase (b), or later once two serve.
    pub kill_decoder_after: Option<Duration>,
    /// Reports, delivered-key logs.
    pub work_dir: PathBuf,
    /// The injected sidecar's CPU request and limit, in millicores.
    pub sidecar_cpu_millis: u32,
    /// Run a PyTorch DataLoader phase after the baseline, as long, with this many workers
    /// (the runtime must map [`TORCH_TRAINER_IMAGE`]).
    pub dataloader_workers: Option<u32>,
    /// Where the operator runs.
    pub operator: Operator,
}

/// Where the story's operator runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Operator {
    /// In this process: the story installs the CRD and serves the webhook on loopback.
    #[default]
    InProcess,
    /// Already installed in the cluster (`helm install`): its CRD, webhook, controller and
    /// autoscaler are the installation's; the story only uses them.
    Installed,
}

impl Default for StoryOptions {
    fn default() -> Self {
        Self {
            bucket: "demo".into(),
            baseline: Duration::from_secs(20),
            recover_timeout: Duration::from_secs(240),
            settle: Duration::from_secs(20),
            fed_busy_pct: 85.0,
            step_ms: 85,
            batch_size: 16,
            image_size: 224,
            max_decoders: 8,
            epochs: 0,
            kill_decoder_after: None,
            work_dir: std::env::temp_dir().join("stoker-demo"),
            sidecar_cpu_millis: SIDECAR_CPU_MILLIS,
            dataloader_workers: None,
            operator: Operator::InProcess,
        }
    }
}

/// One line of the timeline.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Tick {
    pub t: f64,
    pub phase: &'static str,
    pub busy_pct: f64,
    pub wait_pct: f64,
    pub decoders: usize,
    pub nodes: usize,
    pub busiest_nic_pct: f64,
    pub busiest_nic_node: String,
    /// CPUs the trainer pod's loader sidecar used since the last tick (its cgroup's usage over
    /// wall time; 0 in the baseline, which has no sidecar).
    pub sidecar_cpus: f64,
}

/// One autoscaler decision, as `status.lastScale` recorded it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Decision {
    pub t: f64,
    pub from: i32,
    pub to: i32,
    pub reason: String,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct StoryReport {
    pub ticks: Vec<Tick>,
    pub decisions: Vec<Decision>,
    /// Mean GPU busy % over the baseline phase, when it ran.
    pub baseline_busy_pct: Option<f64>,
    /// Mean GPU busy % over the DataLoader phase, when it ran.
    pub dataloader_busy_pct: Option<f64>,
    /// Mean GPU busy % over the last `settle` seconds of the story.
    pub final_busy_pct: f64,
    /// Seconds from the pipeline's creation until busy first held at the target for `settle`.
    pub recovered_after_s: Option<f64>,
    /// Nodes the serving decoders ran on at the end.
    pub decoder_nodes: BTreeSet<String>,
    /// Each CPU node's NIC utilization % over the last `settle` seconds.
    pub final_nic_pct: BTreeMap<String, f64>,
    /// `<epoch> <key>` per delivered sample, `<epoch> <key> skip:<reason>` per skip.
    pub keys_file: PathBuf,
    pub killed_decoder: Option<String>,
    /// The most CPUs the sidecar used over one tick, and its CPU limit.
    pub sidecar_cpus_peak: f64,
    pub sidecar_cpu_limit: f64,
}

/// What the story runs against; the caller owns their lifetimes.
pub struct Stage<'a> {
    pub cluster: &'a ControlPlane,
    pub runtime: &'a NodeRuntime,
    pub prometheus: &'a Prometheus,
    pub s3: &'a S3Server,
}

/// Runs (a), (a') when asked, (b) and (c), calling `on_tick` every two seconds and
/// `on_decision` for each new autoscaler decision. Leaves the cluster as it found it (namespace
/// and operator gone).
pub async fn run(
    stage: &Stage<'_>,
    opts: &StoryOptions,
    mut on_tick: impl FnMut(&Tick),
    mut on_decision: impl FnMut(&Decision),
) -> Result<StoryReport> {
    with_operator(stage, opts, async |client| {
        story(client, stage, opts, &mut on_tick, &mut on_decision).await
    })
    .await
}

/// `body` with the CRD, the training namespace and the operator in place; removes the
/// namespace and stops the operator afterwards, whatever `body` returned.
async fn with_operator<T>(
    stage: &Stage<'_>,
    opts: &StoryOptions,
    body: impl AsyncFnOnce(&Client) -> Result<T>,
) -> Result<T> {
    std::fs::create_dir_all(&opts.work_dir)?;
    let client = stage.cluster.client().await?;
    if opts.operator == Operator::InProcess {
        install_crd(&client).await?;
    }
    wait_until_served::<DataPipeline>(&client).await?;
    create_namespace(&client, stage.s3).await?;
    let operator = match opts.operator {
        Operator::InProcess => Some(start_operator(&client, stage, opts).await?),
        Operator::Installed => None,
    };
    let result = body(&client).await;
    if let Some(operator) = operator {
        operator.cancel();
    }
    let _ = Api::<Namespace>::all(client.clone())
        .delete(NAMESPACE, &DeleteParams::background())
        .await;
    result
}

/// What [`local_decode`] measured.
#[derive(Clone, Debug)]
pub struct LocalDecodeReport {
    /// `<epoch> <key>` per delivered sample.
    pub keys_file: PathBuf,
    /// CPU time the sidecar used while it was measured, over that wall time.
    pub sidecar_cpu: Duration,
    pub wall: Duration,
}

impl LocalDecodeReport {
    pub fn sidecar_cpus(&self) -> f64 {
        self.sidecar_cpu.as_secs_f64() / self.wall.as_secs_f64().max(0.001)
    }
}

/// The sidecar on its own: a DataPipeline with no decoders, so the trainer's sidecar decodes
/// every batch itself for `opts.epochs` epochs while the trainer takes them as fast as they
/// come (`opts.step_ms` per batch). Its CPU time is sampled from its cgroup every half second.
pub async fn local_decode(stage: &Stage<'_>, opts: &StoryOptions) -> Result<LocalDecodeReport> {
    with_operator(stage, opts, async |client| {
        measure_local_decode(client, stage, opts).await
    })
    .await
}

async fn measure_local_decode(
    client: &Client,
    stage: &Stage<'_>,
    opts: &StoryOptions,
) -> Result<LocalDecodeReport> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let dps: Api<DataPipeline> = Api::namespaced(client.clone(), NAMESPACE);
    let mut dp = serde_json::to_value(pipeline(opts, stage))?;
    dp["spec"]["decoders"]["minReplicas"] = 0.into();
    dp["spec"]["autoscaling"] = json!({"mode": "fixed", "replicas": 0});
    dps.create(&PostParams::default(), &serde_json::from_value(dp)?)
        .await
        .context("create the DataPipeline")?;
    let keys_file = opts.work_dir.join("local-keys.txt");
    let report = opts.work_dir.join("local.jsonl");
    let uid = start_fed_trainer(&pods, opts, stage, &report, &keys_file).await?;
    let deadline = Instant::now() + opts.recover_timeout;
    // (time, CPU) at the first and the latest reading of the running sidecar.
    let mut first: Option<(Instant, Duration)> = None;
    let mut last = None;
    while !trainer_finished(&pods).await? {
        if Instant::now() > deadline {
            bail!("the trainer did not finish {} epochs in time", opts.epochs);
        }
        if let Some(cpu) = stage.runtime.container_cpu(&uid, SIDECAR_NAME) {
            let now = (Instant::now(), cpu);
            first.get_or_insert(now);
            last = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (Some(first), Some(last)) = (first, last) else {
        bail!("the sidecar's CPU time was never read (is it running in runc?)");
    };
    pods.delete("trainer-0", &DeleteParams::default().grace_period(0))
        .await
        .ok();
    dps.delete(PIPELINE, &DeleteParams::background()).await.ok();
    Ok(LocalDecodeReport {
        keys_file,
        sidecar_cpu: last.1.saturating_sub(first.1),
        wall: last.0 - first.0,
    })
}

/// Creates `trainer-0`, fed by the pipeline's injected sidecar, writing `report` and `keys`
/// afresh; returns the pod's uid.
async fn start_fed_trainer(
    pods: &Api<Pod>,
    opts: &StoryOptions,
    stage: &Stage<'_>,
    report: &Path,
    keys: &Path,
) -> Result<String> {
    let _ = std::fs::remove_file(report);
    let _ = std::fs::remove_file(keys);
    let trainer = trainer_pod("trainer-0", Feed::Sidecar { keys }, opts, report, stage);
    create_when_webhook_ready(pods, &trainer).await?;
    Ok(pods.get("trainer-0").await?.uid().unwrap_or_default())
}

async fn story(
    client: &Client,
    stage: &Stage<'_>,
    opts: &StoryOptions,
    on_tick: &mut impl FnMut(&Tick),
    on_decision: &mut impl FnMut(&Decision),
) -> Result<StoryReport> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let dps: Api<DataPipeline> = Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    let mut watch = Watch::new(stage.runtime, opts)?;

    let (baseline_busy_pct, dataloader_busy_pct) = if opts.baseline.is_zero() {
        (None, None)
    } else {
        baselines(&pods, stage, opts, &mut watch, started, on_tick).await?
    };

    // (b) The pipeline, autoscaled, from one decoder.
    dps.create(&PostParams::default(), &pipeline(opts, stage))
        .await
        .context("create the DataPipeline")?;
    let pipeline_created = Instant::now();
    let report_b = opts.work_dir.join("pipeline.jsonl");
    let keys_file = opts.work_dir.join("keys.txt");
    let uid = start_fed_trainer(&pods, opts, stage, &report_b, &keys_file).await?;
    watch.sidecar = Some((uid, None));

    let mut decisions: Vec<Decision> = Vec::new();
    let mut last_scale_time = None;
    let mut fed_since: Option<Instant> = None;
    let mut recovered_after_s = None;
    let mut killed_decoder = None;
    let deadline = pipeline_created + opts.recover_timeout;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let decoders = serving_decoders(&pods).await?;
        let tick = watch
            .tick(started, "pipeline", &report_b, &decoders)
            .await?;
        on_tick(&tick);

        if let Some(record) = dps
            .get_status(PIPELINE)
            .await?
            .status
            .and_then(|s| s.last_scale)
            && last_scale_time.as_ref() != Some(&record.time)
        {
            last_scale_time = Some(record.time.clone());
            let decision = Decision {
                t: started.elapsed().as_secs_f64(),
                from: record.from,
                to: record.to,
                reason: record.reason,
            };
            on_decision(&decision);
            decisions.push(decision);
        }

        // The victim is one of several, so its batches are re-sent to the others.
        if let Some(after) = opts.kill_decoder_after
            && killed_decoder.is_none()
            && pipeline_created.elapsed() >= after
            && decoders.len() >= 2
            && let Some(victim) = decoders.first()
        {
            let name = victim.name_any();
            pods.delete(&name, &DeleteParams::default().grace_period(0))
                .await?;
            killed_decoder = Some(name);
        }

        let trainer_done = trainer_finished(&pods).await?;
        if tick.busy_pct >= opts.fed_busy_pct {
            let since = *fed_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= opts.settle && recovered_after_s.is_none() {
                recovered_after_s = Some((since - pipeline_created).as_secs_f64());
            }
        } else if !trainer_done {
            fed_since = None;
        }
        let settled = recovered_after_s.is_some() && opts.epochs == 0;
        if settled || trainer_done || Instant::now() > deadline {
            break;
        }
    }

    let settle_ticks = (opts.settle.as_secs() / 2).max(1) as usize;
    // Ticks after the trainer finished (or before its first report) carry no report lines.
    let recent: Vec<&Tick> = watch
        .ticks
        .iter()
        .rev()
        .filter(|t| t.phase == "pipeline" && t.busy_pct + t.wait_pct > 0.0)
        .take(settle_ticks)
        .collect();
    let final_busy_pct = mean(recent.iter().map(|t| t.busy_pct));
    let decoder_nodes = serving_decoders(&pods)
        .await?
        .iter()
        .filter_map(node_of)
        .collect();
    let final_nic_pct = watch.mean_nic_pct(settle_ticks);
    pods.delete("trainer-0", &DeleteParams::default().grace_period(0))
        .await
        .ok();
    dps.delete(PIPELINE, &DeleteParams::background()).await.ok();
    let sidecar_cpus_peak = watch
        .ticks
        .iter()
        .map(|t| t.sidecar_cpus)
        .fold(0.0, f64::max);
    Ok(StoryReport {
        ticks: watch.ticks,
        decisions,
        baseline_busy_pct,
        dataloader_busy_pct,
        final_busy_pct,
        recovered_after_s,
        decoder_nodes,
        final_nic_pct,
        keys_file,
        killed_decoder,
        sidecar_cpus_peak,
        sidecar_cpu_limit: f64::from(opts.sidecar_cpu_millis) / 1000.0,
    })
}

/// (a) The baseline: the trainer fetches and decodes its own batches; then (a') when asked,
/// what most trainers try next: a DataLoader with worker processes on the GPU node. Returns
/// their mean GPU busy %.
async fn baselines(
    pods: &Api<Pod>,
    stage: &Stage<'_>,
    opts: &StoryOptions,
    watch: &mut Watch<'_>,
    started: Instant,
    on_tick: &mut impl FnMut(&Tick),
) -> Result<(Option<f64>, Option<f64>)> {
    let report_a = opts.work_dir.join("baseline.jsonl");
    let _ = std::fs::remove_file(&report_a);
    pods.create(
        &PostParams::default(),
        &trainer_pod("trainer-sync", Feed::Sync, opts, &report_a, stage),
    )
    .await
    .context("create the baseline trainer")?;
    let phase_end = Instant::now() + opts.baseline;
    while Instant::now() < phase_end {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let tick = watch.tick(started, "baseline", &report_a, &[]).await?;
        on_tick(&tick);
    }
    pods.delete("trainer-sync", &DeleteParams::default().grace_period(0))
        .await?;
    let baseline_busy_pct = watch.mean_busy_pct("baseline");

    // (a') What most trainers try next: a DataLoader with worker processes on the GPU node.
    let mut dataloader_busy_pct = None;
    if let Some(workers) = opts.dataloader_workers {
        let report = opts.work_dir.join("dataloader.jsonl");
        let _ = std::fs::remove_file(&report);
        let pod = trainer_pod(
            "trainer-dataloader",
            Feed::DataLoader(workers),
            opts,
            &report,
            stage,
        );
        pods.create(&PostParams::default(), &pod)
            .await
            .context("create the DataLoader trainer")?;
        let phase_end = Instant::now() + opts.baseline;
        while Instant::now() < phase_end {
            tokio::time::sleep(Duration::from_secs(2)).await;
            on_tick(&watch.tick(started, "dataloader", &report, &[]).await?);
        }
        pods.delete(
            "trainer-dataloader",
            &DeleteParams::default().grace_period(0),
        )
        .await?;
        dataloader_busy_pct = Some(watch.mean_busy_pct("dataloader"));
    }
    Ok((Some(baseline_busy_pct), dataloader_busy_pct))
}

/// Samples the trainer's report, every node's NIC counters and the sidecar's CPU time.
struct Watch<'a> {
    runtime: &'a NodeRuntime,
    nics: BTreeMap<String, (u32, (u64, u64))>,
    last: Instant,
    ticks: Vec<Tick>,
    /// Per tick, each CPU node's NIC utilization %.
    nic_history: Vec<BTreeMap<String, f64>>,
    report_lines_seen: usize,
    /// The trainer pod's uid and its sidecar's CPU time at the last tick.
    sidecar: Option<(String, Option<Duration>)>,
}

impl<'a> Watch<'a> {
    fn new(runtime: &'a NodeRuntime, _opts: &StoryOptions) -> Result<Self> {
        let mut nics = BTreeMap::new();
        for node in runtime.node_names() {
            nics.insert(
                node.clone(),
                (runtime.nic_mbit(&node)?, runtime.nic_counters(&node)?),
            );
        }
        Ok(Self {
            runtime,
            nics,
            last: Instant::now(),
            ticks: Vec::new(),
            nic_history: Vec::new(),
            report_lines_seen: 0,
            sidecar: None,
        })
    }

    async fn tick(
        &mut self,
        started: Instant,
        phase: &'static str,
        report: &std::path::Path,
        decoders: &[Pod],
    ) -> Result<Tick> {
        let wall = self.last.elapsed().as_secs_f64().max(0.001);
        self.last = Instant::now();
        let mut busiest = (String::new(), 0.0);
        let mut utilization = BTreeMap::new();
        for (node, (mbit, counters)) in self.nics.iter_mut() {
            let now = self.runtime.nic_counters(node)?;
            let bytes = (now.0 - counters.0).max(now.1 - counters.1) as f64;
            *counters = now;
            let pct = 100.0 * bytes * 8.0 / (f64::from(*mbit) * 1e6 * wall);
            if node.starts_with("cpu-") {
                utilization.insert(node.clone(), pct);
            }
            if pct > busiest.1 {
                busiest = (node.clone(), pct);
            }
        }
        self.nic_history.push(utilization);
        // The trainer appends one line a second; average the lines since the last tick.
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(report)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        if lines.len() < self.report_lines_seen {
            self.report_lines_seen = 0;
        }
        let fresh = &lines[self.report_lines_seen.min(lines.len())..];
        self.report_lines_seen = lines.len();
        let field = |name: &str| mean(fresh.iter().filter_map(|l| l[name].as_f64()));
        let nodes: BTreeSet<String> = decoders.iter().filter_map(node_of).collect();
        let mut sidecar_cpus = 0.0;
        if let Some((uid, last)) = &mut self.sidecar {
            let now = self.runtime.container_cpu(uid, SIDECAR_NAME);
            if let (Some(now), Some(last)) = (now, *last) {
                sidecar_cpus = now.saturating_sub(last).as_secs_f64() / wall;
            }
            *last = now;
        }
        let tick = Tick {
            t: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            phase,
            busy_pct: field("busy_pct"),
            wait_pct: field("wait_pct"),
            decoders: decoders.len(),
            nodes: nodes.len(),
            busiest_nic_pct: busiest.1,
            busiest_nic_node: busiest.0,
            sidecar_cpus,
        };
        self.ticks.push(tick.clone());
        Ok(tick)
    }

    /// Mean GPU busy % over the ticks of `phase` that carried a trainer report.
    fn mean_busy_pct(&self, phase: &str) -> f64 {
        mean(
            self.ticks
                .iter()
                .filter(|t| t.phase == phase && t.busy_pct + t.wait_pct > 0.0)
                .map(|t| t.busy_pct),
        )
    }

    fn mean_nic_pct(&self, last_ticks: usize) -> BTreeMap<String, f64> {
        let recent = &self.nic_history[self.nic_history.len().saturating_sub(last_ticks)..];
        let mut out = BTreeMap::new();
        for node in recent
            .iter()
            .flat_map(|m| m.keys())
            .collect::<BTreeSet<_>>()
        {
            out.insert(
                node.clone(),
                mean(recent.iter().filter_map(|m| m.get(node).copied())),
            );
        }
        out
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.node_name.clone()
}

/// Decoder pods that serve: Ready and not draining.
async fn serving_decoders(pods: &Api<Pod>) -> Result<Vec<Pod>> {
    let selector = format!("stoker.dev/pipeline={PIPELINE},stoker.dev/role=decoder");
    Ok(pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| !stoker_operator::controller::fleet::is_draining(p))
        .filter(stoker_operator::controller::fleet::is_ready)
        .collect())
}

async fn trainer_finished(pods: &Api<Pod>) -> Result<bool> {
    let phase = pods
        .get_opt("trainer-0")
        .await?
        .and_then(|p| p.status?.phase);
    Ok(matches!(
        phase.as_deref(),
        Some("Succeeded") | Some("Failed")
    ))
}

async fn install_crd(client: &Client) -> Result<()> {
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let crd = DataPipeline::crd();
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply("stoker-demo").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    Ok(())
}

/// Waits until the API server serves the kind (a CRD is served a moment after it is created).
async fn wait_until_served<K>(client: &Client) -> Result<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let api: Api<K> = Api::all(client.clone());
    for _ in 0..150 {
        if api.list(&ListParams::default().limit(1)).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{} is not served after 30s", K::kind(&()))
}

async fn create_namespace(client: &Client, s3: &S3Server) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    // Restricted, as a cluster's training namespaces are: the API server admits only hardened
    // pods (the decoders, the trainer with its injected sidecar).
    let ns: Namespace = serde_json::from_value(json!({"metadata": {
        "name": NAMESPACE,
        "labels": restricted_namespace_labels(),
    }}))?;
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .context("create namespace")?;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "s3-creds"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key(), "AWS_SECRET_ACCESS_KEY": s3.secret_key()},
    }))?;
    Api::<Secret>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &secret)
        .await?;
    // Pods are refused until the namespace's default service account exists.
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), NAMESPACE);
    for _ in 0..150 {
        if accounts.get_opt("default").await?.is_some() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("namespace {NAMESPACE} got no default service account")
}

/// The operator, in this process: controller, webhook (self-managed TLS on loopback) and the
/// autoscaler reading the real Prometheus.
async fn start_operator(
    client: &Client,
    stage: &Stage<'_>,
    opts: &StoryOptions,
) -> Result<CancellationToken> {
    let mwc_name = "stoker-demo-injector";
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let _ = mwcs.delete(mwc_name, &DeleteParams::default()).await;
    mwcs.create(
        &PostParams::default(),
        &stoker_operator::webhook::url_configuration(mwc_name, NAMESPACE, "https://127.0.0.1:1"),
    )
    .await?;
    let webhook = WebhookConfig {
        listen: "127.0.0.1:0".parse()?,
        tls: TlsSource::SelfManaged(SelfManaged {
            secret_namespace: NAMESPACE.into(),
            secret_name: "stoker-webhook-tls".into(),
            dns_names: vec![format!("stoker-webhook.{NAMESPACE}.svc")],
            ip_addresses: vec!["127.0.0.1".parse()?],
            webhook_configuration: mwc_name.into(),
            validity: Duration::from_secs(86_400),
            renew_before: Duration::from_secs(3_600),
        }),
        refresh_interval: Duration::from_secs(60),
    };
    let config = Config {
        watch_namespace: Some(NAMESPACE.into()),
        lease: None,
        defaults: BuildDefaults {
            loader_image: LOADER_IMAGE.into(),
            // As on a cluster, the sidecar's local decode gets its CPU, not the whole machine.
            sidecar_resources: Some(serde_json::from_value(json!({
                "requests": {"cpu": format!("{}m", opts.sidecar_cpu_millis), "memory": "512Mi"},
                "limits": {"cpu": format!("{}m", opts.sidecar_cpu_millis), "memory": "512Mi"},
            }))?),
            allowed_images: Vec::new(),
        },
        webhook: Some(webhook),
        metrics_listen: None,
        // As the chart runs it: the operator's own objects go with the webhook configuration.
        installation: Some(mwc_name.into()),
        autoscaler: Some(AutoscalerSettings {
            prometheus_url: Some(stage.prometheus.url()),
            // Prometheus scrapes every 2 s here: rates over 12 s, a decision every 6 s.
            period: Duration::from_secs(6),
            defaults: AutoscalingPolicy {
                window: Duration::from_secs(12),
                ..AutoscalingPolicy::default()
            },
            ..AutoscalerSettings::default()
        }),
    };
    let shutdown = CancellationToken::new();
    let running = stoker_operator::start(client.clone(), config, shutdown.clone()).await?;
    let port = running.webhook_addr.context("webhook address")?.port();
    // The operator wrote its CA into the configuration; now point it at the operator's port.
    for _ in 0..150 {
        let mut mwc = mwcs.get(mwc_name).await?;
        let hook = &mwc.webhooks.as_ref().context("webhooks")?[0];
        if hook.client_config.ca_bundle.is_some() {
            stoker_operator::webhook::serve_from(&mut mwc, &format!("https://127.0.0.1:{port}"));
            mwcs.replace(mwc_name, &PostParams::default(), &mwc).await?;
            return Ok(shutdown);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("the operator did not write the webhook's caBundle")
}

/// The webhook is reachable a moment after its configuration points at it.
async fn create_when_webhook_ready(pods: &Api<Pod>, pod: &Pod) -> Result<()> {
    let mut last = None;
    for _ in 0..100 {
        match pods.create(&PostParams::default(), pod).await {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    bail!("create {}: {:?}", pod.name_any(), last)
}

fn pipeline(opts: &StoryOptions, stage: &Stage<'_>) -> DataPipeline {
    serde_json::from_value(json!({
        "apiVersion": "stoker.dev/v1alpha1",
        "kind": "DataPipeline",
        "metadata": {"name": PIPELINE},
        "spec": {
            "source": {"s3": {
                "bucket": opts.bucket, "endpoint": stage.s3.endpoint(), "region": "us-east-1",
                "forcePathStyle": true, "credentialsSecretRef": {"name": "s3-creds"},
            }},
            "transform": {"resize": {"mode": "crop", "width": opts.image_size, "height": opts.image_size}},
            "batch": {"size": opts.batch_size, "shuffleSeed": 42, "dropLast": true},
            "trainer": {"prefetchBatches": 24, "sharedMemory": "256Mi"},
            "decoders": {
                "minReplicas": 1, "maxReplicas": opts.max_decoders, "drainSeconds": 2,
                "nodeSelector": {"stoker.dev/pool": "cpu"},
                "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
            },
            "autoscaling": {
                "mode": "auto", "targetDataWaitPercent": 5, "maxNicUtilizationPercent": 80,
                "scaleDownStabilizationSeconds": 300,
            },
        }
    }))
    .expect("the story's DataPipeline is valid JSON for the CRD types")
}

/// How a trainer pod gets its batches.
enum Feed<'a> {
    /// GET, decode and resize in its own loop.
    Sync,
    /// A PyTorch DataLoader with this many worker processes, in the trainer's container.
    DataLoader(u32),
    /// The pipeline's sidecar (the webhook injects it); every delivered key is logged here.
    Sidecar { keys: &'a Path },
}

/// A trainer pod on a GPU node, fed by `feed`.
fn trainer_pod(
    name: &str,
    feed: Feed<'_>,
    opts: &StoryOptions,
    report: &Path,
    stage: &Stage<'_>,
) -> Pod {
    let mut args = vec![
        "--step-ms".to_string(),
        opts.step_ms.to_string(),
        "--epochs".into(),
        opts.epochs.to_string(),
        "--report".into(),
        report.display().to_string(),
    ];
    let from_s3 = [
        "--batch-size".to_string(),
        opts.batch_size.to_string(),
        "--size".into(),
        opts.image_size.to_string(),
        "--endpoint".into(),
        stage.s3.endpoint(),
        "--bucket".into(),
        opts.bucket.clone(),
    ];
    let mut labels = json!({"app": "trainer"});
    let (mut image, mut volumes, mut mounts) = (TRAINER_IMAGE, json!([]), json!([]));
    match feed {
        Feed::Sync => {
            args.extend(["--mode".into(), "sync".into()]);
            args.extend(from_s3);
        }
        Feed::DataLoader(workers) => {
            args.extend(["--mode".into(), "dataloader".into()]);
            args.extend(["--workers".into(), workers.to_string()]);
            args.extend(from_s3);
            image = TORCH_TRAINER_IMAGE;
            // Workers hand batches over through shared memory and sockets in a temporary
            // directory (TMPDIR, below): what a DataLoader pod needs.
            volumes = json!([
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                {"name": "scratch", "emptyDir": {}},
            ]);
            mounts = json!([
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "scratch", "mountPath": "/scratch"},
            ]);
        }
        Feed::Sidecar { keys } => {
            args.extend(["--mode".into(), "sidecar".into()]);
            args.extend(["--keys-out".into(), keys.display().to_string()]);
            labels["stoker.dev/pipeline"] = PIPELINE.into();
        }
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": "gpu-0"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": restricted_pod_security(TRAINER_UID),
            "volumes": volumes,
            "containers": [{
                "name": "trainer", "image": image, "args": args,
                "volumeMounts": mounts,
                "securityContext": restricted_container_security(),
                "env": [
                    {"name": "TMPDIR", "value": "/scratch"},
                    {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}},
                    {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}}},
                ],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
        }
    }))
    .expect("the trainer pod is valid JSON for Pod")
}
