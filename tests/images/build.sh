#!/usr/bin/env bash
# Builds the OCI images the real nodes run, without a registry or a container engine:
#   pause.tar     tidepool.invalid/pause:3.10-tidepool   pause.c, static (the pod sandbox image)
#   workload.tar  tidepool.invalid/workload:1            the distribution's static busybox + applets,
#                                                        /usr/local/bin/tp-train (tests/workload, the
#                                                        training job) and its ldd libraries
#   tidepool.tar  tidepool.invalid/tidepool:<version>    TIDEPOOL_BINARY without its debug info, its
#                                                        ldd libraries, CA certs (only when a binary
#                                                        is given)
# Usage: tests/images/build.sh [TIDEPOOL_BINARY]
# Each tar is an OCI image layout (oci-layout, index.json, blobs/) for
# `ctr -n k8s.io images import FILE` (or tests/images/import.sh), which names the image from
# index.json. The `.invalid` domain is deliberate: no registry can resolve it, so nothing is
# ever pulled; pods use imagePullPolicy Never/IfNotPresent.
#
# Cached outside the repo in $TIDEPOOL_CACHE/images-<key>, <key> being the sha256 of this
# script, pause.c, the busybox binary, the tp-train binary, the tidepool binary and version: a
# second run with the same inputs does nothing. tp-train is built first by
# `cargo build --release --locked -p tidepool-workload` (a no-op when current), or taken from
# TIDEPOOL_WORKLOAD_BINARY when that is set. Prints the output directory on its last line of stdout; progress
# goes to stderr. Needs umoci, jq, cc (with static libc: libc6-dev), busybox-static, which
# deploy/prereqs.sh installs.
#
# Verified with tests/nodes/build.sh's containerd v2.4.2 (tests/nodes/containerd.toml.in):
# import.sh of all three; `ctr run` of workload (`sh -c 'echo hello; id'`), of tidepool
# (`/usr/local/bin/tidepool --version` as uid 65532), of pause (exit 0 on SIGTERM); a CRI pod
# sandbox on the pause image with a workload container on a CNI bridge. The build takes ~2 s.
#
# Traps:
#   - ctr names an imported image from index.json: `io.containerd.image.name` if present, else
#     `org.opencontainers.image.ref.name` when that is a full reference (has '/' or ':'), else
#     "import-<date>:<ref.name>". umoci writes the tag as ref.name, so the images are tagged
#     with their full names, and jq adds io.containerd.image.name too (index.json is not a
#     blob: no digest changes).
#   - Reproducible digests: every staged file gets mtime 0 (`touch -h -d @0`) before
#     `umoci insert`; the config's created and history timestamps are fixed at
#     SOURCE_DATE_EPOCH (0 unless set). Repeated builds give the same manifest digests.
#   - umoci records the staged files' owners: staging runs as root so layers are root-owned
#     (as non-root, umoci --rootless would be needed; not supported here).
#   - The tidepool binary is linked against glibc: the image carries exactly what `ldd` lists
#     (copied with symlinks resolved, at the paths ldd prints) and the loader from its
#     PT_INTERP. glibc >= 2.34 has nss files/dns built in, so name lookups need no libnss_*.
#   - busybox's wget segfaults (static glibc NSS): it is left out; use nc or a static client.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
log() { printf '[images-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

bin=${1:-}
if [[ -n "$bin" ]]; then
  [[ -x "$bin" ]] || { log "not an executable: $bin"; exit 1; }
  bin=$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")
fi

# deploy/prereqs.sh installs these before any build; checked again here for a direct call.
for tool in umoci jq cc objcopy; do
  command -v "$tool" >/dev/null || { log "$tool is missing: run bash deploy/prereqs.sh"; exit 1; }
done
busybox=/bin/busybox
if ! [[ -x $busybox ]] || ldd "$busybox" >/dev/null 2>&1; then   # missing, or not static
  log "a static $busybox is needed: run bash deploy/prereqs.sh (busybox-static)"; exit 1
fi
[[ $(id -u) -eq 0 ]] || { log "run as root: the image layers must be root-owned"; exit 1; }

trainer=${TIDEPOOL_WORKLOAD_BINARY:-}
if [[ -z $trainer ]]; then
  log "tp-train: cargo build --release --locked -p tidepool-workload"
  cargo build --release --locked -p tidepool-workload --manifest-path "$repo/Cargo.toml" >&2
  trainer=$(cargo metadata --format-version 1 --no-deps --manifest-path "$repo/Cargo.toml" |
            jq -r .target_directory)/release/tp-train
fi
[[ -x $trainer ]] || { log "not an executable: $trainer"; exit 1; }

version=$(awk -F'"' '/^\[workspace.package\]/{w=1} w && /^version *=/{print $2; exit}' "$repo/Cargo.toml")
[[ -n "$version" ]] || { log "no version in $repo/Cargo.toml [workspace.package]"; exit 1; }
epoch=${SOURCE_DATE_EPOCH:-0}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)

