//! stoker-operator: keeps GPU trainers fed by running decoder fleets for `DataPipeline`s.
//!
//! [`start`] wires everything one process runs: the webhook (every replica), the metrics and
//! health server, and — on the replica holding the Lease — the controller. Tests call it
//! in-process with their own client and a [`CancellationToken`].

pub mod api;
pub mod autoscale;
pub mod build;
pub mod certs;
pub mod controller;
pub mod installation;
pub mod leader;
pub mod signal_source;
pub mod telemetry;
pub mod webhook;

use std::net::SocketAddr;
use std::sync::Arc;

use kube::Client;
pub use tokio_util::sync::CancellationToken;

use build::BuildDefaults;
use leader::{Leadership, LeaseConfig};
use telemetry::Metrics;
use webhook::WebhookConfig;

/// Everything `start` needs besides a client.
#[derive(Clone, Debug)]
pub struct Config {
    /// Watch only this namespace (all when `None`).
    pub watch_namespace: Option<String>,
    /// Leader election; `None` runs the controller unconditionally (single replica, tests).
    pub lease: Option<LeaseConfig>,
    pub defaults: BuildDefaults,
    /// `None` runs no webhook.
    pub webhook: Option<WebhookConfig>,
    /// `/metrics`, `/healthz`, `/readyz`; `None` serves none.
    pub metrics_listen: Option<SocketAddr>,
    /// The autoscaler and the Prometheus it reads; `None` runs no autoscaler.
    pub autoscaler: Option<signal_source::AutoscalerSettings>,
    /// The MutatingWebhookConfiguration the operator's own Secrets and Lease belong to (see
    /// [`installation`]); `None` leaves them without an owner.
    pub installation: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Webhook(#[from] webhook::WebhookError),
    #[error("metrics server: {0}")]
    Metrics(std::io::Error),
    #[error("lost leadership of Lease {0}")]
    LostLease(String),
    #[error("autoscaler: {0}")]
    Autoscaler(signal_source::prometheus::SignalError),
}

impl RunError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Webhook(e) => e.category(),
            Self::Metrics(_) => "metrics_bind",
            Self::LostLease(_) => "leader_lost",
            Self::Autoscaler(e) => e.category(),
        }
    }
}

/// A started operator.
pub struct Running {
    pub webhook_addr: Option<SocketAddr>,
    pub metrics_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    /// Ends when `shutdown` fires (Ok) or leadership is lost (Err).
    pub task: tokio::task::JoinHandle<Result<(), RunError>>,
}

/// Starts the operator's servers and its controller loop.
pub async fn start(
    client: Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<Running, RunError> {
    let metrics = Arc::new(Metrics::default());
    let owner = match &config.installation {
        Some(name) => installation::owner(&client, name).await,
        None => None,
    };
    let metrics_addr = match config.metrics_listen {
        Some(addr) => Some(
            telemetry::serve(addr, metrics.clone(), shutdown.clone())
                .await
                .map_err(RunError::Metrics)?
                .0,
        ),
        None => None,
    };
    let webhook_addr = match config.webhook.clone() {
        Some(w) => Some(
            webhook::serve(
                client.clone(),
                w,
                config.defaults.clone(),
                metrics.clone(),
                owner.clone(),
                shutdown.clone(),
            )
            .await?
            .local_addr,
        ),
        None => None,
    };
    metrics.set_ready(true);

    let autoscaler = config
        .autoscaler
        .clone()
        .map(|settings| signal_source::AutoscalerHandle::new(settings, metrics.autoscaler.clone()))
        .transpose()
        .map_err(RunError::Autoscaler)?;
    let ctx = Arc::new(
        controller::Context::new(client.clone(), config.defaults.clone(), metrics.clone())
            .with_autoscaler(autoscaler)
            .with_owner(owner.clone()),
    );
    let m = metrics.clone();
    let task = tokio::spawn(async move {
        let Some(lease) = config.lease else {
            m.set_leader(true);
            controller::run(ctx, config.watch_namespace, shutdown).await;
            return Ok(());
        };
        let Some(leadership) = Leadership::acquire(client.clone(), lease.clone(), &shutdown).await
        else {
            return Ok(());
        };
        tracing::info!(lease = %lease.name, identity = %lease.identity, "leading");
        if let Some(owner) = &owner {
            leadership.adopt(&client, owner).await;
        }
        m.set_leader(true);
        let controller_stop = shutdown.child_token();
        let controller = tokio::spawn(controller::run(
            ctx,
            config.watch_namespace,
            controller_stop.clone(),
        ));
        let lost = leadership.hold(&shutdown).await;
        controller_stop.cancel();
        let _ = controller.await;
        if !lost {
            leadership.release().await;
        }
        m.set_leader(false);
        if lost {
            Err(RunError::LostLease(lease.name))
        } else {
            Ok(())
        }
    });
    Ok(Running {
        webhook_addr,
        metrics_addr,
        metrics,
        task,
    })
}

/// Runs the operator until `shutdown` or until leadership is lost.
pub async fn run(
    client: Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let running = start(client, config, shutdown).await?;
    match running.task.await {
        Ok(r) => r,
        Err(_) => Ok(()),
    }
}
