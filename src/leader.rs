//! Leader election on a coordination.k8s.io Lease: one replica runs the controller, all serve the
//! webhook. `kube-lease-manager` takes, renews and releases the Lease; what stays here is the
//! mapping of our durations onto it and when the controller must stop leading.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManager, LeaseParams};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::installation;

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (pod name).
    pub identity: String,
    /// How long a Lease stays held without renewal; another replica may take it after that.
    /// Whole seconds, at least 2.
    pub lease_duration: Duration,
    /// How long renewals may keep failing before the leader stops leading.
    pub renew_deadline: Duration,
    /// How often the leader renews (whole seconds, at least 1), and how long a failed attempt
    /// waits before the next.
    pub retry_period: Duration,
}

impl LeaseConfig {
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity: identity.to_string(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// The Lease duration and how often the holder renews (every `retry_period`, as client-go
    /// does), in the whole seconds the Lease API counts; clamped to what the crate accepts (it
    /// panics unless 0 < grace < duration).
    fn seconds(&self) -> (u64, u64) {
        let duration = self.lease_duration.as_secs().max(2);
        let retry = self.retry_period.as_secs() + u64::from(self.retry_period.subsec_nanos() > 0);
        (duration, retry.clamp(1, duration - 1))
    }

    /// The crate's parameters: its grace is how long before expiry the holder renews.
    fn params(&self) -> LeaseParams {
        let (duration, renew_every) = self.seconds();
        LeaseParams::new(self.identity.clone(), duration, duration - renew_every)
    }

    fn renew_interval(&self) -> Duration {
        Duration::from_secs(self.seconds().1)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("Lease {namespace}/{name}: {source}")]
    Lease {
        namespace: String,
        name: String,
        source: kube_lease_manager::LeaseManagerError,
    },
}

impl LeaderError {
    pub fn category(&self) -> &'static str {
        "leader_lease"
    }
}

/// This replica's hold on the Lease, from the moment it leads.
pub struct Leadership {
    manager: LeaseManager,
    config: LeaseConfig,
}

impl Leadership {
    /// Waits until this replica leads; `None` if `shutdown` came first.
    pub async fn acquire(
        client: Client,
        config: LeaseConfig,
        shutdown: &CancellationToken,
    ) -> Option<Self> {
        let manager = loop {
            match LeaseManager::new(
                client.clone(),
                &config.name,
                &config.namespace,
                config.params(),
                LeaseCreateMode::AutoCreate,
            )
            .await
            {
                Ok(manager) => break manager,
                Err(e) => warn(&config, e, "leader election attempt failed"),
            }
            if !pause(shutdown, config.retry_period).await {
                return None;
            }
        };
        loop {
            let changed = tokio::select! {
                () = shutdown.cancelled() => return None,
                changed = manager.changed() => changed,
            };
            match changed {
                Ok(true) => return Some(Self { manager, config }),
                Ok(false) => {}
                Err(e) => {
                    warn(&config, e, "leader election attempt failed");
                    if !pause(shutdown, config.retry_period).await {
                        return None;
                    }
                }
            }
        }
    }

    /// Makes the Lease belong to `owner` (see [`crate::installation`]). kube-lease-manager
    /// creates it and renews only the fields of its spec, so the reference stays.
    pub async fn adopt(&self, client: &Client, owner: &OwnerReference) {
        let api: Api<Lease> = Api::namespaced(client.clone(), &self.config.namespace);
        match api.get(&self.config.name).await {
            Ok(lease) => installation::adopt(&api, &lease, owner).await,
            Err(e) => tracing::warn!(lease = %self.config.name, error = %e,
                "could not read the Lease to set its owner"),
        }
    }

    /// Renews until `shutdown`; `true` if leadership was lost: another replica holds the Lease,
    /// or renewals kept failing for longer than the renew deadline. The caller releases after
    /// stopping its work.
    pub async fn hold(&self, shutdown: &CancellationToken) -> bool {
        let mut failing_since: Option<Instant> = None;
        loop {
            let call = Instant::now();
            let changed = tokio::select! {
                () = shutdown.cancelled() => return false,
                changed = self.manager.changed() => changed,
            };
            match changed {
                Ok(true) => failing_since = None,
                Ok(false) => return true,
                Err(e) => {
                    // The crate only returns on a change or an error; a call that stayed quiet
                    // for a whole renewal interval renewed at least once before failing.
                    if call.elapsed() >= self.config.renew_interval() {
                        failing_since = Some(call);
                    }
                    let since = *failing_since.get_or_insert(call);
                    warn(&self.config, e, "lease renewal failed");
                    if since.elapsed() > self.config.renew_deadline {
                        return true;
                    }
                    if !pause(shutdown, self.config.retry_period).await {
                        return false;
                    }
                }
            }
        }
    }

    /// Gives the Lease up, so that another replica takes it once it notices (at the latest when
    /// the last renewal would have expired).
    pub async fn release(&self) {
        if let Err(e) = self.manager.release().await {
            warn(&self.config, e, "releasing the lease failed");
        }
    }
}

fn warn(config: &LeaseConfig, source: kube_lease_manager::LeaseManagerError, message: &str) {
    let e = LeaderError::Lease {
        namespace: config.namespace.clone(),
        name: config.name.clone(),
        source,
    };
    tracing::warn!(error = %e, category = e.category(), "{message}");
}

/// Sleeps for `period`; `false` if `shutdown` came first.
async fn pause(shutdown: &CancellationToken, period: Duration) -> bool {
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(period) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(lease: u64, retry_ms: u64) -> LeaseConfig {
        let mut c = LeaseConfig::new("ns", "lease", "me");
        c.lease_duration = Duration::from_secs(lease);
        c.retry_period = Duration::from_millis(retry_ms);
        c
    }

    #[test]
    fn the_holder_renews_every_retry_period_within_the_lease() {
        assert_eq!(config(15, 2_000).params(), LeaseParams::new("me", 15, 13));
        // Sub-second periods round up: the Lease API counts whole seconds.
        assert_eq!(config(4, 500).params(), LeaseParams::new("me", 4, 3));
        assert_eq!(config(4, 500).renew_interval(), Duration::from_secs(1));
        // Never at or past the Lease's expiry, never with a zero grace (the crate panics).
        assert_eq!(config(2, 5_000).params(), LeaseParams::new("me", 2, 1));
        assert_eq!(config(0, 0).params(), LeaseParams::new("me", 2, 1));
    }
}
