#!/usr/bin/env bash
# Builds the mcs-dataplane image (mcs-agent + mcs-controller) without a registry or a
# container engine, as an OCI archive that containerd imports:
#
#   bash deploy/image.sh                 # -> target/image/mcs-agent-0.1.0.oci.tar
#   ctr -n k8s.io images import target/image/mcs-agent-0.1.0.oci.tar
#
# The same image as deploy/Containerfile (for users with a registry and an engine): a Debian
# trixie userland with exactly the tools the agent executes (nft, ip; ca-certificates for
# the API server's TLS), our release binaries in /usr/local/bin, entrypoint mcs-agent, command
# `run --source kube`. The rootfs is made by mmdebstrap from the apt sources this machine is
# configured with; buildah (vfs storage, private root under the work directory) assembles and
# writes the archive. Then it checks itself: the archive is unpacked and `mcs-agent
# --version`, `mcs-controller --version`, `nft --version` and `ip -V` run inside it (chroot),
# so a binary that needs a library the image lacks fails here, not on a node.
#
# Env: MCS_IMAGE_NAME (default docker.io/mcs-dataplane/mcs-agent), MCS_IMAGE_TAG (default: the crate
# version), MCS_IMAGE_OUT (default target/image), MCS_IMAGE_BIN_DIR (prebuilt binaries;
# default: cargo build --release). Needs root, mmdebstrap, buildah (scripts/setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
. scripts/env.sh

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# Fully qualified: the name kubelet looks up for the chart's default image.repository
# (mcs-dataplane/mcs-agent, which it normalises to docker.io/...), so an imported archive is found.
name="${MCS_IMAGE_NAME:-docker.io/mcs-dataplane/mcs-agent}"
tag="${MCS_IMAGE_TAG:-$version}"
out="${MCS_IMAGE_OUT:-$root/target/image}"
archive="$out/$(basename "$name")-$tag.oci.tar"
log() { printf '\033[1mimage:\033[0m %s\n' "$*"; }
for tool in mmdebstrap buildah tar strip; do
  command -v "$tool" >/dev/null || { echo "image: $tool not found (run bash scripts/setup.sh)" >&2; exit 1; }
done
[[ $(id -u) == 0 ]] || { echo "image: needs root (mmdebstrap and buildah build as root here)" >&2; exit 1; }

mkdir -p "$out"
work=$(mktemp -d "$out/work.XXXXXX")
container=""
cleanup() {
  if [[ -n "$container" ]]; then
    buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs rm "$container" >/dev/null 2>&1 || true
  fi
  # vfs layers can hold read-only directories.
  chmod -R u+w "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if [[ -n "${MCS_IMAGE_BIN_DIR:-}" ]]; then
  bins="$MCS_IMAGE_BIN_DIR"
else
  log "building the release binaries"
  cargo build --locked --release -q -p mcs-agent -p mcs-controller
  bins="$root/target/release"
fi
for b in mcs-agent mcs-controller; do
  [[ -x "$bins/$b" ]] || { echo "image: $bins/$b missing" >&2; exit 1; }
done

# shellcheck source=deploy/rootfs.sh
. deploy/rootfs.sh
# trixie (nft 1.1): the current stable; the userspace forwarder's rules need nft >= 0.9
# (`socket transparent`), so bookworm's 1.0.6 would do too (proxy/src/userspace/nft.rs).
log "Debian trixie rootfs from $(apt_mirror) (nftables, iproute2, ca-certificates)"
t0=$(date +%s)
debian_rootfs trixie nftables,iproute2,ca-certificates "$work/rootfs.tar"
log "rootfs in $(( $(date +%s) - t0 ))s: $(du -h "$work/rootfs.tar" | cut -f1)"

b() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }
container=$(b from scratch)
b add "$container" "$work/rootfs.tar" / >/dev/null
# Debug information stays out of the image (a debug build's is most of its 200+ MB); the code,
# the embedded eBPF object and the symbols stay.
mkdir -p "$work/bin"
for b in mcs-agent mcs-controller; do
  cp "$bins/$b" "$work/bin/$b"
  strip --strip-debug "$work/bin/$b"
done
b copy --chmod 0755 "$container" "$work/bin/mcs-agent" "$work/bin/mcs-controller" /usr/local/bin/ >/dev/null
b config \
  --entrypoint '["/usr/local/bin/mcs-agent"]' --cmd 'run --source kube' \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --label org.opencontainers.image.title=mcs-dataplane \
  --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.licenses=Apache-2.0 \
  "$container"
b commit --quiet --format oci "$container" "$name:$tag" >/dev/null
rm -f "$archive"
b push --quiet "$name:$tag" "oci-archive:$archive:$name:$tag"

# Self-check: unpack the layers into a directory and run the tools inside it.
log "checking $archive"
check="$work/check"
mkdir -p "$check/oci" "$check/rootfs"
tar -xf "$archive" -C "$check/oci"
manifest=$(python3 -c 'import json,sys; i=json.load(open(sys.argv[1])); print(i["manifests"][0]["digest"].split(":")[1])' "$check/oci/index.json")
python3 - "$check/oci" "$manifest" <<'EOF' >"$check/layers"
import json, sys
d, m = sys.argv[1], sys.argv[2]
man = json.load(open(f"{d}/blobs/sha256/{m}"))
for l in man["layers"]:
    print(l["digest"].split(":")[1])
EOF
while read -r layer; do
  tar -xf "$check/oci/blobs/sha256/$layer" -C "$check/rootfs"
done <"$check/layers"
for cmd in "/usr/local/bin/mcs-agent --version" "/usr/local/bin/mcs-controller --version" \
           "/usr/sbin/nft --version" "/sbin/ip -V"; do
  if ! got=$(chroot "$check/rootfs" $cmd 2>&1); then
    echo "image: '$cmd' does not run in the image: $got" >&2; exit 1
  fi
  log "  in the image: $cmd -> $(tail -1 <<<"$got")"
done
size=$(du -h "$archive" | cut -f1)
log "$name:$tag written to $archive ($size); import with: ctr -n k8s.io images import $archive"
