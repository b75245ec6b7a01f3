//! The import and I/O rules docs/architecture.md states, read from the source so that the page
//! and the code cannot drift apart: each rule names the files it holds for and what they must
//! not contain. Test modules (`#[cfg(test)]` onwards) are exempt: tests may build anything.

use std::path::{Path, PathBuf};

use clap::{Args, Command};
use stoker_contract::{DecodeArgs, IndexArgs, SidecarArgs};

/// Every `.rs` file under `dir` (relative to the operator's root), with its non-test source.
fn sources(dir: &str) -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    let mut todo = vec![root.join(dir)];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read source");
                let code = match text.find("#[cfg(test)]") {
                    Some(i) => text[..i].to_string(),
                    None => text,
                };
                let relative = path.strip_prefix(root).expect("under root").to_path_buf();
                out.push((relative, code));
            }
        }
    }
    out.sort();
    out
}

/// The lines of `files` that contain any of `forbidden`, as `path:line: text`.
fn offences(files: &[(PathBuf, String)], forbidden: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, code) in files {
        for (n, line) in code.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            if let Some(f) = forbidden.iter().find(|f| line.contains(*f)) {
                found.push(format!(
                    "{}:{}: {f}: {}",
                    path.display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    found
}

/// Calls to the API server, and the clients that make them.
const API_CALLS: &[&str] = &[
    "kube::Client",
    "Client::",
    "Api<",
    "Api::",
    "Recorder",
    "kube::api::",
    "prometheus_http_query",
    "reqwest",
];

fn except(files: Vec<(PathBuf, String)>, allowed: &[&str]) -> Vec<(PathBuf, String)> {
    files
        .into_iter()
        .filter(|(p, _)| !allowed.iter().any(|a| p.ends_with(a)))
        .collect()
}

#[test]
fn the_domain_and_the_builders_are_pure() {
    for dir in ["src/autoscale", "src/build", "src/certs", "src/api"] {
        let found = offences(&sources(dir), API_CALLS);
        assert!(found.is_empty(), "{dir} calls no API: {found:#?}");
        let found = offences(
            &sources(dir),
            &[
                "tonic",
                "tokio::",
                ".await",
                "crate::controller",
                "crate::signal_source",
            ],
        );
        assert!(
            found.is_empty(),
            "{dir} neither waits nor reaches up: {found:#?}"
        );
    }
}

#[test]
fn a_reconcile_reads_only_in_observe_and_writes_only_in_apply_and_report() {
    // mod.rs holds the client and the watches; the rest of the controller is pure.
    let io = ["observe.rs", "apply.rs", "report.rs", "mod.rs"];
    let found = offences(&except(sources("src/controller"), &io), API_CALLS);
    assert!(found.is_empty(), "API calls outside {io:?}: {found:#?}");
}

#[test]
fn the_controller_and_the_webhook_do_not_import_each_other() {
    let found = offences(&sources("src/controller"), &["crate::webhook"]);
    assert!(found.is_empty(), "{found:#?}");
    let found = offences(&sources("src/webhook"), &["crate::controller"]);
    assert!(found.is_empty(), "{found:#?}");
}

/// Every long flag of the loader's three commands, quoted as source would spell it.
fn loader_flags() -> Vec<String> {
    let commands = [
        SidecarArgs::augment_args(Command::new("sidecar")),
        DecodeArgs::augment_args(Command::new("decode")),
        IndexArgs::augment_args(Command::new("index")),
    ];
    let mut flags: Vec<String> = commands
        .iter()
        .flat_map(|c| c.get_arguments().filter_map(|a| a.get_long()))
        .map(|long| format!("\"--{long}\""))
        .collect();
    flags.sort();
    flags.dedup();
    flags
}

#[test]
fn only_the_contract_spells_the_loaders_flags() {
    let flags = loader_flags();
    assert!(flags.len() > 20, "the loader's flags were read: {flags:?}");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let found = offences(&sources("src"), &flags);
    assert!(
        found.is_empty(),
        "use the contract's typed args instead: {found:#?}"
    );
}

#[test]
fn the_rules_catch_what_they_forbid() {
    // Each rule, run over a file that breaks it, finds it: none of them can pass vacuously.
    let broken = |code: &str| vec![(PathBuf::from("src/autoscale/x.rs"), code.to_string())];
    let io = broken("let pods: Api<Pod> = Api::namespaced(client, ns);");
    assert_eq!(offences(&io, API_CALLS).len(), 1);
    let up = broken("use crate::controller::Context;");
    assert_eq!(offences(&up, &["crate::controller"]).len(), 1);
    let flag = broken(r#"args.push("--shards".into());"#);
    let flags = loader_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    assert_eq!(offences(&flag, &flags).len(), 1);
    let comment = broken("// Api::namespaced is how the apply step writes");
    assert!(
        offences(&comment, API_CALLS).is_empty(),
        "comments are prose"
    );
}
