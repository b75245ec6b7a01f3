//! Container images for the runc runtime: an image reference maps to a root filesystem and the
//! image's config (user, entrypoint, command, env, working directory).
//!
//! - [`ImageSource::Oci`]: an OCI archive (`oci-archive`, a tar of an OCI layout) or an OCI
//!   layout directory, unpacked once into the image cache (`index.json` → manifest → config and
//!   layers; layers applied in order with whiteouts) and kept, keyed by the manifest digest.
//!   stoker's own image (from `scripts/image.sh`, under `target/image/`) runs this way.
//! - [`ImageSource::Binaries`]: a stand-in for stoker's image where the archive has not been
//!   built: a root filesystem holding the given binaries under `/usr/local/bin` and the shared
//!   libraries `ldd` names, nothing else (no shell), uid 65532 by default as the image's.
//! - [`ImageSource::HostRootfs`]: **test images only** (trainers running Python from the test
//!   venv, fake GPU tools): an empty root whose `/usr`, `/lib*`, `/bin`, `/sbin`, `/etc` and the
//!   listed paths are bind-mounted read-only from this machine, plus writable directories where
//!   a test reads what the container wrote (a trainer's report). Never used for stoker's images.
//! - [`ImageSource::HostProcess`]: no container at all: the command runs as a root process of
//!   this machine in the node's network namespace (the runtime before runc); kept for tests that
//!   say why they need it.

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Debian's CA bundle, copied into the stand-in image.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// What the image says about how to run it (the OCI image config's `config` object).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `User`: `uid[:gid]` (numeric; names are looked up in the image's `/etc/passwd`).
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `KEY=VALUE` pairs.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
}

impl ImageConfig {
    fn from_oci(config: &Value) -> ImageConfig {
        let c = &config["config"];
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        };
        ImageConfig {
            user: c["User"]
                .as_str()
                .filter(|u| !u.is_empty())
                .map(str::to_string),
            entrypoint: strings(&c["Entrypoint"]),
            cmd: strings(&c["Cmd"]),
            env: strings(&c["Env"]),
            working_dir: c["WorkingDir"]
                .as_str()
                .filter(|w| !w.is_empty())
                .map(str::to_string),
        }
    }
}

/// Where an image's root filesystem comes from.
#[derive(Clone, Debug)]
pub enum ImageSource {
    /// An OCI archive (tar) or OCI layout directory.
    Oci(PathBuf),
    /// A root filesystem of these binaries and their shared libraries (stoker's image before
    /// `scripts/image.sh` has built it). The first binary is the entrypoint.
    Binaries {
        binaries: Vec<PathBuf>,
        config: ImageConfig,
    },
    /// Test images only: this machine's system directories and `binds`, read-only, and
    /// `writable` bound read-write (not in the pod spec: a restricted namespace admits no
    /// hostPath volume).
    HostRootfs {
        binds: Vec<PathBuf>,
        writable: Vec<PathBuf>,
        config: ImageConfig,
    },
    /// Not a container: `command` (then the container's args) as a root process of this
    /// machine; an empty `command` runs the container's own command and args.
    HostProcess(Vec<String>),
}

/// An image ready to run: its root filesystem and config, plus host paths to bind
/// (host-rootfs test images only).
#[derive(Clone, Debug)]
pub struct Image {
    pub rootfs: PathBuf,
    pub config: ImageConfig,
    /// Bound read-only.
    pub host_binds: Vec<PathBuf>,
    /// Bound read-write.
    pub host_writable: Vec<PathBuf>,
}

/// The host directories a host-rootfs test image sees.
const HOST_SYSTEM_DIRS: [&str; 7] = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/etc"];

/// Unpacked images, cached on disk under `dir` and in memory by source.
pub struct ImageStore {
    dir: PathBuf,
    cache: Mutex<BTreeMap<String, Image>>,
}

impl ImageStore {
    pub fn new(dir: impl Into<PathBuf>) -> ImageStore {
        ImageStore {
            dir: dir.into(),
            cache: Mutex::default(),
        }
    }

    /// `~/.cache/stoker/images` (next to the test tools), shared by every runtime.
    pub fn default_dir() -> PathBuf {
        crate::cluster::bin_dir().with_file_name("images")
    }

