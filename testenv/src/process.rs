//! Child processes that never outlive the process that started them.
//!
//! Every component is spawned from one long-lived thread with `PR_SET_PDEATHSIG`, so the kernel
//! kills it when that thread ends: at normal exit, on panic and on `kill -9` of the test binary
//! alike. (The signal follows the spawning *thread*, which is why a test thread must not spawn.)

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("stoker-testenv-spawner".into())
            .spawn(move || {
                // Lives as long as the process: the static sender is never dropped.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn the spawner thread");
        tx
    })
}

/// A running component whose output goes to a log file. Dropping it kills it.
pub struct Component {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Component {
    /// Starts `program` with `args`, stdout and stderr appended to `log_dir/<name>.log`.
    pub fn start(name: &str, program: &Path, args: &[String], log_dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log)?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        spawner()
            .send((cmd, tx))
            .map_err(|_| io::Error::other("spawner thread is gone"))?;
        let child = rx
            .recv()
            .map_err(|_| io::Error::other("spawner thread is gone"))??;
        Ok(Self {
            name: name.to_string(),
            log,
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last `lines` lines of the component's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// The last `lines` lines of a file (reads at most its last 256 KiB).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(256 * 1024)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
