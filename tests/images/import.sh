#!/usr/bin/env bash
# Imports OCI layout tars made by tests/images/build.sh into the containerd listening on
# SOCKET, namespace k8s.io (the one the CRI plugin, hence the kubelet, sees), unpacked into
# the default snapshotter (set SNAPSHOTTER to choose another). An image whose name already
# points at the same manifest digest is skipped, so this is cheap to repeat.
# Usage: tests/images/import.sh SOCKET TAR...
# ctr is taken from $CTR, else PATH (tests/nodes/build.sh's output directory has one).
#
# Traps: the name comes from index.json (io.containerd.image.name, which build.sh writes);
# without --base-name, ctr would name an archive lacking it "import-<date>:<tag>".
set -euo pipefail

log() { printf '[images-import %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
[[ $# -ge 2 ]] || { echo "usage: $0 SOCKET TAR..." >&2; exit 2; }
sock=$1; shift
ctr=${CTR:-$(command -v ctr || true)}
[[ -n "$ctr" && -x "$ctr" ]] || { log "no ctr: set CTR or put tests/nodes/build.sh's output on PATH"; exit 1; }
command -v jq >/dev/null || { log "jq is needed"; exit 1; }
# ctr prints a cgroup v1 deprecation warning on every call on this kind of host: drop it.
c() {
  { "$ctr" --address "$sock" -n k8s.io "$@" 2>&1 >&3 | { grep -v 'support for cgroup v1 is deprecated' || true; } >&2; } 3>&1
}

for t in "$@"; do
  idx=$(tar -xOf "$t" index.json) || { log "$t: no index.json (not an OCI layout tar)"; exit 1; }
  name=$(jq -r '.manifests[0].annotations["io.containerd.image.name"] // empty' <<<"$idx")
  digest=$(jq -r '.manifests[0].digest' <<<"$idx")
  [[ -n "$name" ]] || { log "$t: index.json names no image (io.containerd.image.name)"; exit 1; }
  have=$(c images ls "name==$name" | awk 'NR > 1 {print $3}')
  if [[ "$have" == "$digest" ]]; then
    log "$name: already there ($digest)"
    continue
  fi
  c images import ${SNAPSHOTTER:+--snapshotter "$SNAPSHOTTER"} "$t" >&2
  have=$(c images ls "name==$name" | awk 'NR > 1 {print $3}')
  [[ "$have" == "$digest" ]] || { log "$name: import of $t did not give $digest (got '${have}')"; exit 1; }
  log "$name: imported $digest"
done
