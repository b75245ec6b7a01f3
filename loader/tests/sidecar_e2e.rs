//! The sidecar end to end, on real processes: `stoker-loader decode` workers, `stoker-loader
//! sidecar` per rank, the S3 test server, and trainers reading the shared-memory ring.

mod sidecar_support;

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use sidecar_support::*;
use stoker_loader::sidecar::client::TrainerClient;
use stoker_loader::sidecar::plan::Shard;
use stoker_loader::sidecar::protocol::Reply;
use stoker_testenv::cluster::{
    ControlPlane, restricted_container_security, restricted_pod_security,
};
use stoker_testenv::http;
use stoker_testenv::s3::S3Server;

/// Two cores run these: one test at a time keeps the timing assertions meaningful.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn ranks_cover_the_dataset(world: u32) {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let keys = dataset(&server, 48, 96, 64);
    let w1 = decode_worker(&server);
    let w2 = decode_worker(&server);
    let world_s = world.to_string();
    let sidecars: Vec<SidecarProc> = (0..world)
        .map(|r| {
            let rank = r.to_string();
            sidecar(
                &server,
                dir.path(),
                &[&w1, &w2],
                &[
                    "--rank",
                    &rank,
                    "--world-size",
                    &world_s,
                    "--epochs",
                    "2",
                    "--batch-size",
                    "5",
                ],
            )
        })
        .collect();
    let results: Vec<Vec<Epoch>> = std::thread::scope(|s| {
        let handles: Vec<_> = sidecars
            .iter()
            .map(|sc| {
                s.spawn(move || {
                    let mut c = sc.connect();
                    assert_eq!(c.hello.world_size, world);
                    let epochs = vec![
                        consume_epoch(&mut c, |_, _| {}),
                        consume_epoch(&mut c, |_, _| {}),
                    ];
                    assert!(matches!(
                        c.next(Duration::from_secs(10)).unwrap(),
                        Reply::Done
                    ));
                    epochs
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected_batches = (48 / world as usize).div_ceil(5);
    for epoch in 0..2 {
        let mut all = Vec::new();
        for (rank, r) in results.iter().enumerate() {
            let e = &r[epoch];
            assert_eq!(e.epoch, epoch as u64);
            assert_eq!(
                e.batches.len(),
                expected_batches,
                "rank {rank}: equal batch counts"
            );
            let mine = e.keys();
            let distinct: HashSet<&String> = mine.iter().collect();
            assert_eq!(
                distinct.len(),
                mine.len(),
                "rank {rank} got a sample twice in epoch {epoch}"
            );
            assert!(e.skips.is_empty(), "{:?}", e.skips);
            all.extend(mine);
        }
        all.sort();
        assert_eq!(
            all, keys,
            "epoch {epoch}: ranks are disjoint and cover every sample"
        );
    }
    assert_ne!(
        results[0][0].batches, results[0][1].batches,
        "epochs are shuffled differently"
    );
    let delivered = sidecars[0].metric("stoker_sidecar_batches_delivered_total");
    assert_eq!(delivered, (2 * expected_batches) as f64);
}

#[test]
fn two_ranks_get_disjoint_equal_shards_covering_every_sample() {
    let _g = serial();
    ranks_cover_the_dataset(2);
}

#[test]
fn four_ranks_get_disjoint_equal_shards_covering_every_sample() {
    let _g = serial();
    ranks_cover_the_dataset(4);
}

#[test]
fn killing_decode_workers_mid_epoch_loses_no_sample_and_stalls_boundedly() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    // Larger images so that the epoch lasts long enough to kill workers in the middle of it.
    let keys = dataset(&server, 80, 800, 600);
    let mut workers = [
        decode_worker(&server),
        decode_worker(&server),
        decode_worker(&server),
    ];
    let refs: Vec<&DecodeWorkerProc> = workers.iter().collect();
    let timeout_s = 3.0;
    let sc = sidecar(
        &server,
        dir.path(),
        &refs,
        &[
            "--batch-timeout-secs",
            "3",
            "--prefetch-batches",
            "4",
            "--no-local-fallback",
        ],
    );
    drop(refs);
    let mut client = sc.connect();
    let mut gaps = Vec::new();
    let mut last = Instant::now();
    let epoch = consume_epoch(&mut client, |i, _| {
        gaps.push(last.elapsed());
        if i == 3 {
            workers[0].proc.kill9();
        }
        if i == 9 {
            workers[1].proc.kill9();
        }
        std::thread::sleep(Duration::from_millis(20));
        last = Instant::now();
    });
    let mut got = epoch.keys();
    got.sort();
    assert_eq!(
        got, keys,
        "every sample exactly once, in spite of two dead workers"
    );
    assert_eq!(epoch.batches.len(), 20);
    let worst = gaps.iter().max().copied().unwrap_or_default();
    eprintln!("worst wait between batches: {worst:?}");
    assert!(
        worst < Duration::from_secs_f64(timeout_s + 5.0),
        "stall {worst:?} exceeds the retry timeout plus margin"
    );
    let text = http::blocking::get(sc.http, "/metrics").unwrap().1;
    let retries: f64 = ["unavailable", "error", "timeout", "connect"]
        .iter()
        .map(|r| {
            metric(
                &text,
                &format!("stoker_sidecar_retries_total{{reason=\"{r}\"}}"),
            )
        })
        .sum();
    assert!(
        retries >= 1.0,
        "the dead workers' batches were re-sent:\n{text}"
    );
}

#[test]
fn resuming_at_epoch_and_batch_reproduces_the_remaining_order() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 30, 64, 48);
    // No workers: the sidecar decodes locally, which also covers that path.
    let flags = [
        "--rank",
        "1",
        "--world-size",
        "2",
        "--batch-size",
        "3",
        "--seed",
        "7",
    ];
    let full = sidecar(&server, dir.path(), &[], &flags);
    let mut c = full.connect();
    let e0 = consume_epoch(&mut c, |_, _| {});
    let e1 = consume_epoch(&mut c, |_, _| {});
    drop(c);
    drop(full);
    let mut resumed_flags = flags.to_vec();
    resumed_flags.extend(["--start-epoch", "0", "--start-batch", "3"]);
    let resumed = sidecar(&server, dir.path(), &[], &resumed_flags);
    let mut c = resumed.connect();
    assert_eq!(c.hello.start_batch, 3);
    let r0 = consume_epoch(&mut c, |i, b| assert_eq!(b.index, (i + 3) as u64));
    let r1 = consume_epoch(&mut c, |_, _| {});
    assert_eq!(
        r0.batches,
        e0.batches[3..].to_vec(),
        "rest of the epoch in the same order"
    );
    assert_eq!(r1.batches, e1.batches, "the next epoch is identical");
    assert_eq!(e0.batches.len(), 5);
}

#[test]
fn corrupt_and_missing_objects_reach_the_trainer_as_skips() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let good = dataset(&server, 6, 80, 60);
    let mut bad_jpeg = jpeg(80, 60, 1);
    bad_jpeg.truncate(bad_jpeg.len() / 3);
    server
        .put_object(BUCKET, "truncated.jpg", &bad_jpeg)
        .unwrap();
    server
        .put_object(
            BUCKET,
            "garbage.jpg",
            b"\xff\xd8\xff\xe0 this is not a jpeg",
        )
        .unwrap();
    server
        .put_object(BUCKET, "page.jpg", b"<html>error</html>")
        .unwrap();
    let mut manifest = String::new();
    for (i, k) in good.iter().enumerate() {
        manifest.push_str(&format!(
            "{{\"key\":\"{k}\",\"caption\":\"image {i}\",\"label\":{i}}}\n"
        ));
    }
    for k in ["truncated.jpg", "garbage.jpg", "page.jpg", "missing.jpg"] {
        manifest.push_str(&format!("{{\"key\":\"{k}\",\"caption\":\"bad\"}}\n"));
    }
    let mpath = dir.path().join("train.jsonl");
    std::fs::write(&mpath, manifest).unwrap();
    let w = decode_worker(&server);
    let mp = mpath.display().to_string();
    let sc = sidecar(
        &server,
        dir.path(),
        &[&w],
        &["--manifest", &mp, "--epochs", "1"],
    );
    let mut c = sc.connect();
    let mut metadata: HashMap<String, String> = HashMap::new();
    let mut batches = Vec::new();
    loop {
        match c.next(Duration::from_secs(30)).unwrap() {
            Reply::Batch(b) => {
                for s in &b.samples {
                    metadata.insert(s.key.clone(), s.metadata.clone());
                }
                c.release(b.slot).unwrap();
                batches.push(b);
            }
            Reply::EndOfEpoch { .. } => continue,
            Reply::Done => break,
            other => panic!("{other:?}"),
        }
    }
    let skips: HashMap<String, String> = batches
        .iter()
        .flat_map(|b| b.samples.iter())
        .filter_map(|s| Some((s.key.clone(), s.skip.clone()?)))
        .collect();
    assert_eq!(skips.len(), 4, "{skips:?}");
    assert_eq!(skips["missing.jpg"], "not_found");
    assert_eq!(skips["page.jpg"], "unsupported");
    assert!(
        ["corrupt", "truncated"].contains(&skips["garbage.jpg"].as_str()),
        "{skips:?}"
    );
    assert!(
        ["corrupt", "truncated"].contains(&skips["truncated.jpg"].as_str()),
        "{skips:?}"
    );
    let meta: serde_json::Value = serde_json::from_str(&metadata["img-0002.jpg"]).unwrap();
    assert_eq!(meta["caption"], "image 2");
    assert_eq!(meta["label"], 2);
    let text = http::blocking::get(sc.http, "/metrics").unwrap().1;
    assert_eq!(
        metric(
            &text,
            "stoker_sidecar_samples_skipped_total{reason=\"not_found\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&text, "stoker_sidecar_samples_delivered_total"),
        10.0
    );
}

/// Sets the `stoker.dev/local-share` annotation on a pod, as the operator's autoscaler does.
fn annotate_share(rt: &tokio::runtime::Runtime, pods: &Api<Pod>, pod: &str, share: &str) {
    let patch =
        serde_json::json!({ "metadata": { "annotations": { "stoker.dev/local-share": share } } });
    rt.block_on(pods.patch(pod, &PatchParams::default(), &Patch::Merge(&patch)))
        .expect("annotate trainer pod");
}

fn eventually_share(sc: &SidecarProc, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = http::blocking::get(sc.http, "/local-share").unwrap().1;
        if got.trim() == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "local share {got:?}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn readiness_metrics_and_the_local_share_from_the_pods_annotation() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 40, 64, 48);
    let w = decode_worker(&server);
    // The sidecar's own pod on a real API server: the operator changes the share there.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cp = ControlPlane::shared();
    let ns = rt.block_on(cp.namespace("sidecar-share"));
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let trainer: Pod = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "trainer-0" },
        "spec": {
            "securityContext": restricted_pod_security(1000),
            "containers": [{ "name": "train", "image": "trainer:test",
                             "securityContext": restricted_container_security() }]
        }
    }))
    .unwrap();
    rt.block_on(pods.create(&PostParams::default(), &trainer))
        .expect("trainer pod");
    let sc = sidecar_with_env(
        &server,
        dir.path(),
        &[&w],
        &[
            "--prefetch-batches",
            "2",
            "--pod-name",
            "trainer-0",
            "--workers-namespace",
            &ns.name,
        ],
        &[("KUBECONFIG", cp.kubeconfig_path().as_os_str())],
    );
    assert_eq!(
        http::blocking::get(sc.http, "/readyz").unwrap().0,
        200,
        "ready once the socket listens"
    );
    let mut c = sc.connect();
    assert!(!c.hello.gpu.available, "no GPU on CI machines");
    assert_eq!(c.hello.gpu.placement, "off");
    assert!(c.hello.gpu.reason.is_some());
    for _ in 0..3 {
        let Reply::Batch(b) = c.next(Duration::from_secs(30)).unwrap() else {
            panic!()
        };
        assert_eq!(b.route, "remote");
        c.release(b.slot).unwrap();
    }
    // Nothing on the network may change the share; the pod's annotation does, within 0..=1.
    assert_eq!(
        http::blocking::request("PUT", sc.http, "/local-share", "1")
            .unwrap()
            .0,
        405
    );
    assert_eq!(
        http::blocking::get(sc.http, "/local-share")
            .unwrap()
            .1
            .trim(),
        "0"
    );
    annotate_share(&rt, &pods, "trainer-0", "1.5");
    annotate_share(&rt, &pods, "trainer-0", "0.5");
    eventually_share(&sc, "0.5");
    annotate_share(&rt, &pods, "trainer-0", "1");
    eventually_share(&sc, "1");
    // Batches already prefetched may still come from the worker; after them, all are local.
    let mut routes = Vec::new();
    for _ in 0..7 {
        let Reply::Batch(b) = c.next(Duration::from_secs(30)).unwrap() else {
            panic!()
        };
        routes.push(b.route.clone());
        c.release(b.slot).unwrap();
    }
    assert_eq!(
        routes.last().map(String::as_str),
        Some("local"),
        "{routes:?}"
    );
    let text = http::blocking::get(sc.http, "/metrics").unwrap().1;
    assert!(
        text.contains("stoker_trainer_data_wait_seconds_total"),
        "{text}"
    );
    assert_eq!(
        metric(&text, "stoker_sidecar_batches_delivered_total"),
        10.0
    );
    assert!(
        metric(
            &text,
            "stoker_sidecar_batches_decoded_total{route=\"local\"}"
        ) >= 1.0
    );
    assert!(metric(&text, "stoker_sidecar_bytes_received_total") > 0.0);
    assert_eq!(metric(&text, "stoker_sidecar_local_share"), 1.0);

    // SIGTERM (the pod stops): the sidecar exits cleanly and removes its socket and ring.
    let mut sc = sc;
    unsafe {
        libc::kill(sc.proc.pid(), libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = sc.proc.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "sidecar did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(!sc.socket.exists(), "socket removed");
    assert!(!sc.shm.exists(), "ring file removed");
}

#[test]
fn a_hung_decode_worker_costs_at_most_the_batch_timeout() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let keys = dataset(&server, 60, 640, 480);
    let mut hung = decode_worker(&server);
    let healthy = decode_worker(&server);
    let sc = sidecar(
        &server,
        dir.path(),
        &[&hung, &healthy],
        &[
            "--batch-timeout-secs",
            "2",
            "--prefetch-batches",
            "4",
            "--no-local-fallback",
        ],
    );
    let mut client = sc.connect();
    let mut gaps = Vec::new();
    let mut last = Instant::now();
    let pid = hung.proc.pid();
    let epoch = consume_epoch(&mut client, |i, _| {
        gaps.push(last.elapsed());
        if i == 2 {
            // SIGSTOP: the connection stays open and requests get no answer, unlike kill -9.
            unsafe {
                libc::kill(pid, libc::SIGSTOP);
            }
        }
        last = Instant::now();
    });
    unsafe {
        libc::kill(pid, libc::SIGCONT);
    }
    hung.proc.kill9();
    let mut got = epoch.keys();
    got.sort();
    assert_eq!(got, keys, "every sample exactly once");
    let worst = gaps.iter().max().copied().unwrap_or_default();
    eprintln!("worst wait between batches with a hung worker: {worst:?}");
    assert!(
        worst < Duration::from_secs(2 + 4),
        "stall {worst:?} is not bounded by the 2 s timeout"
    );
    assert!(sc.metric("stoker_sidecar_retries_total{reason=\"timeout\"}") >= 1.0);
}

