//! A real Prometheus server (Debian's `prometheus`, installed by scripts/deps.sh) on loopback,
//! scraping what a production Prometheus would: every loader process's `/metrics` and every
//! node's node-exporter NIC counters, found through the file_sd files the node runtime keeps
//! current ([`crate::runtime::NodeRuntime::sd_dir`]).

use crate::process::Component;
use anyhow::{Context, Result, bail};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How to start Prometheus.
#[derive(Clone, Debug)]
pub struct PrometheusOptions {
    /// Directory holding `loaders.json` and `nodes.json` (file_sd target groups).
    pub sd_dir: PathBuf,
    /// 1s for tests, 2s for the demo.
    pub scrape_interval: Duration,
    /// The `prometheus` binary; `None`: `$STOKER_PROMETHEUS_BIN`, else `prometheus` on PATH.
    pub binary: Option<PathBuf>,
}

impl PrometheusOptions {
    pub fn new(sd_dir: impl Into<PathBuf>) -> Self {
        Self {
            sd_dir: sd_dir.into(),
            scrape_interval: Duration::from_secs(1),
            binary: None,
        }
    }
}

pub struct Prometheus {
    addr: SocketAddr,
    component: Mutex<Option<Component>>,
    dir: Mutex<Option<tempfile::TempDir>>,
    log: PathBuf,
}

/// Scrape configuration for the two jobs: `stoker-loaders` and `node-exporter`.
pub fn config_yaml(sd_dir: &Path, interval: Duration) -> String {
    let secs = interval.as_secs().max(1);
    format!(
        "global:\n  scrape_interval: {secs}s\n  scrape_timeout: {secs}s\n  evaluation_interval: {secs}s\n\
         scrape_configs:\n\
         - job_name: stoker-loaders\n  file_sd_configs:\n  - files: ['{loaders}']\n    refresh_interval: {secs}s\n\
         - job_name: node-exporter\n  file_sd_configs:\n  - files: ['{nodes}']\n    refresh_interval: {secs}s\n",
        loaders = sd_dir.join("loaders.json").display(),
        nodes = sd_dir.join("nodes.json").display(),
    )
}

impl Prometheus {
    /// Starts Prometheus on a free loopback port and waits until it is ready.
    pub fn start(options: PrometheusOptions) -> Result<Prometheus> {
        let binary = options
            .binary
            .clone()
            .or_else(|| {
                std::env::var("STOKER_PROMETHEUS_BIN")
                    .ok()
                    .map(PathBuf::from)
            })
            .unwrap_or_else(|| PathBuf::from("prometheus"));
        let dir = tempfile::Builder::new()
            .prefix("stoker-prometheus-")
            .tempdir()?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            config_yaml(&options.sd_dir, options.scrape_interval),
        )?;
        let port = crate::net::free_port()?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let component = Component::start(
            "prometheus",
            &binary,
            &[
                format!("--config.file={}", config.display()),
                format!("--storage.tsdb.path={}", dir.path().join("data").display()),
                format!("--web.listen-address={addr}"),
                "--storage.tsdb.retention.time=1d".into(),
                "--web.enable-lifecycle".into(),
                "--log.level=warn".into(),
            ],
            dir.path(),
        )
        .with_context(|| {
            format!(
                "starting {} (installed? see scripts/deps.sh)",
                binary.display()
            )
        })?;
        let log = component.log.clone();
        let prometheus = Prometheus {
            addr,
            component: Mutex::new(Some(component)),
            dir: Mutex::new(Some(dir)),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if crate::http::blocking::get(addr, "/-/ready").is_ok_and(|(status, _)| status == 200) {
                return Ok(prometheus);
            }
            let exited = prometheus
                .component
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                .and_then(|c| c.exited());
            if let Some(status) = exited {
                bail!(
                    "prometheus exited ({status}):\n{}",
                    crate::process::tail(&prometheus.log, 30)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "prometheus not ready after 60s:\n{}",
                    crate::process::tail(&prometheus.log, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// One Prometheus per process for `sd_dir`, started on first use, stopped at exit.
    pub fn shared(options: impl FnOnce() -> PrometheusOptions) -> &'static Prometheus {
        static SHARED: OnceLock<Result<Prometheus, String>> = OnceLock::new();
        extern "C" fn stop_shared() {
            if let Some(Ok(p)) = SHARED.get() {
                p.stop();
            }
        }
        let result = SHARED.get_or_init(|| {
            let options = options();
            // Started from a thread of its own like the control plane: the spawner thread holds
            // PDEATHSIG, so this only keeps start-up off the test's runtime.
            let started = std::thread::spawn(move || {
                Prometheus::start(options).map_err(|e| format!("{e:#}"))
            })
            .join()
            .unwrap_or_else(|_| Err("prometheus start-up panicked".into()));
            if started.is_ok() {
                // SAFETY: registers a plain function to run at exit.
                unsafe { libc::atexit(stop_shared) };
            }
            started
        });
        match result {
            Ok(p) => p,
            Err(e) => panic!("prometheus failed to start: {e}"),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        crate::process::tail(&self.log, lines)
    }

    /// An instant query through `/api/v1/query`: the `data.result` array.
    pub async fn query(&self, promql: &str) -> Result<Vec<serde_json::Value>> {
        let query =
            percent_encoding::utf8_percent_encode(promql, percent_encoding::NON_ALPHANUMERIC);
        let path = format!("/api/v1/query?query={query}");
        let (status, body) = crate::http::get(self.addr, &path).await?;
        let json: serde_json::Value =
            serde_json::from_str(&body).with_context(|| format!("prometheus answered: {body}"))?;
        if status != 200 || json["status"] != "success" {
            bail!("query {promql}: HTTP {status}: {body}");
        }
        Ok(json["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Stops the server and removes its data. Idempotent.
    pub fn stop(&self) {
        if let Some(mut c) = self
            .component
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            c.stop(Duration::from_secs(5));
        }
        self.dir.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}
