#!/usr/bin/env bash
# stoker's container image: ONE image holding stoker-operator and stoker-loader (Containerfile),
# built offline with Debian's buildah and written as an OCI archive:
#   target/image/stoker-<version>.oci.tar    image ghcr.io/stoker-dev/stoker:<version>
#
#   scripts/image.sh           builds what changed, prints the archive's path
#   scripts/image.sh --check   then runs both binaries from the unpacked archive with runc as
#                              uid 65532 on a read-only root, and checks the image's config;
#                              exits non-zero when the image is broken
#   scripts/image.sh --debug   the same image from the test build's target/debug binaries
#                              (debug info stripped), without building them: what the tests
#                              run (scripts/test.sh), since a release build takes ~15 min here
#                              target/image/stoker-<version>-debug.oci.tar, tag <version>-debug
#   (--debug and --check combine)
#
# No registry is needed: the Containerfile's base (localhost/stoker-base:bookworm) is assembled
# here with debootstrap from this machine's Debian mirror and trimmed to what the binaries load
# (libc6, libgcc-s1: see `ldd`) plus the CA bundle for S3 over TLS: no shell, no apt, no docs.
# Cached by hashes of the inputs: the base tar in $STOKER_CACHE/image/ (its recipe, the package
# list, the mirror), the archive beside a file holding the hash of the binaries, the
# Containerfile, the base, the version and the commit; a warm run builds nothing.
#
# Environment: STOKER_IMAGE_REPOSITORY (default ghcr.io/stoker-dev/stoker), STOKER_DEBIAN_MIRROR
# (default: the bookworm mirror in /etc/apt/sources.list*), CARGO_TARGET_DIR. Needs root.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
check=false
profile=release
for arg in "$@"; do
  case "$arg" in
    --check) check=true ;;
    --debug) profile=debug ;;
    *) echo "usage: scripts/image.sh [--debug] [--check]" >&2; exit 2 ;;
  esac
done
start=$SECONDS
log() { printf '[image %3ds] %s\n' $((SECONDS - start)) "$*" >&2; }

repository=${STOKER_IMAGE_REPOSITORY:-ghcr.io/stoker-dev/stoker}
base_name=localhost/stoker-base:bookworm
# What the binaries load (ldd: libc.so.6, libm.so.6, libgcc_s.so.1, the loader), the CA bundle
# rustls reads for S3 over TLS, and base-files for /etc/os-release (scanners read it).
base_packages=(base-files libc6 libgcc-s1 ca-certificates)
cache=${STOKER_CACHE:-$HOME/.cache/stoker}/image
target=${CARGO_TARGET_DIR:-$root/target}
version=$(sed -n '/^\[package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' Cargo.toml)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
tag=$version
[ "$profile" == debug ] && tag=$version-debug
archive=$target/image/stoker-$tag.oci.tar

if [ "$(id -u)" != 0 ]; then
  echo "scripts/image.sh needs root (debootstrap, buildah and runc)" >&2
  exit 1
fi