#[test]
fn one_sidecar_serves_several_local_ranks_with_their_own_rings() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let keys = dataset(&server, 24, 64, 48);
    let w = decode_worker(&server);
    // Ranks 0 and 1 of a world of 2, in one pod (torchrun --nproc-per-node 2).
    let sc = sidecar(
        &server,
        dir.path(),
        &[&w],
        &["--world-size", "2", "--local-ranks", "2", "--epochs", "1"],
    );
    assert_eq!(sc.sockets.len(), 2);
    assert!(sc.sockets[1].ends_with("stoker-1.sock"), "{:?}", sc.sockets);
    let epochs: Vec<Epoch> = std::thread::scope(|s| {
        let handles: Vec<_> = sc
            .sockets
            .iter()
            .enumerate()
            .map(|(i, path)| {
                s.spawn(move || {
                    let mut c = TrainerClient::connect(path, Duration::from_secs(60)).unwrap();
                    assert_eq!(c.hello.rank, i as u32);
                    consume_epoch(&mut c, |_, _| {})
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(epochs[0].batches.len(), epochs[1].batches.len());
    let mut all: Vec<String> = epochs.iter().flat_map(Epoch::keys).collect();
    all.sort();
    assert_eq!(all, keys, "the two local ranks split the dataset");
    let text = http::blocking::get(sc.http, "/metrics").unwrap().1;
    assert!(
        text.contains("stoker_trainer_data_wait_seconds_total{rank=\"1\"}"),
        "{text}"
    );
}

/// A ring larger than the shared memory is refused at start with the sizes, never a SIGBUS
/// mid-epoch when a write reaches past a full tmpfs.
#[test]
fn a_ring_that_cannot_fit_is_refused_at_start() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 8, 96, 64);
    // 10 slots of 1 TB: no shm dir holds that.
    let said = sidecar_refusal(&server, dir.path(), &["--slot-bytes", "1000000000000"]);
    assert!(said.contains("the rings need"), "{said}");
    assert!(said.contains("trainer.sharedMemory"), "{said}");
}

/// Takes `k` batches, releasing each: their keys, and the resume position after the last.
fn take_batches(client: &mut TrainerClient, k: usize) -> (Vec<String>, u64) {
    let mut keys = Vec::new();
    let mut position = 0;
    for _ in 0..k {
        match client.next(Duration::from_secs(60)).expect("next") {
            Reply::Batch(b) => {
                keys.extend(b.samples.iter().map(|s| s.key.clone()));
                position = b.position;
                client.release(b.slot).expect("release");
            }
            other => panic!("unexpected reply {other:?}"),
        }
    }
    (keys, position)
}

/// Elastic training: a job of 4 ranks checkpoints after 3 batches and comes back as 3 ranks,
/// on the same sidecar. The rest of that epoch, and the next epoch, reach the trainers exactly
/// once each.
#[test]
fn a_checkpoint_resumes_over_a_new_world_size_exactly_once() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let keys = dataset(&server, 144, 32, 24);
    let flags = [
        "--world-size",
        "4",
        "--local-ranks",
        "4",
        "--batch-size",
        "4",
    ];
    let sc = sidecar(&server, dir.path(), &[], &flags);
    let before: Vec<(Vec<String>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (sc.sockets.iter())
            .map(|path| {
                s.spawn(move || {
                    let mut c = TrainerClient::connect(path, Duration::from_secs(60)).unwrap();
                    take_batches(&mut c, 3)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let positions: HashSet<u64> = before.iter().map(|(_, p)| *p).collect();
    assert_eq!(
        positions,
        HashSet::from([48]),
        "every rank saves the same point"
    );
    let after: Vec<(Epoch, Epoch)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3u32)
            .map(|rank| {
                let path = &sc.sockets[rank as usize];
                s.spawn(move || {
                    let shard = Shard {
                        rank,
                        world_size: 3,
                    };
                    let mut c =
                        TrainerClient::connect_as(path, Duration::from_secs(60), Some(shard))
                            .unwrap();
                    assert_eq!((c.hello.rank, c.hello.world_size), (rank, 3));
                    let seeked = c.seek(0, 48).unwrap();
                    assert!(
                        matches!(seeked, Reply::Seeked { batches: 8, .. }),
                        "{seeked:?}"
                    );
                    let rest = consume_epoch(&mut c, |_, _| {});
                    let next = consume_epoch(&mut c, |_, _| {});
                    (rest, next)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut epoch0: Vec<String> = before.iter().flat_map(|(k, _)| k.clone()).collect();
    epoch0.extend(after.iter().flat_map(|(rest, _)| rest.keys()));
    epoch0.sort();
    assert_eq!(
        epoch0, keys,
        "epoch 0: every sample once across 4 then 3 ranks"
    );
    let mut epoch1: Vec<String> = after.iter().flat_map(|(_, next)| next.keys()).collect();
    epoch1.sort();
    assert_eq!(epoch1, keys, "epoch 1: every sample once across 3 ranks");
}

/// A checkpoint of another order (another seed) is refused with the field named, and the
/// stream goes on as before.
#[test]
fn a_checkpoint_of_another_order_is_refused() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 12, 32, 24);
    let sc = sidecar(&server, dir.path(), &[], &["--batch-size", "4"]);
    let mut c = sc.connect();
    c.hello.seed += 1;
    match c.seek(0, 4).unwrap() {
        Reply::Error { message } => assert!(message.contains("seed"), "{message}"),
        other => panic!("a foreign checkpoint was accepted: {other:?}"),
    }
    assert_eq!(consume_epoch(&mut c, |_, _| {}).keys().len(), 12);
}

/// A pod that knows its node rank but not the world size (an Indexed Job without WORLD_SIZE)
/// still starts; its trainers say their ranks when they connect, and those decide the shards.
#[test]
fn a_sidecar_without_the_world_size_takes_the_trainers_ranks() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let keys = dataset(&server, 16, 32, 24);
    let flags = [
        "--node-rank",
        "1",
        "--local-ranks",
        "2",
        "--batch-size",
        "2",
    ];
    let sc = sidecar(&server, dir.path(), &[], &flags);
    let mut seen: Vec<String> = Vec::new();
    for (i, path) in sc.sockets.iter().enumerate() {
        let shard = Shard {
            rank: 2 + i as u32,
            world_size: 4,
        };
        let mut c = TrainerClient::connect_as(path, Duration::from_secs(60), Some(shard)).unwrap();
        let epoch = consume_epoch(&mut c, |_, _| {});
        assert_eq!(
            epoch.batches.len(),
            2,
            "16 samples over 4 ranks, batches of 2"
        );
        seen.extend(epoch.keys());
    }
    let distinct: HashSet<&String> = seen.iter().collect();
    assert_eq!(distinct.len(), 8, "ranks 2 and 3 get disjoint halves");
    assert!(seen.iter().all(|k| keys.contains(k)));
}

/// Takes the rest of an epoch through waits longer than one `next`'s timeout (a slow source):
/// the keys delivered and the skips.
fn consume_epoch_patiently(client: &mut TrainerClient) -> (Vec<String>, Vec<String>) {
    let (mut keys, mut skips) = (Vec::new(), Vec::new());
    loop {
        match client.next(Duration::from_secs(30)).expect("next") {
            Reply::Batch(b) => {
                for s in &b.samples {
                    match &s.skip {
                        Some(reason) => skips.push(format!("{} {reason}", s.key)),
                        None => keys.push(s.key.clone()),
                    }
                }
                client.release(b.slot).expect("release");
            }
            Reply::Timeout => {}
            Reply::EndOfEpoch { .. } => return (keys, skips),
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

/// S3 throttles every GET for 60 s mid-epoch, then recovers: the batches it failed are decoded
/// again, and the epoch reaches the trainer whole, every sample once, none skipped.
#[test]
fn an_s3_outage_loses_and_duplicates_nothing() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    let mut keys = dataset(&server, 32, 32, 24);
    keys.sort();
    let w = decode_worker(&server);
    let flags = ["--batch-size", "4", "--prefetch-batches", "2"];
    let sc = sidecar(&server, dir.path(), &[&w], &flags);
    let mut c = sc.connect();
    let (mut seen, _) = take_batches(&mut c, 1);
    server.fail_gets_for(Duration::from_secs(60), 503);
    let (rest, skips) = consume_epoch_patiently(&mut c);
    seen.extend(rest);
    seen.sort();
    assert!(skips.is_empty(), "samples skipped for S3's sake: {skips:?}");
    assert_eq!(seen, keys, "every sample once across the outage");
    assert!(server.failures_injected() > 0, "the outage happened");
    assert!(sc.metric("stoker_sidecar_retries_total{reason=\"source\"}") >= 1.0);
}

/// Every GET is refused (a revoked key): the trainer hears `source_unavailable` naming the
/// object within 30 s, never a batch with its samples missing, and a Warning Event on the
/// DataPipeline says so.
#[test]
fn refused_access_stops_delivery_with_the_cause() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path().join("s3")).unwrap();
    dataset(&server, 8, 32, 24);
    server.fail_gets_for(Duration::from_secs(3600), 403);
    let w = decode_worker(&server);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cp = ControlPlane::shared();
    let ns = rt.block_on(cp.namespace("sidecar-source"));
    let flags = [
        "--batch-size",
        "4",
        "--pipeline",
        "laion",
        "--pipeline-uid",
        "5d1c0c1e-0000-4000-8000-000000000001",
        "--workers-namespace",
        &ns.name,
    ];
    let kubeconfig = [("KUBECONFIG", cp.kubeconfig_path().as_os_str())];
    let sc = sidecar_with_env(&server, dir.path(), &[&w], &flags, &kubeconfig);
    let mut c = sc.connect();
    let t0 = Instant::now();
    match c.next(Duration::from_secs(30)).expect("next") {
        Reply::SourceUnavailable { message } => {
            assert!(message.contains("s3://data/"), "{message}");
            assert!(message.contains("access refused"), "{message}");
        }
        other => panic!("expected source_unavailable, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert!(
        matches!(
            c.next(Duration::from_secs(1)).expect("next"),
            Reply::SourceUnavailable { .. }
        ),
        "it stays unavailable"
    );
    assert_eq!(sc.metric("stoker_sidecar_source_unavailable"), 1.0);
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(ns.client.clone(), &ns.name);
    wait_until(
        "the SourceUnavailable event",
        Duration::from_secs(20),
        || {
            let list = rt
                .block_on(events.list(&Default::default()))
                .expect("events");
            list.items.iter().any(|e| {
                let about = e.regarding.as_ref();
                e.reason.as_deref() == Some("SourceUnavailable")
                    && e.type_.as_deref() == Some("Warning")
                    && about.and_then(|r| r.name.as_deref()) == Some("laion")
                    && about.and_then(|r| r.kind.as_deref()) == Some("DataPipeline")
                    && e.note
                        .as_deref()
                        .is_some_and(|n| n.contains("access refused"))
            })
        },
    );
}
