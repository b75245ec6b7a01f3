#!/usr/bin/env bash
# System packages stoker builds and tests need, from Debian, installed only when missing:
#   nasm        libjpeg-turbo's SIMD (vendored by the turbojpeg crate; without it JPEG is slower)
#   prometheus  the real Prometheus server the autoscaler tests and the demo scrape with
#   iproute2    network namespaces and tc for the simulated nodes' NICs
#   runc        the OCI runtime the simulated nodes run containers with (uid, read-only root,
#               capabilities, seccomp, cgroup limits), as a kubelet's CRI would
# Debian's service for prometheus is not started: tests run their own on loopback.
set -euo pipefail
want=()
command -v nasm >/dev/null || want+=(nasm)
command -v prometheus >/dev/null || want+=(prometheus)
command -v tc >/dev/null || want+=(iproute2)
command -v runc >/dev/null || want+=(runc)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing system packages: ${want[*]} (run as root, or install them: apt-get install ${want[*]})" >&2
  exit 1
fi
echo "[deps] installing ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d keeps Debian from starting the packaged services.
printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
trap 'rm -f /usr/sbin/policy-rc.d' EXIT
apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null; }