# buildah, runc, debootstrap, jq and objcopy (binutils) from Debian, installed only when missing.
want=()
for tool in buildah runc debootstrap jq; do command -v "$tool" >/dev/null || want+=("$tool"); done
command -v objcopy >/dev/null || want+=(binutils)
if [ ${#want[@]} -gt 0 ]; then
  log "installing ${want[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null; }
fi

# The first bookworm mirror apt is configured with (deb822 .sources, then one-line .list).
apt_mirror() {
  local f line uris suites
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uris='' suites=''
    while IFS= read -r line || [ -n "$line" ]; do
      case $line in
        URIs:*) uris=${line#URIs:} ;;
        Suites:*) suites=${line#Suites:} ;;
        '') uris='' suites='' ;;
      esac
      if [ -n "$uris" ] && [[ " $suites " == *" bookworm "* ]]; then
        read -r line _ <<<"$uris"
        echo "$line"
        return
      fi
    done <"$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    line=$(sed -n 's/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) bookworm .*/\2/p' "$f" | head -1)
    [ -n "$line" ] && { echo "$line"; return; }
  done
  echo http://deb.debian.org/debian
}
mirror=${STOKER_DEBIAN_MIRROR:-$(apt_mirror)}

# Writes the trimmed base root filesystem to the tar $1.
assemble_base() {
  local out=$1 work full rootfs p
  work=$(mktemp -d)
  full=$work/full rootfs=$work/rootfs
  if ! debootstrap --variant=minbase --include=ca-certificates bookworm "$full" "$mirror" \
    >"$work/debootstrap.log" 2>&1; then
    tail -20 "$work/debootstrap.log" >&2
    rm -rf "$work"
    return 1
  fi
  mkdir -p "$rootfs"
  # Merged /usr, as Debian lays it out: /lib, /lib64, /bin, /sbin are links into /usr.
  cp -a "$full/lib" "$full/lib64" "$full/bin" "$full/sbin" "$rootfs/"
  # The packages' own files, without docs (licences kept), man pages, locales, lintian
  # overrides, iconv modules, the CA sources and their update script.
  for p in "${base_packages[@]}"; do chroot "$full" dpkg-query -L "$p"; done \
    | sed -E 's#^/(lib|lib64|bin|sbin)(/|$)#/usr/\1\2#' \
    | grep -Ev '^/usr/share/(doc|man|info|locale|lintian|base-files|common-licenses|ca-certificates)/|/gconv(/|$)|^/usr/sbin/|^/etc/update-motd\.d|^/etc/ca-certificates' \
    | grep -v '^/\.$' | sed 's#^/##' | sort -u >"$work/files"
  for p in "${base_packages[@]}"; do
    [ -f "$full/usr/share/doc/$p/copyright" ] && echo "usr/share/doc/$p/copyright"
  done >>"$work/files"
  echo etc/ssl/certs/ca-certificates.crt >>"$work/files"
  tar -C "$full" --no-recursion -cf - -T "$work/files" \
    | tar -C "$rootfs" --keep-directory-symlink -xf -
  # The packages' records, as distroless images keep them, so scanners see the versions.
  mkdir -p "$rootfs/var/lib/dpkg/status.d"
  for p in "${base_packages[@]}"; do
    chroot "$full" dpkg-query -s "$p" >"$rootfs/var/lib/dpkg/status.d/$p"
  done
  # Users: root, and nonroot (65532) that the image runs as. No login shells exist.
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
  printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
  mkdir -p "$rootfs/tmp" "$rootfs/root" "$rootfs/home/nonroot"
  chmod 1777 "$rootfs/tmp"
  chmod 0700 "$rootfs/root" "$rootfs/home/nonroot"
  chown 65532:65532 "$rootfs/home/nonroot"
  tar -C "$rootfs" --numeric-owner -cf "$out.tmp" .
  mv "$out.tmp" "$out"
  rm -rf "$work"
}

# 1. The binaries: release builds (a no-op when warm), or the test build's as they are (a
#    `cargo build -p` here could rebuild them with other features than the workspace's).
bins=("$target/$profile/stoker-operator" "$target/$profile/stoker-loader")
if [ "$profile" == release ]; then
  log "cargo build --release (stoker-operator, stoker-loader)"
  cargo build --release --locked -p stoker-operator -p stoker-loader \
    --bin stoker-operator --bin stoker-loader
else
  for bin in "${bins[@]}"; do
    [ -x "$bin" ] || { echo "$bin is missing: cargo build --workspace first" >&2; exit 1; }
  done
fi

# 2. The base, built once per recipe and imported into buildah's storage under the FROM name.
base_key=$({ declare -f assemble_base; echo "${base_packages[*]} $mirror"; } | sha256sum | cut -c1-16)
base_tar=$cache/base-bookworm-$base_key.tar
if [ ! -f "$base_tar" ]; then
  log "assembling the base from Debian bookworm ($mirror)"
  mkdir -p "$cache"
  assemble_base "$base_tar"
fi
have_base=$(buildah inspect --type image --format '{{index .OCIv1.Config.Labels "dev.stoker.base"}}' \
  "$base_name" 2>/dev/null || true)
if [ "$have_base" != "$base_key" ]; then
  log "importing the base as $base_name"
  ctr=$(buildah from --quiet scratch)
  buildah add --quiet "$ctr" "$base_tar" / >/dev/null
  buildah config --label "dev.stoker.base=$base_key" --env PATH=/usr/local/bin:/usr/bin:/bin "$ctr"
  buildah commit --quiet --rm "$ctr" "$base_name" >/dev/null
fi

# 3. The image, when any input changed.
key=$({
  sha256sum Containerfile "${bins[@]}" | cut -d' ' -f1
  echo "$base_key $repository $tag $revision"
} | sha256sum | cut -d' ' -f1)
if [ -f "$archive" ] && [ "$(cat "$archive.inputs" 2>/dev/null)" == "$key" ]; then
  log "up to date: $archive"
else
  log "buildah bud $repository:$tag"
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  if [ "$profile" == debug ]; then
    # ~90 MB each with debug info, ~40 MB without; backtraces keep their symbol names.
    for bin in "${bins[@]}"; do objcopy --strip-debug "$bin" "$context/${bin##*/}"; done
  else
    cp "${bins[@]}" "$context/"
  fi
  buildah rmi --force "$repository:$tag" >/dev/null 2>&1 || true
  # No RUN step, so no runtime (and no rlimits) is involved; --timestamp makes the layers
  # reproducible: the same inputs give the same digest.
  buildah bud --quiet --format oci --timestamp 0 -f Containerfile \
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
    -t "$repository:$tag" "$context" >/dev/null
  mkdir -p "$(dirname "$archive")"
  rm -f "$archive" "$archive.inputs"
  buildah push --quiet "$repository:$tag" "oci-archive:$archive.tmp:$repository:$tag"
  mv "$archive.tmp" "$archive"
  echo "$key" >"$archive.inputs"
  log "wrote $archive ($(du -m "$archive" | cut -f1) MB)"
fi

# 4. The check: the archive as a runtime sees it.
check_image() {
  local work blobs manifest config digest name bin out
  work=$(mktemp -d)
  blobs=$work/oci/blobs
  mkdir -p "$work/oci" "$work/bundle/rootfs" "$work/runc"
  tar -C "$work/oci" -xf "$archive"
  blob() { echo "$blobs/${1%%:*}/${1#*:}"; }
  manifest=$(blob "$(jq -r '.manifests[0].digest' "$work/oci/index.json")")
  config=$(blob "$(jq -r '.config.digest' "$manifest")")
  for digest in $(jq -r '.layers[].digest' "$manifest"); do
    tar -C "$work/bundle/rootfs" -xf "$(blob "$digest")"
  done
  local fail=()
  [ "$(jq -r '.config.User' "$config")" == 65532:65532 ] || fail+=("User is not 65532:65532")
  for l in source version licenses title description revision; do
    [ -n "$(jq -r ".config.Labels[\"org.opencontainers.image.$l\"] // empty" "$config")" ] \
      || fail+=("label org.opencontainers.image.$l missing")
  done
  [ "$(jq -r '.config.Labels["org.opencontainers.image.version"]' "$config")" == "$version" ] \
    || fail+=("label org.opencontainers.image.version is not $version")
  for p in bin/sh usr/bin/bash usr/bin/apt usr/bin/dpkg; do
    [ -e "$work/bundle/rootfs/$p" ] && fail+=("/$p is in the image")
  done
  # The operator as the image's entrypoint; the loader at the path the operator's pods run.
  local entrypoint loader
  entrypoint=$(jq -r '.config.Entrypoint[0]' "$config")
  loader=$(sed -n 's/^pub const LOADER_COMMAND: &str = "\(.*\)";/\1/p' src/build/mod.rs)
  # runc's default spec with the image's user, env and a read-only root; no capabilities, no
  # rlimits (this machine may not raise RLIMIT_NOFILE: it lacks CAP_SYS_RESOURCE).
  (cd "$work/bundle" && runc spec)
  for bin in "$entrypoint" "$loader"; do
    name=${bin##*/}
    jq --slurpfile img "$config" --arg bin "$bin" '
      .process.terminal = false
      | .process.args = [$bin, "--help"]
      | .process.env = $img[0].config.Env
      | .process.user = {uid: 65532, gid: 65532}
      | .process.capabilities = {}
      | .process.noNewPrivileges = true
      | del(.process.rlimits)
      | .root.readonly = true
      | .hostname = "stoker-image-check"' "$work/bundle/config.json" >"$work/config.json"
    cp "$work/config.json" "$work/bundle/config.json"
    if out=$(runc --root "$work/runc" run --bundle "$work/bundle" "stoker-image-check-$$" 2>&1) \
      && grep -q "Usage: $name" <<<"$out"; then
      log "runc: $bin --help as 65532 on a read-only root: ok"
    else
      fail+=("runc: $bin --help failed: $(head -5 <<<"$out")")
    fi
  done
  rm -rf "$work"
  if [ ${#fail[@]} -gt 0 ]; then
    printf 'image check failed: %s\n' "${fail[@]}" >&2
    return 1
  fi
}
if $check; then
  check_image
fi
echo "$archive"
