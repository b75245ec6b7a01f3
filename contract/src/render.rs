//! Typed loader arguments back into the command line the loader parses.

use clap::{Arg, Args, Command, FromArgMatches};
use serde::Serialize;
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// A value serde cannot write (a path that is not UTF-8).
    #[error("loader arguments: {0}")]
    Serialize(serde_json::Error),
    /// The arguments do not parse back (a bug in this crate; the round-trip tests catch it).
    #[error("loader arguments do not parse: {0}")]
    Parse(clap::Error),
}

impl RenderError {
    pub fn category(&self) -> &'static str {
        match self {
            Self::Serialize(_) => "loader_args_serialize",
            Self::Parse(_) => "loader_args_parse",
        }
    }
}

/// A `stoker-loader` subcommand whose flags are one clap struct.
pub trait LoaderCommand: Args + FromArgMatches + Serialize + Sized {
    /// The subcommand's name on the loader's command line.
    const SUBCOMMAND: &'static str;

    /// Parses flags (without the subcommand) as the loader does, except that no environment
    /// variable is read: defaults come from the clap definitions alone.
    fn parse_flags<I, S>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let command = Self::augment_args(Command::new(Self::SUBCOMMAND))
            .mut_args(|a| a.env(None::<&'static str>));
        let argv = std::iter::once(std::ffi::OsString::from(Self::SUBCOMMAND))
            .chain(flags.into_iter().map(Into::into));
        Self::from_arg_matches(&command.try_get_matches_from(argv)?)
    }

    /// The subcommand and its flags, in declaration order. A flag is left out when it is
    /// unset (`None`, `false`, empty), and when the loader may read it from its environment
    /// (`RANK`, `STOKER_LOCAL_SHARE`, ...) and the value is the default: the pod's environment
    /// then decides, as it would with no flag at all.
    fn command_line(&self) -> Result<Vec<String>, RenderError> {
        let values = object(self)?;
        let args: Vec<Arg> = Self::augment_args(Command::new(Self::SUBCOMMAND))
            .get_arguments()
            .cloned()
            .collect();
        let value_of = |a: &Arg| values.get(a.get_id().as_str()).unwrap_or(&Value::Null);
        let required: Vec<String> = args
            .iter()
            .filter(|a| a.is_required_set())
            .flat_map(|a| flag(a, value_of(a)))
            .collect();
        let defaults = object(&Self::parse_flags(required).map_err(RenderError::Parse)?)?;
        let mut line = vec![Self::SUBCOMMAND.to_string()];
        for a in &args {
            let value = value_of(a);
            let from_env = a.get_env().is_some() && !a.is_required_set();
            if from_env && defaults.get(a.get_id().as_str()) == Some(value) {
                continue;
            }
            line.extend(flag(a, value));
        }
        Ok(line)
    }
}

impl LoaderCommand for crate::DecodeArgs {
    const SUBCOMMAND: &'static str = "decode";
}

impl LoaderCommand for crate::SidecarArgs {
    const SUBCOMMAND: &'static str = "sidecar";
}

impl LoaderCommand for crate::IndexArgs {
    const SUBCOMMAND: &'static str = "index";
}

fn object<T: Serialize>(value: &T) -> Result<Map<String, Value>, RenderError> {
    match serde_json::to_value(value).map_err(RenderError::Serialize)? {
        Value::Object(map) => Ok(map),
        _ => Ok(Map::new()),
    }
}

/// `--name value`, `--name` for a set switch, `--name a,b` for a list; nothing when unset.
fn flag(arg: &Arg, value: &Value) -> Vec<String> {
    let Some(long) = arg.get_long() else {
        return Vec::new();
    };
    let name = format!("--{long}");
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    match value {
        Value::Null | Value::Bool(false) => Vec::new(),
        Value::Bool(true) => vec![name],
        Value::Array(items) if items.is_empty() => Vec::new(),
        Value::Array(items) => {
            let joined: Vec<String> = items.iter().map(text).collect();
            vec![name, joined.join(",")]
        }
        other => vec![name, text(other)],
    }
}
