//! The sidecar's local decode stays within its CPU limit, as a kubelet's cgroup holds it: a
//! DataPipeline with no decoders, so the trainer's sidecar decodes every batch itself, with a
//! limit of half a CPU on a machine with two. Its CPU time comes from its container's cgroup.

mod common;

use std::time::Duration;
use stoker_demo::StoryOptions;

const EPOCHS: u32 = 8;
const LIMIT_MILLIS: u32 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecars_local_decode_stays_within_its_cpu_limit() {
    let world = common::World::start();
    let opts = StoryOptions {
        bucket: "story".into(),
        recover_timeout: Duration::from_secs(180),
        epochs: EPOCHS,
        // The trainer takes each batch as it comes: the sidecar is the bottleneck throughout.
        step_ms: 1,
        sidecar_cpu_millis: LIMIT_MILLIS,
        work_dir: world.out.clone(),
        ..StoryOptions::default()
    };
    let report = stoker_demo::local_decode(&world.stage(), &opts)
        .await
        .expect("the trainer runs on its sidecar alone");
    world.assert_every_sample_once(&report.keys_file, EPOCHS);

    let used = report.sidecar_cpus();
    let limit = f64::from(LIMIT_MILLIS) / 1000.0;
    eprintln!(
        "sidecar: {:?} of CPU in {:?} ({used:.2} CPUs, limit {limit})",
        report.sidecar_cpu, report.wall
    );
    // It decoded for long enough to measure, busy against its limit, and not above it. With a
    // limit above this machine's 2 CPUs it took 1.26 CPUs (8 epochs in 3.0 s, 2026-12-05).
    assert!(
        report.wall >= Duration::from_secs(3),
        "measured over {:?} only",
        report.wall
    );
    assert!(
        used >= 0.7 * limit,
        "{used:.2} CPUs: the sidecar was not the bottleneck"
    );
    assert!(
        used <= 1.1 * limit,
        "{used:.2} CPUs against a {limit} limit"
    );
    world.runtime.shutdown();
}
