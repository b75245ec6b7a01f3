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
        }
    }
}
