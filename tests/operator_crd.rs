//! `crds/` and the chart's copy are generated from the Rust types; this fails on drift and, with
//! `UPDATE_CRDS=1`, rewrites both.

use std::path::Path;

const FILE: &str = "datapipelines.stoker.dev.yaml";

#[test]
fn crds_match_the_rust_types() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let want = stoker_operator::api::crd_yaml().expect("CRD serializes");
    let targets = [
        root.join("crds").join(FILE),
        root.join("charts/stoker/crds").join(FILE),
    ];
    if std::env::var_os("UPDATE_CRDS").is_some_and(|v| v == "1") {
        for t in &targets {
            std::fs::create_dir_all(t.parent().expect("has a parent")).expect("mkdir");
            std::fs::write(t, &want).expect("write CRD");
        }
        return;
    }
    for t in &targets {
        let have = std::fs::read_to_string(t).unwrap_or_default();
        assert!(
            have == want,
            "{} is out of date with src/api: run `UPDATE_CRDS=1 cargo test -p stoker-operator --test operator_crd`",
            t.display()
        );
    }
}
