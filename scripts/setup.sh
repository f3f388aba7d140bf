#!/usr/bin/env bash
# One-time, idempotent set-up of everything mcs-dataplane builds and tests with, on a Debian 12
# machine as root. Caches outside the repo in $MCS_CACHE (default ~/.cache/mcs-dataplane).
#
#   - Debian packages: etcd-server, nftables, iproute2, bpftool, openssl, ...
#   - the pinned stable toolchain (rust-toolchain.toml) and the pinned nightly with rust-src
#     that builds the kernel-side eBPF crate
#   - bpf-linker 0.13.0 linked against the stable toolchain's own LLVM 22
#   - kube-apiserver, kube-controller-manager and kubectl (and the nodes' kube-scheduler, kubelet
#     and kube-proxy), built from the Go module proxy with the machine's Go
#   - helm v3, built from the Go module proxy (renders the chart in CI)
#   - CoreDNS, built from the Go module proxy (in front of the agents' DNS in tests)
#
# Prints the environment to use afterwards as `export` lines on fd 3 when asked:
#   source <(bash scripts/setup.sh --print-env)   # or simply `. scripts/env.sh`
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/env.sh
. "$HERE/env.sh"

log() { printf '\033[1msetup:\033[0m %s\n' "$*"; }
t0=$(date +%s)

# --- Debian packages ---------------------------------------------------------------------------
APT_PKGS=(etcd-server etcd-client nftables iproute2 bpftool openssl jq procps psmisc
  # peers and load generators of the benchmark harness (mcs-bench; its smoke run is in CI)
  haproxy nginx-light libnginx-mod-stream wrk iptables ipvsadm conntrack
  # DNS: dig in the tests, dnsperf in the DNS bench
  dnsutils dnsperf
  # the image without a registry or engine (deploy/image.sh)
  mmdebstrap buildah
  # the real ClusterSet's nodes (scripts/clusterset.sh): container runtime, CNI plugins
  containerd runc containernetworking-plugins curl
  # the chart's alerts (promtool test rules) and dashboard (a real Prometheus scraping the
  # real ClusterSet: scripts/clusterset-monitoring.sh)
  prometheus)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The etcd-server package may start a system etcd; tests start their own.
  # So may haproxy and nginx; the harness starts its own inside its namespaces. And
  # containerd: scripts/clusterset.sh runs one per node with its own configuration.
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now etcd haproxy nginx iperf3 containerd prometheus >/dev/null 2>&1 || true
  fi
  # Without systemd the package's init script may have started a Prometheus of its own.
  if [[ -x /etc/init.d/prometheus ]]; then /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi
else
  log "Debian packages present"
fi

# --- Rust toolchains ---------------------------------------------------------------------------
command -v rustup >/dev/null || { echo "setup: rustup is required (this machine kind ships it)" >&2; exit 1; }
if ! rustup run "$MCS_STABLE" rustc --version >/dev/null 2>&1 ||
   ! rustup component list --toolchain "$MCS_STABLE" --installed 2>/dev/null | grep -q '^clippy'; then
  log "installing Rust $MCS_STABLE with rustfmt and clippy"
  rustup toolchain install "$MCS_STABLE" --profile minimal -c rustfmt -c clippy
fi
if ! rustup component list --toolchain "$MCS_NIGHTLY" --installed 2>/dev/null | grep -q '^rust-src'; then
  log "installing $MCS_NIGHTLY with rust-src (kernel-side eBPF build)"
  rustup toolchain install "$MCS_NIGHTLY" --profile minimal -c rust-src
fi

# --- bpf-linker for LLVM 22, against the stable toolchain's libLLVM -----------------------------
if [[ ! -x "$MCS_TOOLS/bin/bpf-linker" ]] || ! "$MCS_TOOLS/bin/bpf-linker" --version 2>/dev/null | grep -q "$BPF_LINKER_VERSION"; then
  log "building bpf-linker $BPF_LINKER_VERSION (about 2 min)"
  sysroot=$(rustup run "$MCS_STABLE" rustc --print sysroot)
  lib=$(ls "$sysroot"/lib/libLLVM.so.22* 2>/dev/null | head -1)
  [[ -n "$lib" ]] || { echo "setup: no libLLVM.so.22* in $sysroot/lib" >&2; exit 1; }
  prefix="$MCS_CACHE/llvm-prefix"
  rm -rf "$prefix"; mkdir -p "$prefix/lib"
  ln -s "$lib" "$prefix/lib/libLLVM.so"
  ln -s "$lib" "$prefix/lib/$(basename "$lib")"
  LLVM_PREFIX="$prefix" LD_LIBRARY_PATH="$prefix/lib" rustup run "$MCS_STABLE" cargo install --locked --quiet \
    --root "$MCS_TOOLS" "bpf-linker@$BPF_LINKER_VERSION" --no-default-features --features llvm-22
fi
log "bpf-linker $("$MCS_TOOLS/bin/bpf-linker" --version | awk '{print $2}')"

# --- kube-apiserver, kube-controller-manager, kubectl ------------------------------------------
KUBE_VERSION="$KUBE_VERSION" MCS_CACHE="$MCS_CACHE" bash "$HERE/build-kube-apiserver.sh"

# --- helm (renders deploy/helm in CI), built from the Go module proxy ---------------------------
if [[ ! -x "$MCS_HELM_BIN_DIR/helm" ]]; then
  log "building helm $HELM_VERSION from the Go module proxy (about 2 min cold)"
  mkdir -p "$MCS_HELM_BIN_DIR"
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$MCS_HELM_BIN_DIR" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi
log "helm $("$MCS_HELM_BIN_DIR/helm" version --short 2>/dev/null)"

# --- CoreDNS (tests put it in front of the agents' DNS, with our shipped snippets) -----------
if [[ ! -x "$MCS_COREDNS_BIN_DIR/coredns" ]]; then
  log "building CoreDNS $COREDNS_VERSION from the Go module proxy (about 4 min cold)"
  mkdir -p "$MCS_COREDNS_BIN_DIR"
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$MCS_COREDNS_BIN_DIR" go install "github.com/coredns/coredns@$COREDNS_VERSION"
fi
log "$("$MCS_COREDNS_BIN_DIR/coredns" -version 2>/dev/null | head -1)"

# --- bpffs (eBPF maps are pinned there) ---------------------------------------------------------
if ! mount | grep -q ' /sys/fs/bpf type bpf'; then
  mkdir -p /sys/fs/bpf && mount -t bpf bpf /sys/fs/bpf || log "could not mount bpffs (not root?)"
fi

log "done in $(( $(date +%s) - t0 ))s"
