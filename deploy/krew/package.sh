#!/usr/bin/env bash
# Packages the kubectl plugin for krew: an archive holding the release binary as
# `kubectl-tidepool` with the repository's LICENSE (krew wants the license in the archive), and the krew
# manifest for it with the archive's sha256 filled in. The archive's download address is the
# first argument (where you publish it); the manifest is written next to the archive.
#   bash deploy/krew/package.sh https://downloads.example.invalid/tidepool [target/release/tidepool]
# Then: kubectl krew install --manifest=dist/tidepool.yaml --archive=dist/kubectl-tidepool-linux-amd64.tar.gz
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base_url=${1:?usage: package.sh BASE_URL [BINARY]}
binary=${2:-$root/target/release/tidepool}
[ -x "$binary" ] || { echo "package.sh: $binary missing: cargo build --release --bin tidepool" >&2; exit 1; }
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n 1)
out=$root/dist
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"
cp "$binary" "$stage/kubectl-tidepool"
cp "$root/LICENSE" "$stage/LICENSE"
archive=kubectl-tidepool-linux-amd64.tar.gz
tar -C "$stage" --owner=0 --group=0 --mtime='2026-01-01' -czf "$out/$archive" kubectl-tidepool LICENSE
sha=$(sha256sum "$out/$archive" | cut -d' ' -f1)
sed -e "s|@VERSION@|v$version|g" -e "s|@URI@|$base_url/v$version/$archive|g" -e "s|@SHA256@|$sha|g" \
  "$here/tidepool.yaml.in" >"$out/tidepool.yaml"
echo "wrote $out/$archive and $out/tidepool.yaml (sha256 $sha)" >&2
