//! A trainer-side client in Rust (the Python package is the main one): used by tests and
//! benches, and a reference for other languages.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use memmap2::Mmap;

use super::plan::Shard;
use super::protocol::{BatchHeader, HelloInfo, Reply, Request};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("sidecar socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("talking to the sidecar: {source}")]
    Io {
        #[from]
        source: std::io::Error,
    },
    #[error("the sidecar closed the connection")]
    Closed,
    #[error("unexpected reply from the sidecar: {detail}")]
    Protocol { detail: String },
}

impl ClientError {
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } => "connect",
            ClientError::Io { .. } => "io",
            ClientError::Closed => "closed",
            ClientError::Protocol { .. } => "protocol",
        }
    }
}

pub struct TrainerClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    pub hello: HelloInfo,
    ring: Mmap,
}

impl TrainerClient {
    /// Connects, says hello and maps the ring read-only.
    pub fn connect(socket: &Path, io_timeout: Duration) -> Result<Self, ClientError> {
        Self::connect_as(socket, io_timeout, None)
    }

    /// Connects as trainer `rank` of `world_size` (`None`: the sidecar's own).
    pub fn connect_as(
        socket: &Path,
        io_timeout: Duration,
        shard: Option<Shard>,
    ) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
            path: socket.display().to_string(),
            source,
        })?;
        stream.set_read_timeout(Some(io_timeout))?;
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let hello = match call(
            &mut reader,
            &mut writer,
            &Request::Hello {
                rank: shard.map(|s| s.rank),
                world_size: shard.map(|s| s.world_size),
            },
        )? {
            Reply::Hello(h) => h,
            other => {
                return Err(ClientError::Protocol {
                    detail: format!("{other:?}"),
                });
            }
        };
        let file = std::fs::File::open(&hello.shm_path)?;
        // SAFETY: the sidecar writes a slot only before handing it over and after it is
        // released, so the bytes of a held slot do not change while we read them.
        let ring = unsafe { Mmap::map(&file)? };
        Ok(TrainerClient {
            reader,
            writer,
            hello,
            ring,
        })
    }

    fn call(&mut self, req: &Request) -> Result<Reply, ClientError> {
        call(&mut self.reader, &mut self.writer, req)
    }

    pub fn next(&mut self, timeout: Duration) -> Result<Reply, ClientError> {
        self.call(&Request::Next {
            timeout_ms: Some(timeout.as_millis() as u64),
        })
    }

    /// Restarts the stream at a resume point of this pipeline's order.
    pub fn seek(&mut self, epoch: u64, position: u64) -> Result<Reply, ClientError> {
        let req = Request::Seek {
            epoch,
            position,
            seed: self.hello.seed,
            batch_size: self.hello.batch_size,
            samples: self.hello.samples,
        };
        self.call(&req)
    }

    pub fn release(&mut self, slot: u32) -> Result<(), ClientError> {
        send(&mut self.writer, &Request::Release { slot })
    }

    /// The pixels of sample `i` of a held batch.
    pub fn pixels<'a>(&'a self, batch: &BatchHeader, i: usize) -> &'a [u8] {
        let s = &batch.samples[i];
        let len = s.shape.iter().map(|&d| d as usize).product::<usize>();
        let start = batch.slot_offset as usize + s.offset as usize;
        self.ring.get(start..start + len).unwrap_or(&[])
    }
}

fn send(writer: &mut UnixStream, req: &Request) -> Result<(), ClientError> {
    let mut text = serde_json::to_string(req).map_err(|e| ClientError::Protocol {
        detail: e.to_string(),
    })?;
    text.push('\n');
    writer.write_all(text.as_bytes())?;
    Ok(())
}

fn call(
    reader: &mut BufReader<UnixStream>,
    writer: &mut UnixStream,
    req: &Request,
) -> Result<Reply, ClientError> {
    send(writer, req)?;
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(ClientError::Closed);
    }
    serde_json::from_str(&line).map_err(|e| ClientError::Protocol {
        detail: format!("{e}: {line}"),
    })
}
