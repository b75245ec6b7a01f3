//! `stoker-s3`: the test S3 server as a process, for benches and the demo.
//! `stoker-s3 --root DIR --port 9000 --access-key AK --secret-key SK`

use clap::Parser;
use stoker_testenv::s3::{DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY, S3Server, S3ServerConfig};

#[derive(Debug, Parser)]
#[command(about = "S3 server (s3s-fs) on loopback with SigV4 checked and TCP_NODELAY set")]
struct Args {
    /// Directory holding buckets (one sub-directory each).
    #[arg(long)]
    root: std::path::PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 9000)]
    port: u16,
    #[arg(long, env = "STOKER_S3_ACCESS_KEY", default_value = DEFAULT_ACCESS_KEY)]
    access_key: String,
    #[arg(long, env = "STOKER_S3_SECRET_KEY", default_value = DEFAULT_SECRET_KEY, hide_env_values = true)]
    secret_key: String,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let server = S3Server::start_with(S3ServerConfig {
        root: args.root,
        host: args.host,
        port: args.port,
        access_key: args.access_key,
        secret_key: args.secret_key,
    })?;
    // The listening line is what scripts wait for.
    println!("stoker-s3 listening on {}", server.endpoint());
    server.wait();
    Ok(())
}