    /// The image for `source`, unpacking or assembling it on first use. `None` for
    /// [`ImageSource::HostProcess`].
    pub fn get(&self, source: &ImageSource) -> Result<Option<Image>> {
        let key = format!("{source:?}");
        if let Some(found) = self.lock().get(&key) {
            return Ok(Some(found.clone()));
        }
        let image = match source {
            ImageSource::HostProcess(_) => return Ok(None),
            ImageSource::Oci(path) => self.unpack_oci(path)?,
            ImageSource::Binaries { binaries, config } => self.assemble(binaries, config)?,
            ImageSource::HostRootfs {
                binds,
                writable,
                config,
            } => self.host_rootfs(binds, writable, config)?,
        };
        self.lock().insert(key, image.clone());
        Ok(Some(image))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Image>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unpacks an OCI archive or layout once per manifest digest.
    fn unpack_oci(&self, path: &Path) -> Result<Image> {
        let layout = OciLayout::open(path)
            .with_context(|| format!("reading OCI image {}", path.display()))?;
        let manifest_digest = layout.manifest_digest()?;
        let manifest: Value = serde_json::from_slice(&layout.blob(&manifest_digest)?)
            .with_context(|| format!("manifest {manifest_digest}"))?;
        let config_digest = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| anyhow!("manifest {manifest_digest} has no config digest"))?;
        let config: Value = serde_json::from_slice(&layout.blob(config_digest)?)
            .with_context(|| format!("image config {config_digest}"))?;
        let config = ImageConfig::from_oci(&config);
        let dest = self.dir.join(manifest_digest.replace(':', "-"));
        let rootfs = dest.join("rootfs");
        if !dest.join("complete").exists() {
            let staging = self.staging(&dest)?;
            let staged_rootfs = staging.join("rootfs");
            std::fs::create_dir_all(&staged_rootfs)?;
            for layer in manifest["layers"].as_array().into_iter().flatten() {
                let digest = layer["digest"]
                    .as_str()
                    .ok_or_else(|| anyhow!("a layer of {manifest_digest} has no digest"))?;
                let media = layer["mediaType"].as_str().unwrap_or_default();
                let blob = layout.blob(digest)?;
                let reader: Box<dyn Read> =
                    if media.ends_with("gzip") || blob.starts_with(&[0x1f, 0x8b]) {
                        Box::new(flate2::read::GzDecoder::new(&blob[..]))
                    } else {
                        Box::new(&blob[..])
                    };
                apply_layer(reader, &staged_rootfs)
                    .with_context(|| format!("applying layer {digest}"))?;
            }
            std::fs::write(staging.join("complete"), b"")?;
            publish(&staging, &dest)?;
        }
        tracing::info!(image = %path.display(), rootfs = %rootfs.display(), "OCI image ready");
        Ok(Image {
            rootfs,
            config,
            host_binds: Vec::new(),
            host_writable: Vec::new(),
        })
    }

    /// A root filesystem of `binaries` and the libraries they load.
    fn assemble(&self, binaries: &[PathBuf], config: &ImageConfig) -> Result<Image> {
        let mut files: Vec<(PathBuf, PathBuf)> = Vec::new();
        for bin in binaries {
            let name = bin
                .file_name()
                .ok_or_else(|| anyhow!("{} has no file name", bin.display()))?;
            files.push((bin.clone(), Path::new("/usr/local/bin").join(name)));
            for lib in shared_libraries(bin)? {
                files.push((lib.clone(), lib));
            }
        }
        // The CA bundle, as the real image carries Debian's: the loader's S3 client refuses to
        // start without root certificates.
        let bundle = PathBuf::from(CA_BUNDLE);
        if bundle.is_file() {
            files.push((bundle.clone(), bundle));
        }
        // Keyed by what goes in (paths, sizes, modification times), so a rebuilt binary gets
        // a new root filesystem.
        let mut stamp = String::new();
        for (from, _) in &files {
            let meta = std::fs::metadata(from).with_context(|| from.display().to_string())?;
            stamp.push_str(&format!(
                "{}:{}:{:?};",
                from.display(),
                meta.len(),
                meta.modified().ok()
            ));
        }
        let dest = self.dir.join(format!("binaries-{}", short_hash(&stamp)));
        if !dest.join("complete").exists() {
            let staging = self.staging(&dest)?;
            let root = staging.join("rootfs");
            for dir in ["proc", "sys", "dev", "tmp", "etc", "usr/local/bin"] {
                std::fs::create_dir_all(root.join(dir))?;
            }
            std::fs::write(
                root.join("etc/passwd"),
                "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
            )?;
            std::fs::write(root.join("etc/group"), "root:x:0:\nnonroot:x:65532:\n")?;
            for (from, to) in &files {
                let target = root.join(to.strip_prefix("/").unwrap_or(to));
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::copy(from, &target)
                    .with_context(|| format!("copying {} into the image", from.display()))?;
            }
            std::fs::write(staging.join("complete"), b"")?;
            publish(&staging, &dest)?;
        }
        let mut config = config.clone();
        if config.entrypoint.is_empty()
            && let Some(name) = binaries.first().and_then(|b| b.file_name())
        {
            config.entrypoint = vec![format!("/usr/local/bin/{}", name.to_string_lossy())];
        }
        if config.user.is_none() {
            config.user = Some("65532:65532".into());
        }
        Ok(Image {
            rootfs: dest.join("rootfs"),
            config,
            host_binds: Vec::new(),
            host_writable: Vec::new(),
        })
    }

