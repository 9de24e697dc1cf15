#!/usr/bin/env bash
# Builds the training-frameworks image the real nodes run for the Kubeflow-style jobs, without
# a registry or a container engine, as tests/images/build.sh builds the others:
#   frameworks.tar  tidepool.invalid/frameworks:1
#     - Debian bookworm's python3 3.11, python3-torch 1.13 (CPU, gloo, torchrun), OpenMPI 4.1 +
#       mpi4py, the OpenSSH server and client (MPIJob v2), coreutils, bash, busybox's nslookup,
#       ping, nc; from Debian packages fetched with the host's own apt configuration
#       (`apt-get download`) and unpacked with dpkg-deb, no maintainer scripts run;
#     - TensorFlow CPU 2.21.0 and PaddlePaddle CPU 3.3.1 with every dependency, pinned with
#       hashes in tests/frameworks/requirements.txt, installed with pip into /opt/tidepool/pip
#       (off the default sys.path: both need numpy 2, Debian's torch numpy 1.24);
#     - the training programs of tests/frameworks/ in /opt/tidepool/.
# Usage: tests/images/frameworks.sh     (as root: the layers must be root-owned)
# The tar is an OCI image layout for `ctr -n k8s.io images import` (tests/images/import.sh).
#
# Cached outside the repo in $TIDEPOOL_CACHE/frameworks-<key>, <key> being the sha256 of this
# script, elf_closure.py, tests/frameworks/* and the Debian pins below: a second run with the
# same inputs does nothing. Downloads are kept apart, in $TIDEPOOL_CACHE/frameworks-downloads
# (by file name, checked against apt's and the requirements' hashes), so a change to a training
# program rebuilds the image without fetching 700 MB again. Progress on stderr; the output
# directory on the last line of stdout. The Debian packages that were resolved (the pins and
# what they need) are listed in the output directory and in the image, debian-packages.txt.
#
# Layers, largest and least often changed first: the Debian root, the pip site, the programs.
#
# Traps:
#   - No maintainer scripts run, so what they would do is done here: the alternatives that
#     matter (awk, which, libblas/liblapack, libpsm, mpirun/mpiexec), passwd/group with the
#     sshd privilege-separation user, sshd_config (Debian's postinst copies it from
#     /usr/share/openssh), ld.so.cache (ldconfig -r), torchrun's Python 3.11 fix (below). No
#     ssh host keys are baked in:
#     /opt/tidepool/sshd.sh makes them at start (ssh-keygen -A) and runs sshd.
#   - libtorch1.13 depends on OpenCV and FFmpeg, which drag in Qt, GDAL, Mesa and LLVM
#     (1.2 GB): a few packages are never unpacked (EXCLUDE) and elf_closure.py removes the
#     top-level libraries no program or module reaches; it fails the build if anything that is
#     kept links against a library that is gone.
#   - Merged /usr: the root starts with bin, sbin, lib, lib64 as symlinks into usr/ and
#     tar keeps them (--keep-directory-symlink), as debootstrap's merged layout has it.
#   - pip runs on the host's interpreter (CPython 3.11 too, same ABI) with --target; its
#     console scripts carry the host interpreter's path, so bin/ is dropped.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
programs=$repo/tests/frameworks
cache_root=${TIDEPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tidepool}
log() { printf '[frameworks-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The frameworks' Debian packages, pinned (a version gone from the archive fails the build,
# loudly); what they need resolves to the archive's candidate and is recorded.
DEBIAN_PINS=(python3=3.11.2-1+b1 python3-torch=1.13.1+dfsg-4 openmpi-bin=4.1.4-3+b1 python3-mpi4py=3.1.4-2+b2)
# Tools, at the archive's current (security-updated) versions.
DEBIAN_TOOLS=(openssh-server openssh-client bash coreutils dash grep sed findutils procps busybox)
# Pulled in by dependencies, never loaded by the frameworks: not unpacked (elf_closure.py
# checks that nothing kept links against them). Perl only runs maintainer scripts; LLVM, Z3
# and the Mesa drivers only render; the rest is data for GIS and desktop libraries.
EXCLUDE=(perl perl-base perl-modules-5.36 libperl5.36 libfile-find-rule-perl libnumber-compare-perl
         libtext-glob-perl usrmerge libgl1-mesa-dri libllvm15 libz3-4 iso-codes proj-data gdal-data
         gdal-plugins shared-mime-info xkb-data fonts-dejavu-core libtorch-test debconf
         init-system-helpers sysvinit-utils adduser passwd libsemanage-common libsemanage2 ucf
         runit-helper)
# What goes to /opt/tidepool (tests/frameworks/).
PROGRAMS=(tidepool_notice.py tf_ps.py torch_ddp.py mpi_allreduce.py paddle_collective.py sshd.sh nslookup)
BUSYBOX_APPLETS=(nslookup ping nc wget vi less netstat ifconfig ip)

for tool in umoci jq apt-get dpkg-deb python3 ldconfig; do
  command -v "$tool" >/dev/null || { log "$tool is missing: run bash deploy/prereqs.sh"; exit 1; }
done
[[ $(id -u) -eq 0 ]] || { log "run as root: the image layers must be root-owned"; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { log "python3 has no pip"; exit 1; }

epoch=${SOURCE_DATE_EPOCH:-0}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
key=$( { cat "$here/frameworks.sh" "$here/elf_closure.py";
         for f in "$programs"/*; do echo "== ${f##*/}"; cat "$f"; done
         echo "pins=${DEBIAN_PINS[*]} tools=${DEBIAN_TOOLS[*]} exclude=${EXCLUDE[*]} epoch=$epoch"; } |
       sha256sum | cut -c1-16)
out=$cache_root/frameworks-$key
if [[ -f $out/.complete ]]; then
  log "cached image is current: $out"
  echo "$out"
  exit 0
fi

dl=$cache_root/frameworks-downloads
mkdir -p "$dl/debs" "$dl/wheels"
tmp=$out.partial.$$
rm -rf "$tmp"; mkdir -p "$tmp/work"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# --- Debian: resolve the closure as on an empty system, download what the cache lacks ---
# An empty dpkg status makes apt resolve every dependency, not only what the host lacks.
: >"$tmp/work/empty-status"
resolve() {
  apt-get -o Dir::State::status="$tmp/work/empty-status" -s install --no-install-recommends \
    "${DEBIAN_PINS[@]}" "${DEBIAN_TOOLS[@]}" 2>&1
}
if ! plan=$(resolve) || ! grep -q '^Inst ' <<<"$plan"; then
  log "apt cannot resolve the packages yet: apt-get update"
  timeout 300 apt-get update -qq >&2
  plan=$(resolve) || { log "apt cannot resolve: $plan"; exit 1; }
fi
# "Inst NAME (VERSION SUITE [ARCH])": NAME=VERSION, minus the excluded packages.
mapfile -t debs < <(awk '/^Inst /{v=$3; sub(/^\(/, "", v); print $2 "=" v}' <<<"$plan" | sort)
excl=" ${EXCLUDE[*]} "
keep=()
for d in "${debs[@]}"; do [[ $excl == *" ${d%%=*} "* ]] || keep+=("$d"); done
log "debian: ${#debs[@]} packages resolved, ${#keep[@]} unpacked (${#EXCLUDE[@]} left out)"
printf '%s\n' "${keep[@]}" >"$tmp/debian-packages.txt"
# --print-uris gives each file's name and hash without downloading; only missing files are
# fetched (the URIs themselves are never printed: they name the host's mirror).
apt-get download --print-uris "${keep[@]}" 2>/dev/null | awk '{print $2, $4}' >"$tmp/work/debs.txt"
[[ $(wc -l <"$tmp/work/debs.txt") -eq ${#keep[@]} ]] || { log "apt-get download --print-uris listed $(wc -l <"$tmp/work/debs.txt") of ${#keep[@]} packages"; exit 1; }
need=()
i=0
while read -r file sum; do
  sum=${sum#SHA256:}
  if ! [[ -f $dl/debs/$file ]] || [[ $(sha256sum "$dl/debs/$file" | cut -c1-64) != "$sum" ]]; then
    need+=("${keep[$i]}")
  fi
  i=$((i + 1))
done <"$tmp/work/debs.txt"
if ((${#need[@]})); then
  log "debian: downloading ${#need[@]} packages"
  (cd "$dl/debs" && nice -n 19 apt-get -q -o APT::Sandbox::User=root download "${need[@]}" >&2)
fi

# --- Debian: unpack into the root ---
r=$tmp/work/root
mkdir -p "$r/usr/bin" "$r/usr/sbin" "$r/usr/lib" "$r/usr/lib64"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$r/$d"; done
t0=$SECONDS
while read -r file _; do
  dpkg-deb --fsys-tarfile "$dl/debs/$file" | tar -x --keep-directory-symlink -C "$r"
done <"$tmp/work/debs.txt"
log "debian: unpacked $(du -sm "$r" | cut -f1) MB ($((SECONDS - t0)) s)"

# What maintainer scripts would have done (see Traps).
alt() { [[ -e $r$2 ]] || { log "alternative $1 -> $2: no such file"; exit 1; }; ln -sfn "$2" "$r$1"; }
alt /usr/bin/awk /usr/bin/mawk
alt /usr/bin/which /usr/bin/which.debianutils
alt /usr/lib/x86_64-linux-gnu/libblas.so.3 /usr/lib/x86_64-linux-gnu/blas/libblas.so.3
alt /usr/lib/x86_64-linux-gnu/liblapack.so.3 /usr/lib/x86_64-linux-gnu/lapack/liblapack.so.3
alt /usr/lib/x86_64-linux-gnu/libpsm_infinipath.so.1 /usr/lib/libpsm1/libpsm_infinipath.so.1.16
alt /usr/bin/mpirun /usr/bin/mpirun.openmpi
alt /usr/bin/mpiexec /usr/bin/mpiexec.openmpi
for a in "${BUSYBOX_APPLETS[@]}"; do [[ -e $r/usr/bin/$a ]] || ln -s busybox "$r/usr/bin/$a"; done
ln -sfn bash "$r/usr/bin/sh"   # dash is the Debian default; bash is what tenants' scripts expect
printf '%s\n' 'root:x:0:0:root:/root:/bin/bash' 'sshd:x:100:65534::/run/sshd:/usr/sbin/nologin' \
  'nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin' >"$r/etc/passwd"
printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$r/etc/group"
# '*' (no password), not '!' (locked): sshd refuses public keys for a locked account.
printf '%s\n' 'root:*:19000:0:99999:7:::' 'sshd:*:19000:0:99999:7:::' 'nobody:*:19000:0:99999:7:::' >"$r/etc/shadow"
chmod 640 "$r/etc/shadow"
printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n' >"$r/etc/nsswitch.conf"
cp "$r/usr/share/openssh/sshd_config" "$r/etc/ssh/sshd_config"
# mpi-operator mounts its key Secret at /root/.ssh (group-readable files: StrictModes no);
# Debian's PAM stack is built by postinst (pam-auth-update), so PAM is off.
cat >"$r/etc/ssh/sshd_config.d/tidepool.conf" <<'EOF'
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
EOF
# Workers come and go with new host keys: never ask, never record (as mpi-operator's images).
cat >"$r/etc/ssh/ssh_config.d/tidepool.conf" <<'EOF'
Host *
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
EOF
# Debian's torch 1.13 predates Python 3.11's enum change: iterating an IntFlag skips 0 and
# combined members, so Std.from_str("0") (torchrun's default --redirects and --tee) is None
# and torchrun fails as it starts its workers. Fixed by naming the members.
f=$r/usr/lib/python3/dist-packages/torch/distributed/elastic/multiprocessing/api.py
grep -q '^            for s in Std:$' "$f" || { log "$f changed: check the torchrun fix"; exit 1; }
sed -i 's/^            for s in Std:$/            for s in (Std.NONE, Std.OUT, Std.ERR, Std.ALL):/' "$f"
# OpenMPI's settings in its file, not the environment: ranks that sshd starts in an MPIJob
# worker do not get the image's environment. CMA single copy needs CAP_SYS_PTRACE.
# (Debian's file ends without a newline: start with one.)
printf '\n# tests/images/frameworks.sh: containers lack CAP_SYS_PTRACE for CMA\nbtl_vader_single_copy_mechanism = none\n' \
  >>"$r/etc/openmpi/openmpi-mca-params.conf"
mkdir -p "$r/run/sshd" "$r/root" "$r/tmp" "$r/var/tmp" "$r/etc/tidepool" "$r/opt/tidepool"
chmod 1777 "$r/tmp" "$r/var/tmp"; chmod 700 "$r/root"
# Documentation, translations, the desktop libraries' plugins (loaded only by GUIs) and torch's
# C++ test programs (they link libtorch-test, left out).
rm -rf "$r"/usr/share/{doc,doc-base,man,info,locale,lintian,bug,gtk-doc,help,menu,bash-completion,zsh} \
  "$r"/usr/lib/x86_64-linux-gnu/{qt5,gdk-pixbuf-2.0,gstreamer-1.0,gio,libgphoto2,libgphoto2_port,gdalplugins,dri} \
  "$r"/usr/lib/x86_64-linux-gnu/libgphoto2*/ "$r/var/cache/"* "$r/var/lib/dpkg" \
  "$r"/usr/lib/python3/dist-packages/torch/bin/test_*
cp "$tmp/debian-packages.txt" "$r/opt/tidepool/debian-packages.txt"

# --- pip: TensorFlow and Paddle into their own site ---
p=$tmp/work/pip
wheel_opts=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
            --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
log "pip: downloading what the cache lacks (tests/frameworks/requirements.txt)"
nice -n 19 python3 -m pip download -q --no-deps --require-hashes "${wheel_opts[@]}" -d "$dl/wheels" \
  -r "$programs/requirements.txt" >&2
t0=$SECONDS
nice -n 19 python3 -m pip install -q --root-user-action=ignore --no-deps --require-hashes --only-binary=:all: --no-index \
  --find-links "$dl/wheels" --no-compile --no-warn-script-location --target "$p" \
  -r "$programs/requirements.txt" >&2
# Console scripts name the host's interpreter; headers only build custom ops; tests and
# caches are not needed to train.
rm -rf "$p/bin" "$p/tensorflow/include" "$p/paddle/include" "$p"/*/tests "$p/tensorflow/compiler/mlir"/*/tests
find "$p" -name __pycache__ -prune -exec rm -rf {} +
log "pip: $(du -sm "$p" | cut -f1) MB in /opt/tidepool/pip ($((SECONDS - t0)) s)"

# --- prune the Debian root to what its programs and both sites' modules load ---
# The pip site is moved into the root for the walk (TensorFlow links glibc's librt, which
# nothing of Debian's needs), then out again: it is a layer of its own. glibc's own libraries
# are kept whatever links them: Python's ctypes and the frameworks dlopen them by name.
t0=$SECONDS
mv "$p" "$r/opt/tidepool/pip"
keep=()
for l in libgcc_s.so.1 libc.so.6 libm.so.6 libdl.so.2 librt.so.1 libpthread.so.0 libutil.so.1 \
         libresolv.so.2 libanl.so.1 libnsl.so.1 libmvec.so.1 libBrokenLocale.so.1 libthread_db.so.1; do
  keep+=(--keep "$l")
done
python3 "$here/elf_closure.py" "$r" "${keep[@]}"
mv "$r/opt/tidepool/pip" "$p"
ldconfig -r "$r"
rm -f "$r/var/cache/ldconfig/aux-cache"   # inodes and ctimes: it would change every digest
log "debian: pruned to $(du -sm "$r" | cut -f1) MB ($((SECONDS - t0)) s)"

# --- the programs ---
g=$tmp/work/programs
mkdir -p "$g"
for f in "${PROGRAMS[@]}"; do cp "$programs/$f" "$g/$f"; chmod 755 "$g/$f"; done

# --- the image: three layers, then the config ---
layout=$tmp/work/layout ref=tidepool.invalid/frameworks:1
find "$r" "$p" "$g" -exec touch -h -d "@$epoch" {} +
umoci init --layout "$layout"
umoci new --image "$layout:$ref"
layer() {   # layer SRC DEST NAME
  local t0=$SECONDS
  nice -n 19 umoci insert --image "$layout:$ref" --history.created "$created" \
    --history.created_by "tests/images/frameworks.sh: $3" "$1" "$2"
  log "layer $3: $(du -sm "$1" | cut -f1) MB unpacked ($((SECONDS - t0)) s)"
}
layer "$r" / debian
layer "$p" /opt/tidepool/pip pip
layer "$g" /opt/tidepool programs
umoci config --image "$layout:$ref" --created "$created" --history.created "$created" \
  --history.created_by "tests/images/frameworks.sh: config" --os linux --architecture amd64 \
  --config.cmd /bin/bash --config.workingdir /opt/tidepool \
  --config.env PATH=/opt/tidepool:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.env PYTHONUNBUFFERED=1 \
  --config.env OMPI_ALLOW_RUN_AS_ROOT=1 --config.env OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
umoci gc --layout "$layout"
jq -c --arg n "$ref" '.manifests |= map(.annotations["io.containerd.image.name"] = $n)' \
  "$layout/index.json" >"$layout/index.json.new"
mv "$layout/index.json.new" "$layout/index.json"
tar -C "$layout" --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner \
  -cf "$tmp/frameworks.tar" oci-layout index.json blobs
log "frameworks: $ref $(jq -r '.manifests[0].digest' "$layout/index.json"), $(du -sm "$tmp/frameworks.tar" | cut -f1) MB archive"

rm -rf "$tmp/work"
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s: $out"
echo "$out"
