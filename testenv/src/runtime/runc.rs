//! One container run by `runc`: `runc run --detach` with the container's output going to its log
//! file, the container's init process reaped by this process, then `runc delete`.
//!
//! The runtime's process is a child subreaper (`PR_SET_CHILD_SUBREAPER`): `runc run --detach`
//! exits once the container runs, and its init process is re-parented here, so `waitpid` gives
//! the container's exit status, and the container's cgroup still exists at that moment to tell
//! an out-of-memory kill by the kernel (`oom_kill` in `memory.oom_control` on cgroup v1,
//! `memory.events` on v2) from any other SIGKILL. A side effect: other orphaned grandchildren
//! of the test process are re-parented here too and stay zombies until it exits.

use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How a container's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exit {
    /// The exit code, 128 + signal when killed.
    pub code: i32,
    /// Killed by the kernel for exceeding its memory limit.
    pub oom_killed: bool,
}

/// Makes this process the reaper of its orphaned descendants (once).
pub fn become_subreaper() -> Result<()> {
    // SAFETY: prctl(2) with PR_SET_CHILD_SUBREAPER takes an integer flag.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        bail!(
            "prctl(PR_SET_CHILD_SUBREAPER): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// `runc --root <root>`: where runc keeps the state of this runtime's containers.
fn runc(root: &Path) -> Command {
    let mut cmd = Command::new("runc");
    cmd.arg("--root").arg(root);
    cmd
}

/// Removes every container left under `root` (by a runtime that was killed).
pub fn remove_all(root: &Path) {
    let Ok(out) = runc(root).args(["list", "-q"]).output() else {
        return;
    };
    for id in String::from_utf8_lossy(&out.stdout).lines() {
        let _ = runc(root).args(["delete", "-f", id]).output();
    }
}

/// The cgroup directory of `path` for one controller (v1) or the unified hierarchy (v2).
fn cgroup_file(controller: &str, path: &str, file: &str) -> PathBuf {
    let base = Path::new("/sys/fs/cgroup");
    let rel = path.trim_start_matches('/');
    if base.join("cgroup.controllers").exists() {
        base.join(rel).join(file)
    } else {
        base.join(controller).join(rel).join(file)
    }
}

/// Removes cgroup `path` and everything below it (empty cgroups; runc removed the containers').
pub fn remove_cgroup(path: &str) {
    let rel = path.trim_start_matches('/');
    let roots: Vec<PathBuf> = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        vec![PathBuf::from("/sys/fs/cgroup")]
    } else {
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect()
    };
    for root in roots {
        let dir = root.join(rel);
        // Children first: rmdir(2) only removes empty cgroups.
        let mut stack = vec![dir.clone()];
        let mut order = Vec::new();
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
            order.push(d);
        }
        for d in order.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// CPU time used by the processes of cgroup `path` so far.
pub fn cpu_usage(path: &str) -> Option<Duration> {
    let v1 = cgroup_file("cpuacct", path, "cpuacct.usage");
    if let Ok(ns) = std::fs::read_to_string(&v1) {
        return ns.trim().parse().ok().map(Duration::from_nanos);
    }
    let v2 = std::fs::read_to_string(cgroup_file("", path, "cpu.stat")).ok()?;
    v2.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_micros)
}

/// The kernel's count of OOM kills in cgroup `path`.
fn oom_kills(path: &str) -> u64 {
    let v1 = std::fs::read_to_string(cgroup_file("memory", path, "memory.oom_control"));
    let v2 = || std::fs::read_to_string(cgroup_file("", path, "memory.events"));
    v1.or_else(|_| v2())
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

pub struct RuncContainer {
    root: PathBuf,
    id: String,
    pid: libc::pid_t,
    cgroup: String,
    exit: Option<Exit>,
}

impl RuncContainer {
    /// Writes `spec` into `bundle` and starts the container; returns once it runs.
    pub fn start(
        root: &Path,
        id: &str,
        bundle: &Path,
        spec: &serde_json::Value,
        log: &Path,
    ) -> Result<RuncContainer> {
        std::fs::create_dir_all(bundle)?;
        std::fs::write(bundle.join("config.json"), serde_json::to_vec_pretty(spec)?)?;
        let _ = runc(root).args(["delete", "-f", id]).output();
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| log.display().to_string())?;
        let pid_file = bundle.join("pid");
        let _ = std::fs::remove_file(&pid_file);
        let status = runc(root)
            .args(["run", "--detach", "--pid-file"])
            .arg(&pid_file)
            .arg("--bundle")
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .status()
            .context("running runc")?;
        if !status.success() {
            let _ = runc(root).args(["delete", "-f", id]).output();
            bail!(
                "runc run {id}: {status}: {}",
                crate::process::tail(log, 5).trim()
            );
        }
        let pid: libc::pid_t = std::fs::read_to_string(&pid_file)?
            .trim()
            .parse()
            .map_err(|_| anyhow!("runc wrote no pid for {id}"))?;
        let cgroup = spec["linux"]["cgroupsPath"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(RuncContainer {
            root: root.to_path_buf(),
            id: id.to_string(),
            pid,
            cgroup,
            exit: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// The container's cgroup path (relative to the cgroup hierarchies' roots).
    pub fn cgroup(&self) -> &str {
        &self.cgroup
    }

    /// How the container ended, once it has (then the container is deleted).
    pub fn exited(&mut self) -> Option<Exit> {
        if self.exit.is_some() {
            return self.exit;
        }
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid(2) on the container's init, re-parented to this process.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        let code = if r == self.pid {
            if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else if libc::WIFSIGNALED(status) {
                128 + libc::WTERMSIG(status)
            } else {
                return None;
            }
        } else if r < 0 && !Path::new(&format!("/proc/{}", self.pid)).exists() {
            // Not our child (the subreaper was not set) and gone: the code is lost.
            255
        } else {
            return None;
        };
        let exit = Exit {
            code,
            oom_killed: oom_kills(&self.cgroup) > 0,
        };
        let _ = runc(&self.root).args(["delete", "-f", &self.id]).output();
        self.exit = Some(exit);
        self.exit
    }

    pub fn signal(&self, signal: libc::c_int) {
        if self.exit.is_none() {
            // SAFETY: kill(2) on the container's init, which this process reaps.
            unsafe { libc::kill(self.pid, signal) };
        }
    }

    /// SIGTERM, SIGKILL after `grace`, then waits and deletes the container.
    pub fn stop(&mut self, grace: Duration) -> Exit {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        loop {
            if let Some(exit) = self.exited() {
                return exit;
            }
            if Instant::now() >= deadline {
                self.signal(libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RuncContainer {
    fn drop(&mut self) {
        if self.exit.is_none() {
            self.signal(libc::SIGKILL);
            let _ = self.stop(Duration::ZERO);
        }
    }
}
