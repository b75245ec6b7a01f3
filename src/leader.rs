//! Leader election on a coordination.k8s.io Lease: one replica runs the controller, all serve the
//! webhook. kube-runtime 5 has no election of its own, so this is the client-go algorithm in
//! small: take the Lease when it is free or expired, renew it well within its duration, and stop
//! leading as soon as a renewal fails past the deadline.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (pod name).
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
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
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("Lease {namespace}/{name}: {source}")]
    Kube {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

impl LeaderError {
    pub fn category(&self) -> &'static str {
        "leader_lease"
    }
}

/// Whether a lease held by someone else may be taken over at `now`.
pub fn is_expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    if spec.holder_identity.as_deref().unwrap_or("").is_empty() {
        return true;
    }
    let Some(renewed) = spec.renew_time.as_ref() else {
        return true;
    };
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    now.as_second() > renewed.0.as_second() + duration
}

pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
}

impl LeaderElector {
    pub fn new(client: Client, config: LeaseConfig) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
        }
    }

    fn err(&self, source: kube::Error) -> LeaderError {
        LeaderError::Kube {
            namespace: self.config.namespace.clone(),
            name: self.config.name.clone(),
            source,
        }
    }

    fn spec(&self, previous: Option<&LeaseSpec>, now: Timestamp) -> LeaseSpec {
        let mine = previous.and_then(|p| p.holder_identity.as_deref())
            == Some(self.config.identity.as_str());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: i32::try_from(self.config.lease_duration.as_secs()).ok(),
            acquire_time: if mine {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(if mine { transitions } else { transitions + 1 }),
            ..LeaseSpec::default()
        }
    }

    /// One attempt to take or renew the lease; `Ok(false)` when another replica holds it.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, LeaderError> {
        let now = Timestamp::now();
        match self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(|e| self.err(e))?
        {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.config.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(self.spec(None, now)),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(self.err(e)),
                }
            }
            Some(mut lease) => {
                let previous = lease.spec.clone().unwrap_or_default();
                let mine =
                    previous.holder_identity.as_deref() == Some(self.config.identity.as_str());
                if !mine && !is_expired(&previous, now) {
                    return Ok(false);
                }
                lease.spec = Some(self.spec(Some(&previous), now));
                match self
                    .api
                    .replace(&self.config.name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(self.err(e)),
                }
            }
        }
    }

    /// Waits until this replica leads; `false` if `shutdown` came first.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> bool {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election attempt failed"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(self.config.retry_period) => {}
            }
        }
    }

    /// Renews until `shutdown` or until renewal fails for longer than the renew deadline;
    /// returns `true` if leadership was lost. The caller releases after stopping its work.
    pub async fn hold(&self, shutdown: &CancellationToken) -> bool {
        let mut last_renew = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(self.config.retry_period) => {}
            }
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renew = tokio::time::Instant::now(),
                Ok(false) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "lease renewal failed");
                    if last_renew.elapsed() > self.config.renew_deadline {
                        return true;
                    }
                }
            }
        }
    }

    /// Gives the lease up so that another replica takes over at once.
    pub async fn release(&self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        let _ = self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renewed: i64, duration: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(Into::into),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).expect("ts"))),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn a_lease_expires_after_its_duration() {
        let now = Timestamp::from_second(1_000).expect("ts");
        assert!(!is_expired(&spec(Some("a"), 990, 15), now));
        assert!(is_expired(&spec(Some("a"), 980, 15), now));
        assert!(is_expired(&spec(None, 999, 15), now));
        assert!(is_expired(&spec(Some(""), 999, 15), now));
    }
}