key=$( { cat "$here/build.sh" "$here/pause.c" "$busybox" "$trainer"; echo "epoch=$epoch version=$version";
         if [[ -n "$bin" ]]; then cat "$bin"; fi; } | sha256sum | cut -c1-16)
[[ -n "$bin" ]] && key="$key-tp"
out="$cache_root/images-$key"

if [[ -f "$out/.complete" ]]; then
  log "cached images are current: $out"
  echo "$out"
  exit 0
fi

tmp="$out.partial.$$"
rm -rf "$tmp"; mkdir -p "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# image NAME REF ROOTFS [umoci config options...]: one layer holding ROOTFS, then the config.
image() {
  local name=$1 ref=$2 rootfs=$3; shift 3
  local layout="$tmp/work/$name-layout" t0=$SECONDS
  find "$rootfs" -exec touch -h -d "@$epoch" {} +
  umoci init --layout "$layout"
  umoci new --image "$layout:$ref"
  umoci insert --image "$layout:$ref" --history.created "$created" \
    --history.created_by "tests/images/build.sh: $name" "$rootfs" /
  umoci config --image "$layout:$ref" --created "$created" --history.created "$created" \
    --history.created_by "tests/images/build.sh: $name config" --os linux --architecture amd64 "$@"
  umoci gc --layout "$layout"
  jq -c --arg n "$ref" '.manifests |= map(.annotations["io.containerd.image.name"] = $n)' \
    "$layout/index.json" > "$layout/index.json.new"
  mv "$layout/index.json.new" "$layout/index.json"
  tar -C "$layout" --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner \
    -cf "$tmp/$name.tar" oci-layout index.json blobs
  log "$name: $ref $(jq -r '.manifests[0].digest' "$layout/index.json") ($((SECONDS - t0)) s)"
}

path_env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# with_libs BINARY ROOTFS NAME: copies what `ldd BINARY` lists into ROOTFS, at the paths ldd
# prints (symlinks resolved), the loader from its PT_INTERP included.
with_libs() {
  local bin=$1 r=$2 name=$3 lib
  # "libx.so => /path (0x..)" and "/lib64/ld-linux-x86-64.so.2 (0x..)"; linux-vdso has no file.
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' | sort -u |
  while read -r lib; do
    mkdir -p "$r$(dirname "$lib")"
    cp -L "$lib" "$r$lib"
    log "$name: + $lib"
  done
  if ldd "$bin" | grep -q 'not found'; then log "ldd: a library is missing: $(ldd "$bin")"; exit 1; fi
}

# --- pause ---
r="$tmp/work/pause-root"; mkdir -p "$r"
cc -static -O2 -s -Wall -Wextra -o "$r/pause" "$here/pause.c"
image pause tidepool.invalid/pause:3.10-tidepool "$r" \
  --config.entrypoint /pause --config.user 65535:65535

# --- workload ---
r="$tmp/work/workload-root"; mkdir -p "$r/bin" "$r/etc" "$r/root" "$r/tmp"
chmod 1777 "$r/tmp"; chmod 700 "$r/root"
cp "$busybox" "$r/bin/busybox"
applets=$("$busybox" --list)   # not piped into grep -q: with pipefail, SIGPIPE fails the check
for a in sh ls cat echo sleep date nc nslookup grep sed awk head tail tr seq kill ps id mkdir rm \
         env true false dd md5sum sha256sum ping printf test [ expr timeout hostname uname \
         cp mv ln chmod wc sort uniq cut xargs find touch stat du df basename dirname pwd \
         which vi less more tee yes usleep ip ifconfig netstat httpd; do
  grep -qFx -- "$a" <<<"$applets" || { log "busybox has no applet $a"; exit 1; }
  ln -s busybox "$r/bin/$a"
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$r/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\n' > "$r/etc/group"
mkdir -p "$r/usr/local/bin"
cp "$trainer" "$r/usr/local/bin/tp-train"
with_libs "$trainer" "$r" workload
chmod -R a+rX "$r/usr" "$r/lib" "$r/lib64"
image workload tidepool.invalid/workload:1 "$r" --config.cmd /bin/sh --config.env "$path_env"

# --- tidepool ---
if [[ -n "$bin" ]]; then
  r="$tmp/work/tidepool-root"; mkdir -p "$r/usr/local/bin" "$r/etc/ssl/certs"
  # Without debug info: a dev build's (the tests' image) is most of its 470 MB; a release build
  # has next to none. The symbols stay, so a panic's backtrace still names its functions.
  objcopy --strip-debug "$bin" "$r/usr/local/bin/tidepool"
  cp -L /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/ca-certificates.crt"
  with_libs "$bin" "$r" tidepool
  chmod -R a+rX "$r"
  image tidepool "tidepool.invalid/tidepool:$version" "$r" \
    --config.entrypoint /usr/local/bin/tidepool --config.user 65532:65532 --config.env "$path_env"
fi

rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s: $out"
echo "$out"
