# Sourced by the scripts: pinned versions and where the cached tools live.
# Override MCS_CACHE to move the cache.
export MCS_CACHE="${MCS_CACHE:-$HOME/.cache/mcs-dataplane}"
export MCS_TOOLS="$MCS_CACHE/tools"
export MCS_STABLE="1.95.0"
export MCS_NIGHTLY="nightly-2026-06-01"
export BPF_LINKER_VERSION="0.13.0"
export KUBE_VERSION="${KUBE_VERSION:-v1.36.3}"
# Where the test harness finds kube-apiserver/kubectl and the build finds bpf-linker.
export MCS_KUBE_BIN_DIR="$MCS_CACHE/kube/$KUBE_VERSION"
export PATH="$MCS_TOOLS/bin:$MCS_KUBE_BIN_DIR:$HOME/.cargo/bin:$PATH"
# bpf-linker is linked against the stable toolchain's libLLVM.
export LD_LIBRARY_PATH="$MCS_CACHE/llvm-prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HELM_VERSION="v3.22.0"
export MCS_HELM_BIN_DIR="$MCS_TOOLS/helm-$HELM_VERSION"
export PATH="$MCS_HELM_BIN_DIR:$PATH"
# CoreDNS (the cluster DNS in front of the agents' clusterset.local DNS in tests), built from
# the Go module proxy.
export COREDNS_VERSION="v1.14.7"
export MCS_COREDNS_BIN_DIR="$MCS_TOOLS/coredns-$COREDNS_VERSION"
export PATH="$MCS_COREDNS_BIN_DIR:$PATH"
