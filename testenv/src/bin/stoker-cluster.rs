//! The test control plane, for a person: `stoker-cluster up` starts it and writes a kubeconfig,
//! `stoker-cluster down` stops it.
//!
//!   stoker-cluster up [--background]   # foreground until Ctrl-C, or detached
//!   stoker-cluster down
//!   KUBECONFIG=~/.cache/stoker/dev-cluster/kubeconfig kubectl get nodes

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use stoker_testenv::cluster::{ControlPlane, Options};

#[derive(Parser)]
#[command(about = "A local Kubernetes control plane with simulated GPU and CPU nodes")]
struct Cli {
    /// Where the cluster keeps its kubeconfig, certificates, etcd data and logs.
    #[arg(long, global = true, env = "STOKER_CLUSTER_DIR")]
    dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the cluster (in the foreground unless --background).
    Up {
        /// Detach, wait until the cluster is ready, and return.
        #[arg(long)]
        background: bool,
    },
    /// Stop a cluster started with `up`.
    Down,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let dir = cli
        .dir
        .unwrap_or_else(|| stoker_testenv::cluster::bin_dir().with_file_name("dev-cluster"));
    match cli.command {
        Cmd::Up { background: false } => up(&dir),
        Cmd::Up { background: true } => up_background(&dir),
        Cmd::Down => down(&dir),
    }
}

fn pid_file(dir: &Path) -> PathBuf {
    dir.join("cluster.pid")
}

/// The pid of a cluster already running from `dir`, if any.
fn running(dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(dir))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: signal 0 only checks that the process exists.
    (unsafe { libc::kill(pid, 0) } == 0).then_some(pid)
}

fn print_ready(dir: &Path) {
    let kubeconfig = dir.join("kubeconfig");
    println!("cluster ready: 4 GPU nodes and 8 CPU nodes (KWOK)");
    println!("  export KUBECONFIG={}", kubeconfig.display());
    println!(
        "  kubectl get nodes        # kubectl from {}",
        stoker_testenv::cluster::bin_dir().display()
    );
    println!("  logs: {}", dir.join("logs").display());
}

fn up(dir: &Path) -> Result<()> {
    if let Some(pid) = running(dir) {
        println!(
            "a cluster is already running from {} (pid {pid})",
            dir.display()
        );
        print_ready(dir);
        return Ok(());
    }
    // A fresh cluster each time: old certificates and etcd data would not match.
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clean {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let cp = ControlPlane::start(Options {
        dir: Some(dir.to_path_buf()),
        ..Default::default()
    })?;
    std::fs::write(pid_file(dir), std::process::id().to_string())?;
    print_ready(dir);
    println!("Ctrl-C stops it");

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    println!("stopping the cluster");
    cp.stop();
    let _ = std::fs::remove_file(pid_file(dir));
    Ok(())
}

fn up_background(dir: &Path) -> Result<()> {
    if let Some(pid) = running(dir) {
        println!(
            "a cluster is already running from {} (pid {pid})",
            dir.display()
        );
        print_ready(dir);
        return Ok(());
    }
    let log_path = dir.with_extension("log");
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--dir")
        .arg(dir)
        .arg("up")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // Its own session, so that the shell's Ctrl-C or hang-up does not reach it.
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + Duration::from_secs(180);
    while running(dir).is_none() {
        if let Some(status) = child.try_wait()? {
            bail!("cluster exited ({status}); see {}", log_path.display());
        }
        if Instant::now() > deadline {
            bail!("cluster not ready after 180s; see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    print_ready(dir);
    println!("  stop it with: scripts/cluster.sh down");
    Ok(())
}

fn down(dir: &Path) -> Result<()> {
    let Some(pid) = running(dir) else {
        println!("no cluster running from {}", dir.display());
        return Ok(());
    };
    // SAFETY: plain kill(2) of the pid the cluster recorded.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while running(dir).is_some() {
        if Instant::now() > deadline {
            bail!("cluster (pid {pid}) still running after 60s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("cluster stopped");
    Ok(())
}
