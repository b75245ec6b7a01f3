//! The OCI runtime spec (runc's `config.json`) for one container, from its pod spec and image:
//! pure functions, no I/O.
//!
//! - User: `runAsUser`/`runAsGroup` (container over pod) over the image's `User`; `fsGroup` and
//!   `supplementalGroups` as additional groups. `runAsNonRoot` refuses a container that would
//!   run as uid 0 with the kubelet's own messages (shown as `CreateContainerConfigError`).
//! - Capabilities: containerd's default set, then `drop` (`ALL` empties it), then `add`.
//!   `allowPrivilegeEscalation: false` → `noNewPrivileges`. `privileged` is refused.
//! - Seccomp: `RuntimeDefault` → [`runtime_default_seccomp`]; `Unconfined` or unset → none
//!   (the kubelet's default without the SeccompDefault gate); `Localhost` is refused.
//! - Limits: CPU limit → CFS quota over a 100 ms period; memory limit → the memory cgroup's
//!   limit (cgroup v1 here: `cpu.cfs_quota_us`, `memory.limit_in_bytes`; runc writes `cpu.max`
//!   and `memory.max` on a v2 host from the same spec). No rlimits: this machine lacks
//!   CAP_SYS_RESOURCE, and runc's defaults would exceed its hard limits.
//! - Network: the node's network namespace by path (pods of a node share it; see `pods`).

use k8s_openapi::api::core::v1::{Container, PodSecurityContext, SecurityContext};
use serde_json::{Value, json};
use std::path::PathBuf;

/// containerd's default capabilities for a container (what the kubelet's CRI runtime gives).
pub const DEFAULT_CAPABILITIES: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// A container's security settings once pod, container and image are combined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Security {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    pub fs_group: Option<u32>,
    pub readonly_root: bool,
    pub capabilities: Vec<String>,
    pub no_new_privileges: bool,
    pub seccomp: bool,
}

/// What the kubelet would refuse to start; the text is the pod status' waiting message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// `uid[:gid]` from the image's `User`; a name is looked up in `passwd` (the image's
/// `/etc/passwd`), `None` when it is not there.
pub fn image_user(user: Option<&str>, passwd: &str) -> Result<(Option<u32>, Option<u32>), String> {
    let Some(user) = user.filter(|u| !u.is_empty()) else {
        return Ok((Some(0), Some(0)));
    };
    let (name, group) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let gid = group.and_then(|g| g.parse::<u32>().ok());
    if let Ok(uid) = name.parse::<u32>() {
        let primary = passwd
            .lines()
            .map(|l| l.split(':').collect::<Vec<_>>())
            .find(|f| f.len() >= 4 && f[2].parse() == Ok(uid))
            .and_then(|f| f[3].parse().ok());
        return Ok((Some(uid), gid.or(primary).or(Some(0))));
    }
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == name {
            let uid = fields[2].parse().ok();
            let pgid = fields[3].parse().ok();
            return Ok((uid, gid.or(pgid)));
        }
    }
    Err(name.to_string())
}

