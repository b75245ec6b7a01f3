//! Pod volumes on this machine as the kubelet makes them for runc containers: sized tmpfs for
//! memory-backed emptyDirs, the projected service-account volume (a token from the
//! TokenRequest API, the cluster CA, the namespace), fsGroup ownership, and each container's
//! overlay root (the image's root filesystem stays unchanged and shared).

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, PodSpec, ProjectedVolumeSource, ServiceAccount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, PostParams};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// The tmpfs size of a memory-backed emptyDir: its `sizeLimit`, else the pod's memory limit
/// (the sum over its containers, when every one has a limit), else none (half the RAM).
pub fn tmpfs_size(size_limit: Option<&Quantity>, spec: &PodSpec) -> Result<Option<i64>> {
    if let Some(q) = size_limit {
        return Ok(Some(bytes(q).ok_or_else(|| {
            anyhow!("emptyDir.sizeLimit {:?} is not a byte quantity", q.0)
        })?));
    }
    let limits: Option<Vec<i64>> = spec
        .containers
        .iter()
        .map(|c| {
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get("memory"))
                .and_then(bytes)
        })
        .collect();
    Ok(limits.map(|l| l.iter().sum()))
}

pub fn bytes(q: &Quantity) -> Option<i64> {
    kube_quantity::ParsedQuantity::try_from(q)
        .ok()?
        .to_bytes_i64()
}

/// CPU millicores of a quantity (`500m`, `0.5`, `2`).
pub fn millis(q: &Quantity) -> Option<u64> {
    let parsed = kube_quantity::ParsedQuantity::try_from(q).ok()?;
    let cores = parsed.to_bytes_f64()?;
    (cores > 0.0).then(|| (cores * 1000.0).round() as u64)
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

pub fn mount_tmpfs(dir: &Path, size: Option<i64>) -> Result<()> {
    let mut options = "mode=0777".to_string();
    if let Some(size) = size {
        options.push_str(&format!(",size={size}"));
    }
    run(Command::new("mount")
        .args(["-t", "tmpfs", "-o", &options, "tmpfs"])
        .arg(dir))
}

/// `dir` as an overlay of `lower` (read-only, shared) with its changes in `upper`/`work`.
pub fn mount_overlay(lower: &Path, upper: &Path, work: &Path, dir: &Path) -> Result<()> {
    for d in [upper, work, dir] {
        std::fs::create_dir_all(d)?;
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    run(Command::new("mount")
        .args(["-t", "overlay", "-o", &options, "overlay"])
        .arg(dir))
}

/// Lazily unmounts `dir` (a container may still hold it open while it dies).
pub fn unmount(dir: &Path) {
    let _ = Command::new("umount").arg("-l").arg(dir).output();
}

/// The kubelet's fsGroup ownership: group `group` on everything, group read (and write
/// unless read-only) on files, set-gid directories.
pub fn set_group_ownership(dir: &Path, group: u32, readonly: bool) -> Result<()> {
    let walk = |path: &Path| -> Result<()> {
        std::os::unix::fs::lchown(path, None, Some(group))
            .with_context(|| format!("chown :{group} {}", path.display()))?;
        let meta = std::fs::symlink_metadata(path)?;
        if meta.file_type().is_symlink() {
            return Ok(());
        }
        let mode = meta.permissions().mode() & 0o7777;
        let add = match (meta.is_dir(), readonly) {
            (true, true) => 0o2550,
            (true, false) => 0o2770,
            (false, true) => 0o440,
            (false, false) => 0o660,
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode | add))?;
        Ok(())
    };
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        walk(&path)?;
        if path.is_dir() && !path.is_symlink() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// Writes a projected volume: service-account tokens (TokenRequest bound to the pod),
/// configMap and secret items, downward API fields.
pub async fn write_projected(
    client: &kube::Client,
    pod: &Pod,
    projected: &ProjectedVolumeSource,
    dir: &Path,
) -> Result<()> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| anyhow!("pod has no spec"))?;
    let mode = projected.default_mode.unwrap_or(0o644);
    let mut files: BTreeMap<String, (Vec<u8>, i32)> = BTreeMap::new();
    for source in projected.sources.iter().flatten() {
        if let Some(sa) = &source.service_account_token {
            let account = spec
                .service_account_name
                .clone()
                .unwrap_or_else(|| "default".into());
            let api: Api<ServiceAccount> = Api::namespaced(client.clone(), &namespace);
            let request = TokenRequest {
                spec: Some(TokenRequestSpec {
                    audiences: sa.audience.clone().map(|a| vec![a]),
                    expiration_seconds: sa.expiration_seconds,
                    bound_object_ref: Some(BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: pod.metadata.name.clone(),
                        uid: pod.metadata.uid.clone(),
                    }),
                    ..TokenRequestSpec::default()
                }),
                ..TokenRequest::default()
            };
            let token: TokenRequest = api
                .create_subresource("token", &account, &PostParams::default(), &request)
                .await
                .with_context(|| {
                    format!("TokenRequest for service account {namespace}/{account}")
                })?;
            let token = token.status.and_then(|s| s.token).ok_or_else(|| {
                anyhow!("TokenRequest for {namespace}/{account} returned no token")
            })?;
            files.insert(sa.path.clone(), (token.into_bytes(), mode));
        }
        if let Some(cm) = &source.config_map {
            let data =
                super::pods::config_map_files(client, &namespace, &cm.name, cm.optional).await?;
            for (key, body) in data {
                if let Some((path, m)) = item_path(&key, cm.items.as_deref()) {
                    files.insert(path, (body, m.unwrap_or(mode)));
                }
            }
        }
        if let Some(secret) = &source.secret {
            let data = super::pods::secret_files(client, &namespace, &secret.name, secret.optional)
                .await?;
            for (key, body) in data {
                if let Some((path, m)) = item_path(&key, secret.items.as_deref()) {
                    files.insert(path, (body, m.unwrap_or(mode)));
                }
            }
        }
        if let Some(downward) = &source.downward_api {
            for item in downward.items.iter().flatten() {
                if let Some(field) = &item.field_ref {
                    let value = super::pods::field_value_of(pod, &field.field_path);
                    files.insert(
                        item.path.clone(),
                        (
                            value.unwrap_or_default().into_bytes(),
                            item.mode.unwrap_or(mode),
                        ),
                    );
                }
            }
        }
    }
    for (rel, (body, mode)) in files {
        let path = dir.join(&rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, body).with_context(|| path.display().to_string())?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode as u32))?;
    }
    Ok(())
}

fn item_path(
    key: &str,
    items: Option<&[k8s_openapi::api::core::v1::KeyToPath]>,
) -> Option<(String, Option<i32>)> {
    match items {
        Some(items) => items
            .iter()
            .find(|i| i.key == key)
            .map(|i| (i.path.clone(), i.mode)),
        None => Some((key.to_string(), None)),
    }
}
