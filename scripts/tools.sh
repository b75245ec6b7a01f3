#!/usr/bin/env bash
# Builds the real components the tests and the local cluster run, from the Go
# modules pinned under tools/, and caches them by the hash of each module's
# go.mod and go.sum: a warm machine rebuilds nothing.
#
#   scripts/tools.sh            build what is missing, print the bin dir
#   STOKER_CACHE=/path ...      cache root (default ~/.cache/stoker)
#
# Binaries end up as symlinks in $STOKER_CACHE/bin:
#   kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm prometheus
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
bin=$cache/bin
mkdir -p "$bin" "$cache/go"

export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# Two cores and 24 GiB: one package at a time keeps kube-apiserver's link under ~6 GiB.
export GOMAXPROCS=${GOMAXPROCS:-2}

log() { printf '[tools] %s\n' "$*" >&2; }

# module_dir [TAGS] -> directory of cached binaries for this exact go.mod + go.sum (+ build tags)
cache_dir() {
  local name=$1 tags=${2:-} sum
  sum=$( (cat "$root/tools/$name/go.mod" "$root/tools/$name/go.sum"; [ -z "$tags" ] || echo "tags=$tags") \
    | sha256sum | cut -c1-16)
  echo "$cache/go/$name-$sum"
}

# [tags=T] build NAME LDFLAGS PKG...  builds the packages of tools/NAME into its cache dir
build() {
  local name=$1 ldflags=$2; shift 2
  local out; out=$(cache_dir "$name" "${tags:-}")
  if [ -f "$out/.done" ]; then
    log "$name: cached in $out"
  else
    log "$name: building $* (cold: minutes)"
    local start=$SECONDS
    rm -rf "$out.tmp" && mkdir -p "$out.tmp"
    (cd "$root/tools/$name" && go build -trimpath ${tags:+-tags "$tags"} -ldflags "-s -w $ldflags" -o "$out.tmp/" "$@")
    rm -rf "$out" && mv "$out.tmp" "$out" && touch "$out/.done"
    log "$name: built in $((SECONDS - start))s"
  fi
  local f
  for f in "$out"/*; do ln -sfn "$f" "$bin/$(basename "$f")"; done
}

k8s_version=$(sed -n 's/^require k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' "$root/tools/k8s/go.mod")
k8s_minor=$(echo "$k8s_version" | cut -d. -f2)
k8s_ldflags=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

build etcd "" go.etcd.io/etcd/server/v3
# Go names the etcd server binary after its module directory.
ln -sfn "$(cache_dir etcd)/server" "$bin/etcd" && rm -f "$bin/server"
build kwok "" sigs.k8s.io/kwok/cmd/kwok
build helm "" helm.sh/helm/v3/cmd/helm
# Kubernetes service discovery only (Debian's prometheus has none): the tests discover pods
# through the chart's PodMonitor relabelings as a cluster's Prometheus does.
tags=remove_all_sd,enable_kubernetes_sd build prometheus "" github.com/prometheus/prometheus/cmd/prometheus
build k8s "$k8s_ldflags" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl

echo "$bin"