/// Combines pod, container and image user into [`Security`], refusing what the kubelet
/// refuses. `pod_ref` is the kubelet's `name_namespace(uid)` used in its messages.
pub fn security(
    pod_ref: &str,
    pod_sc: Option<&PodSecurityContext>,
    c: &Container,
    image_user: Result<(Option<u32>, Option<u32>), String>,
) -> Result<Security, ConfigError> {
    let sc: Option<&SecurityContext> = c.security_context.as_ref();
    let name = &c.name;
    if sc.and_then(|s| s.privileged) == Some(true) {
        return Err(ConfigError(format!(
            "privileged containers are not supported by the test node runtime (pod: {pod_ref:?}, container: {name})"
        )));
    }
    let run_as_user = sc
        .and_then(|s| s.run_as_user)
        .or(pod_sc.and_then(|p| p.run_as_user));
    let run_as_group = sc
        .and_then(|s| s.run_as_group)
        .or(pod_sc.and_then(|p| p.run_as_group));
    let non_root = sc
        .and_then(|s| s.run_as_non_root)
        .or(pod_sc.and_then(|p| p.run_as_non_root))
        == Some(true);
    let (uid, image_gid) = match (run_as_user, &image_user) {
        (Some(u), _) => (u as u32, image_user.as_ref().ok().and_then(|(_, g)| *g)),
        (None, Ok((Some(u), g))) => (*u, *g),
        (None, Ok((None, _))) | (None, Err(_)) => {
            if non_root {
                let user = image_user.clone().err().unwrap_or_default();
                return Err(ConfigError(format!(
                    "container has runAsNonRoot and image has non-numeric user ({user}), cannot verify user is non-root (pod: {pod_ref:?}, container: {name})"
                )));
            }
            (0, Some(0))
        }
    };
    if non_root {
        if run_as_user == Some(0) {
            return Err(ConfigError(format!(
                "container's runAsUser breaks non-root policy (pod: {pod_ref:?}, container: {name})"
            )));
        }
        if uid == 0 {
            return Err(ConfigError(format!(
                "container has runAsNonRoot and image will run as root (pod: {pod_ref:?}, container: {name})"
            )));
        }
    }
    let gid = run_as_group.map(|g| g as u32).or(image_gid).unwrap_or(0);
    let fs_group = pod_sc.and_then(|p| p.fs_group).map(|g| g as u32);
    let mut additional_gids: Vec<u32> = pod_sc
        .and_then(|p| p.supplemental_groups.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|g| g as u32)
        .collect();
    additional_gids.extend(fs_group);
    additional_gids.sort_unstable();
    additional_gids.dedup();

    let mut capabilities: Vec<String> =
        DEFAULT_CAPABILITIES.iter().map(|c| c.to_string()).collect();
    let caps = sc.and_then(|s| s.capabilities.as_ref());
    let cap_name = |c: &str| {
        let c = c.to_ascii_uppercase();
        if c.starts_with("CAP_") {
            c
        } else {
            format!("CAP_{c}")
        }
    };
    for drop in caps.and_then(|c| c.drop.as_ref()).into_iter().flatten() {
        if drop.eq_ignore_ascii_case("ALL") {
            capabilities.clear();
        } else {
            let drop = cap_name(drop);
            capabilities.retain(|c| *c != drop);
        }
    }
    for add in caps.and_then(|c| c.add.as_ref()).into_iter().flatten() {
        let add = cap_name(add);
        if !capabilities.contains(&add) {
            capabilities.push(add);
        }
    }
    let seccomp_type = sc
        .and_then(|s| s.seccomp_profile.as_ref())
        .or(pod_sc.and_then(|p| p.seccomp_profile.as_ref()))
        .map(|p| p.type_.clone());
    let seccomp = match seccomp_type.as_deref() {
        Some("RuntimeDefault") => true,
        None | Some("Unconfined") => false,
        Some(other) => {
            return Err(ConfigError(format!(
                "seccomp profile type {other} is not supported by the test node runtime (pod: {pod_ref:?}, container: {name})"
            )));
        }
    };
    Ok(Security {
        uid,
        gid,
        additional_gids,
        fs_group,
        readonly_root: sc.and_then(|s| s.read_only_root_filesystem) == Some(true),
        capabilities,
        no_new_privileges: sc.and_then(|s| s.allow_privilege_escalation) == Some(false),
        seccomp,
    })
}

/// A mount in the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub destination: String,
    pub source: PathBuf,
    pub readonly: bool,
}

/// Everything [`spec`] needs.
#[derive(Clone, Debug)]
pub struct ContainerPlan {
    pub rootfs: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub hostname: String,
    pub security: Security,
    /// CPU limit in millicores.
    pub cpu_millis: Option<u64>,
    /// Memory limit in bytes.
    pub memory_bytes: Option<i64>,
    pub mounts: Vec<Mount>,
    pub netns: PathBuf,
    pub cgroups_path: String,
}

/// The CFS period the runtime uses (the kubelet's default).
pub const CFS_PERIOD_US: u64 = 100_000;