    /// An empty root with mount points for the host's system directories and `binds`.
    fn host_rootfs(
        &self,
        binds: &[PathBuf],
        writable: &[PathBuf],
        config: &ImageConfig,
    ) -> Result<Image> {
        let mut all: Vec<PathBuf> = HOST_SYSTEM_DIRS
            .iter()
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .collect();
        all.extend(binds.iter().cloned());
        let dest = self
            .dir
            .join(format!("host-rootfs-{}", short_hash(&format!("{all:?}"))));
        let root = dest.join("rootfs");
        if !dest.join("complete").exists() {
            let staging = self.staging(&dest)?;
            let staged = staging.join("rootfs");
            for dir in ["proc", "sys", "dev", "tmp"] {
                std::fs::create_dir_all(staged.join(dir))?;
            }
            std::fs::write(staging.join("complete"), b"")?;
            publish(&staging, &dest)?;
        }
        // Mount points (and their parents, 0755 so a non-root user can reach a bind under a
        // 0700 host directory such as /root) are made at run time by runc for absolute
        // destinations; symlinks (/bin → usr/bin) are bound as the directories they point to.
        Ok(Image {
            rootfs: root,
            config: config.clone(),
            host_binds: all,
            host_writable: writable.to_vec(),
        })
    }

    fn staging(&self, dest: &Path) -> Result<PathBuf> {
        let staging = dest.with_extension(format!("partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("creating {}", staging.display()))?;
        Ok(staging)
    }
}

/// Moves a finished staging directory into place; another process that got there first wins.
fn publish(staging: &Path, dest: &Path) -> Result<()> {
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)?;
    }
    if dest.join("complete").exists() {
        let _ = std::fs::remove_dir_all(staging);
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(dest);
    std::fs::rename(staging, dest)
        .with_context(|| format!("moving {} to {}", staging.display(), dest.display()))
}

fn short_hash(text: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(text.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The shared libraries `ldd` reports for a binary (its loader included).
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = std::process::Command::new("ldd")
        .arg(bin)
        .output()
        .with_context(|| format!("ldd {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next(),
                None => line.split_whitespace().next(),
            }?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// An OCI layout read from a directory or from an archive (read into memory: stoker's image is
/// tens of MB).
enum OciLayout {
    Dir(PathBuf),
    Archive(BTreeMap<String, Vec<u8>>),
}

impl OciLayout {
    fn open(path: &Path) -> Result<OciLayout> {
        if path.is_dir() {
            return Ok(OciLayout::Dir(path.to_path_buf()));
        }
        let file = std::fs::File::open(path)?;
        let mut archive = tar::Archive::new(file);
        let mut files = BTreeMap::new();
        for entry in archive.entries()? {
            let mut entry = entry?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let name = entry
                .path()?
                .to_string_lossy()
                .trim_start_matches("./")
                .to_string();
            let mut body = Vec::new();
            entry.read_to_end(&mut body)?;
            files.insert(name, body);
        }
        Ok(OciLayout::Archive(files))
    }

    fn file(&self, name: &str) -> Result<Vec<u8>> {
        match self {
            OciLayout::Dir(dir) => {
                std::fs::read(dir.join(name)).with_context(|| format!("{name} in the OCI layout"))
            }
            OciLayout::Archive(files) => files
                .get(name)
                .cloned()
                .ok_or_else(|| anyhow!("{name} missing from the OCI archive")),
        }
    }

    fn blob(&self, digest: &str) -> Result<Vec<u8>> {
        let (algorithm, hex) = digest
            .split_once(':')
            .ok_or_else(|| anyhow!("bad digest {digest}"))?;
        self.file(&format!("blobs/{algorithm}/{hex}"))
    }

    /// The (first) image manifest of `index.json`, following one level of nested index.
    fn manifest_digest(&self) -> Result<String> {
        let index: Value = serde_json::from_slice(&self.file("index.json")?)?;
        let first = |index: &Value| -> Result<(String, String)> {
            let m = index["manifests"]
                .as_array()
                .and_then(|m| m.first())
                .ok_or_else(|| anyhow!("index.json lists no manifest"))?;
            Ok((
                m["digest"].as_str().unwrap_or_default().to_string(),
                m["mediaType"].as_str().unwrap_or_default().to_string(),
            ))
        };
        let (digest, media) = first(&index)?;
        if media.ends_with("image.index.v1+json") {
            let nested: Value = serde_json::from_slice(&self.blob(&digest)?)?;
            return Ok(first(&nested)?.0);
        }
        Ok(digest)
    }
}

/// Applies one layer tar to `root`: whiteouts (`.wh.NAME`) delete, opaque markers
/// (`.wh..wh..opq`) empty their directory, everything else is unpacked with its mode and owner.
pub fn apply_layer(reader: impl Read, root: &Path) -> Result<()> {
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let rel: PathBuf = path
            .components()
            .filter(|c| matches!(c, std::path::Component::Normal(_)))
            .collect();
        if path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            bail!("layer entry {} leaves the root", path.display());
        }
        let Some(name) = rel.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        let parent = rel
            .parent()
            .map(|p| root.join(p))
            .unwrap_or(root.to_path_buf());
        if name == ".wh..wh..opq" {
            for child in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
                remove_any(&child.path())?;
            }
            continue;
        }
        if let Some(hidden) = name.strip_prefix(".wh.") {
            remove_any(&parent.join(hidden))?;
            continue;
        }
        let target = root.join(&rel);
        let is_dir = entry.header().entry_type().is_dir();
        if let Ok(meta) = std::fs::symlink_metadata(&target)
            && (meta.is_dir() != is_dir || meta.file_type().is_symlink())
            && !(is_dir && meta.is_dir())
        {
            remove_any(&target)?;
        }
        entry
            .unpack_in(root)
            .with_context(|| format!("unpacking {}", rel.display()))?;
    }
    Ok(())
}

fn remove_any(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path)?,
        Ok(_) => std::fs::remove_file(path)?,
        Err(_) => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(entries: &[(&str, Option<&str>)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, body) in entries {
            let mut header = tar::Header::new_gnu();
            // Owners are numeric fields of their own: unset, the tar crate cannot read them.
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            match body {
                Some(body) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(body.len() as u64);
                    header.set_mode(0o644);
                    header.set_cksum();
                    builder
                        .append_data(&mut header, path, body.as_bytes())
                        .unwrap();
                }
                None => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    header.set_mode(0o755);
                    header.set_cksum();
                    builder.append_data(&mut header, path, &[][..]).unwrap();
                }
            }
        }
        builder.into_inner().unwrap()
    }

    #[test]
    fn layers_apply_in_order_with_whiteouts() {
        let root = tempfile::tempdir().unwrap();
        let lower = layer(&[
            ("etc/", None),
            ("etc/a", Some("1")),
            ("etc/b", Some("2")),
            ("opt/", None),
            ("opt/x", Some("x")),
        ]);
        let upper = layer(&[
            ("etc/.wh.a", Some("")),
            ("etc/b", Some("two")),
            ("opt/.wh..wh..opq", Some("")),
            ("opt/y", Some("y")),
        ]);
        apply_layer(&lower[..], root.path()).unwrap();
        apply_layer(&upper[..], root.path()).unwrap();
        let r = root.path();
        assert!(!r.join("etc/a").exists());
        assert_eq!(std::fs::read_to_string(r.join("etc/b")).unwrap(), "two");
        assert!(!r.join("opt/x").exists());
        assert_eq!(std::fs::read_to_string(r.join("opt/y")).unwrap(), "y");
    }

    #[test]
    fn reads_an_oci_layout() {
        use sha2::Digest;
        let dir = tempfile::tempdir().unwrap();
        let blobs = dir.path().join("blobs/sha256");
        std::fs::create_dir_all(&blobs).unwrap();
        let put = |body: &[u8]| {
            let hex: String = sha2::Sha256::digest(body)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            std::fs::write(blobs.join(&hex), body).unwrap();
            (format!("sha256:{hex}"), body.len())
        };
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &layer(&[("hello", Some("hi"))])).unwrap();
        let (layer_digest, layer_size) = put(&gz.finish().unwrap());
        let (config_digest, config_size) = put(
            br#"{"config":{"User":"65532:65532","Entrypoint":["/hello"],"Cmd":["a"],"Env":["PATH=/usr/bin"]}}"#,
        );
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": layer_size}],
        });
        let (manifest_digest, manifest_size) = put(manifest.to_string().as_bytes());
        std::fs::write(
            dir.path().join("index.json"),
            serde_json::json!({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_size}]}).to_string(),
        )
        .unwrap();
        let cache = tempfile::tempdir().unwrap();
        let store = ImageStore::new(cache.path());
        let image = store
            .get(&ImageSource::Oci(dir.path().to_path_buf()))
            .unwrap()
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(image.rootfs.join("hello")).unwrap(),
            "hi"
        );
        assert_eq!(image.config.user.as_deref(), Some("65532:65532"));
        assert_eq!(image.config.entrypoint, ["/hello"]);
        assert_eq!(image.config.cmd, ["a"]);
    }
}
