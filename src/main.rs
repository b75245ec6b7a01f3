use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use stoker_operator::autoscale::AutoscalingPolicy;
use stoker_operator::build::BuildDefaults;
use stoker_operator::leader::LeaseConfig;
use stoker_operator::signal_source::AutoscalerSettings;
use stoker_operator::webhook::WebhookConfig;
use stoker_operator::webhook::tls::{SelfManaged, TlsSource};
use stoker_operator::{CancellationToken, Config, api, telemetry};

#[derive(Parser)]
#[command(
    name = "stoker-operator",
    version,
    about = "Keeps GPU trainers fed with decoded images from S3"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the operator (default).
    Run(Box<RunArgs>),
    /// Print the DataPipeline CRD as YAML.
    Crd,
}

#[derive(Clone, Copy, ValueEnum)]
enum TlsMode {
    /// Issue, store and rotate the webhook certificate in a Secret.
    SelfManaged,
    /// Read the certificate from files (cert-manager).
    Files,
}

#[derive(Parser)]
struct RunArgs {
    /// Namespace the operator runs in (Lease, webhook Secret).
    #[arg(long, env = "POD_NAMESPACE", default_value = "stoker-system")]
    namespace: String,
    /// This replica's identity for leader election.
    #[arg(long, env = "POD_NAME", default_value = "stoker-operator")]
    identity: String,
    /// Watch only this namespace.
    #[arg(long, env = "STOKER_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    #[arg(long, default_value = "stoker-operator-leader")]
    lease_name: String,
    /// Run the controller without leader election.
    #[arg(long)]
    no_leader_election: bool,
    #[arg(
        long,
        env = "STOKER_LOADER_IMAGE",
        default_value = "ghcr.io/stoker-dev/stoker-loader:0.1.0"
    )]
    loader_image: String,
    /// An image decoders and sidecars may run besides --loader-image (`*` matches any run of
    /// characters); repeated for several. None: the loader image only.
    #[arg(long = "allowed-image")]
    allowed_images: Vec<String>,
    /// CPU of the injected sidecar (requests = limits, so Guaranteed trainer pods stay so).
    #[arg(long, default_value = "1")]
    sidecar_cpu: String,
    /// Memory of the injected sidecar before its shared-memory ring is added.
    #[arg(long, default_value = "512Mi")]
    sidecar_memory: String,
    #[arg(long, default_value = "0.0.0.0:8443")]
    webhook_listen: SocketAddr,
    #[arg(long, value_enum, default_value = "self-managed")]
    webhook_tls: TlsMode,
    #[arg(long, default_value = "/tls/tls.crt")]
    webhook_cert: PathBuf,
    #[arg(long, default_value = "/tls/tls.key")]
    webhook_key: PathBuf,
    #[arg(long, default_value = "stoker-webhook-tls")]
    webhook_secret: String,
    /// Service fronting the webhook; its DNS names go into the certificate.
    #[arg(long, default_value = "stoker-webhook")]
    webhook_service: String,
    #[arg(long, default_value = "stoker-sidecar-injector")]
    webhook_configuration: String,
    /// Disable the webhook (e.g. a controller-only replica).
    #[arg(long)]
    no_webhook: bool,
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_listen: SocketAddr,
    #[arg(long)]
    log_json: bool,
    /// Prometheus the autoscaler reads (e.g. http://prometheus.monitoring:9090); without it no
    /// pipeline is autoscaled and `auto` pipelines run decoders.minReplicas.
    #[arg(long, env = "STOKER_PROMETHEUS_URL")]
    prometheus_url: Option<String>,
    /// How often each pipeline's signals are read and decided on.
    #[arg(long, default_value_t = AutoscalerSettings::default().period.as_secs())]
    autoscale_period_seconds: u64,
    /// The window every rate is taken over (at least 4 scrape intervals).
    #[arg(long, default_value_t = AutoscalingPolicy::default().window.as_secs())]
    autoscale_window_seconds: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::Crd) => {
            print!("{}", api::crd_yaml()?);
            return Ok(());
        }
        Some(Command::Run(args)) => *args,
        None => RunArgs::parse_from(["stoker-operator"]),
    };
    telemetry::init_logging(args.log_json);
    let client = kube::Client::try_default().await?;
    let tls = match args.webhook_tls {
        TlsMode::Files => TlsSource::Files {
            cert: args.webhook_cert.clone(),
            key: args.webhook_key.clone(),
        },
        TlsMode::SelfManaged => TlsSource::SelfManaged(SelfManaged {
            secret_namespace: args.namespace.clone(),
            secret_name: args.webhook_secret.clone(),
            dns_names: vec![
                format!("{}.{}.svc", args.webhook_service, args.namespace),
                format!(
                    "{}.{}.svc.cluster.local",
                    args.webhook_service, args.namespace
                ),
            ],
            ip_addresses: Vec::<IpAddr>::new(),
            webhook_configuration: args.webhook_configuration.clone(),
            validity: Duration::from_secs(90 * 86_400),
            renew_before: Duration::from_secs(30 * 86_400),
        }),
    };
    let config = Config {
        watch_namespace: args.watch_namespace.clone(),
        lease: (!args.no_leader_election)
            .then(|| LeaseConfig::new(&args.namespace, &args.lease_name, &args.identity)),
        defaults: BuildDefaults {
            loader_image: args.loader_image.clone(),
            sidecar_resources: Some(sidecar_resources(&args.sidecar_cpu, &args.sidecar_memory)),
            allowed_images: args.allowed_images.clone(),
        },
        webhook: (!args.no_webhook).then(|| WebhookConfig {
            listen: args.webhook_listen,
            tls,
            refresh_interval: Duration::from_secs(600),
        }),
        metrics_listen: Some(args.metrics_listen),
        installation: Some(args.webhook_configuration.clone()),
        autoscaler: args.prometheus_url.clone().map(|url| AutoscalerSettings {
            prometheus_url: Some(url),
            period: Duration::from_secs(args.autoscale_period_seconds),
            defaults: AutoscalingPolicy {
                window: Duration::from_secs(args.autoscale_window_seconds),
                ..Default::default()
            },
            ..Default::default()
        }),
    };
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        signal.cancel();
    });
    stoker_operator::run(client, config, shutdown).await?;
    Ok(())
}

/// SIGTERM (Kubernetes) or Ctrl-C: the one shutdown signal.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn sidecar_resources(cpu: &str, memory: &str) -> ResourceRequirements {
    let both = BTreeMap::from([
        ("cpu".to_string(), Quantity(cpu.to_string())),
        ("memory".to_string(), Quantity(memory.to_string())),
    ]);
    ResourceRequirements {
        requests: Some(both.clone()),
        limits: Some(both),
        ..ResourceRequirements::default()
    }
}
