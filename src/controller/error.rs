#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{verb} {kind} {namespace}/{name}: {source}")]
    Kube {
        verb: &'static str,
        kind: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("building {kind} for DataPipeline {name}: {source}")]
    Build {
        kind: &'static str,
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("DataPipeline {0} has no namespace")]
    MissingNamespace(String),
    #[error("loader arguments for DataPipeline {name}: {source}")]
    LoaderArgs {
        name: String,
        #[source]
        source: stoker_contract::RenderError,
    },
    #[error(transparent)]
    Certificates(#[from] crate::certs::CertError),
    /// An object changed between this reconcile's read and its write (another reconcile wrote
    /// it first): the pipeline is looked at again at once, from fresh reads, and nothing is
    /// reported.
    #[error("{kind} {namespace}/{name} changed since it was read")]
    Stale {
        kind: &'static str,
        namespace: String,
        name: String,
    },
}

impl Error {
    /// The only error label on metrics and the reason on Events.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Kube { source, .. } => match source {
                kube::Error::Api(s) if s.is_conflict() => "conflict",
                kube::Error::Api(s) if s.is_forbidden() => "forbidden",
                kube::Error::Api(s) if s.is_invalid() => "invalid",
                kube::Error::Api(_) => "kube_api",
                _ => "kube_client",
            },
            Self::Build { .. } => "build",
            Self::MissingNamespace(_) => "invalid_object",
            Self::LoaderArgs { source, .. } => source.category(),
            Self::Certificates(e) => e.category(),
            Self::Stale { .. } => "stale",
        }
    }

    /// The category as a condition reason and Event reason (`kube_api` → `KubeApi`).
    pub fn reason(&self) -> String {
        camel_case(self.category())
    }

    /// What a user reads in the `Degraded` condition and the Event: the API server's own
    /// message, without the client's debug dump of the whole Status.
    pub fn summary(&self) -> String {
        match self {
            Self::Kube {
                verb,
                kind,
                namespace,
                name,
                source: kube::Error::Api(status),
            } => format!("{verb} {kind} {namespace}/{name}: {}", status.message),
            other => other.to_string(),
        }
    }
}

/// `snake_case` (or `kebab-case`) to `CamelCase`, the spelling of condition reasons.
fn camel_case(category: &str) -> String {
    category
        .split(['_', '-'])
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut chars = w.chars();
            chars
                .next()
                .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str, message: &str) -> Error {
        let status = kube::core::Status::failure(message, reason).with_code(code);
        Error::Kube {
            verb: "create",
            kind: "Pod",
            namespace: "ns".into(),
            name: "dp".into(),
            source: kube::Error::Api(Box::new(status)),
        }
    }

    #[test]
    fn reasons_are_the_categories_in_camel_case() {
        assert_eq!(camel_case("kube_api"), "KubeApi");
        assert_eq!(camel_case("forbidden"), "Forbidden");
        assert_eq!(camel_case("invalid-object"), "InvalidObject");
        let e = api_error(403, "Forbidden", "exceeded quota: no-pods");
        assert_eq!(
            (e.category(), e.reason().as_str()),
            ("forbidden", "Forbidden")
        );
        assert_eq!(
            Error::MissingNamespace("dp".into()).reason(),
            "InvalidObject"
        );
    }

    #[test]
    fn the_summary_is_the_api_servers_message() {
        let e = api_error(
            403,
            "Forbidden",
            "pods \"dp-decoder-x\" is forbidden: exceeded quota",
        );
        assert_eq!(
            e.summary(),
            "create Pod ns/dp: pods \"dp-decoder-x\" is forbidden: exceeded quota"
        );
    }
}