/// runc's `config.json` for `plan`.
pub fn spec(plan: &ContainerPlan) -> Value {
    let s = &plan.security;
    let caps = &s.capabilities;
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
               "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
        // A writable /tmp is the kubelet's too only through a volume; images expect one, and
        // with a read-only root it is the one writable place (64 MiB, counted as memory).
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "mode=1777", "size=65536k"]}),
    ];
    for m in &plan.mounts {
        let mut options = vec!["rbind", "nosuid", "nodev"];
        if m.readonly {
            options.push("ro");
        }
        mounts.push(json!({"destination": m.destination, "type": "bind",
                           "source": m.source, "options": options}));
    }
    let mut resources = json!({"devices": [{"allow": false, "access": "rwm"}]});
    if let Some(millis) = plan.cpu_millis {
        let quota = (millis * CFS_PERIOD_US / 1000).max(1000);
        resources["cpu"] = json!({"quota": quota, "period": CFS_PERIOD_US});
    }
    if let Some(bytes) = plan.memory_bytes {
        resources["memory"] = json!({"limit": bytes, "swap": bytes});
    }
    let mut linux = json!({
        "namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"},
            {"type": "network", "path": plan.netns},
        ],
        "cgroupsPath": plan.cgroups_path,
        "resources": resources,
        "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
            "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
            "/sys/firmware", "/proc/scsi"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
            "/proc/sysrq-trigger"],
    });
    if s.seccomp {
        linux["seccomp"] = runtime_default_seccomp();
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": s.uid, "gid": s.gid, "additionalGids": s.additional_gids},
            "args": plan.args,
            "env": plan.env,
            "cwd": plan.cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": s.no_new_privileges,
        },
        "root": {"path": plan.rootfs, "readonly": s.readonly_root},
        "hostname": plan.hostname,
        "mounts": mounts,
        "linux": linux,
    })
}

/// Syscalls that containerd's and Docker's default profiles refuse to a container without
/// CAP_SYS_ADMIN and friends (kernel modules, mounts, namespaces, keyrings, clocks, reboot,
/// tracing other processes, BPF, perf). This profile allows everything else (the default
/// profiles are allow-lists; the effect for ordinary programs is the same).
pub const DENIED_SYSCALLS: [&str; 44] = [
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "move_mount",
    "name_to_handle_at",
    "nfsservctl",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
];

/// The `RuntimeDefault` profile: [`DENIED_SYSCALLS`] fail with EPERM.
pub fn runtime_default_seccomp() -> Value {
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64"],
        "syscalls": [{"names": DENIED_SYSCALLS.to_vec(), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(sc: Value) -> Container {
        serde_json::from_value(json!({"name": "c", "securityContext": sc})).unwrap()
    }

    #[test]
    fn run_as_non_root_refuses_a_root_image() {
        let c = container(json!({"runAsNonRoot": true}));
        let err = security("p_ns(u)", None, &c, Ok((Some(0), Some(0)))).unwrap_err();
        assert!(
            err.0
                .starts_with("container has runAsNonRoot and image will run as root"),
            "{err}"
        );
        let c = container(json!({"runAsNonRoot": true, "runAsUser": 0}));
        let err = security("p_ns(u)", None, &c, Ok((Some(65532), None))).unwrap_err();
        assert!(
            err.0
                .starts_with("container's runAsUser breaks non-root policy"),
            "{err}"
        );
        let c = container(json!({"runAsNonRoot": true}));
        let ok = security("p_ns(u)", None, &c, Ok((Some(65532), Some(65532)))).unwrap();
        assert_eq!((ok.uid, ok.gid), (65532, 65532));
    }

    #[test]
    fn restricted_container() {
        let pod: PodSecurityContext =
            serde_json::from_value(json!({"runAsUser": 1000, "fsGroup": 2000})).unwrap();
        let c = container(json!({
            "allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
            "seccompProfile": {"type": "RuntimeDefault"}}));
        let s = security("p", Some(&pod), &c, Ok((Some(0), Some(0)))).unwrap();
        assert_eq!(s.uid, 1000);
        assert_eq!(s.additional_gids, [2000]);
        assert_eq!(s.capabilities, ["CAP_NET_BIND_SERVICE"]);
        assert!(s.no_new_privileges && s.readonly_root && s.seccomp);
    }

    #[test]
    fn image_users() {
        assert_eq!(
            image_user(Some("65532:65532"), ""),
            Ok((Some(65532), Some(65532)))
        );
        assert_eq!(image_user(None, ""), Ok((Some(0), Some(0))));
        assert_eq!(
            image_user(Some("nonroot"), "nonroot:x:65532:65532::/:/x\n"),
            Ok((Some(65532), Some(65532)))
        );
        assert_eq!(image_user(Some("ghost"), ""), Err("ghost".to_string()));
    }
}
