#!/usr/bin/env bash
# The agent's peak memory (VmHWM) at its table caps, per dataplane, with the file source:
# IMPORTS ServiceImports × 10 ports × one slice of 10 endpoints (1,000 → 10,000 frontends and
# 100,000 backends, the default caps). As root, after `cargo build --release -p mcs-agent`:
#
#   bash benches/scripts/rss-at-caps.sh [IMPORTS]
#
# Creates a temporary directory, a test cgroup and pin directory (eBPF) and a network namespace
# (userspace); removes them all on exit. Addresses: VIPs in 198.18.96.0/19, endpoints in
# 198.19.0.0/16; no traffic is sent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
imports=${1:-1000}
agent=target/release/mcs-agent
[[ -x $agent ]] || { echo "build it first: cargo build --release -p mcs-agent" >&2; exit 2; }
work=$(mktemp -d)
cg=$(ls -d /sys/fs/cgroup/unified 2>/dev/null || echo /sys/fs/cgroup)/mcs-rss-$$
pins=/sys/fs/bpf/mcs-rss-$$
ns=mcs-rss-$$
cleanup() {
  [[ -n ${pid:-} ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  "$agent" uninstall --bpf-pin-dir "$pins" >/dev/null 2>&1 || true
  rmdir "$cg" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
python3 - "$imports" "$work/objects.yaml" <<'PY'
import sys
n, path = int(sys.argv[1]), sys.argv[2]
out = []
for i in range(n):
    vip = f"198.18.{96 + i // 250}.{i % 250 + 1}"
    ports = ", ".join(f"{{ name: p{p}, protocol: TCP, port: {80 + p} }}" for p in range(10))
    out.append(f"apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: s{i}, namespace: ns }}\nspec: {{ type: ClusterSetIP, ips: [\"{vip}\"], ports: [{ports}] }}\n")
    eps = ", ".join(f"{{ addresses: [\"198.19.{(i * 10 + e) // 250}.{(i * 10 + e) % 250 + 1}\"] }}" for e in range(10))
    sp = ", ".join(f"{{ name: p{p}, protocol: TCP, port: {8080 + p} }}" for p in range(10))
    out.append(f"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{ name: s{i}-c1, namespace: ns, labels: {{ multicluster.kubernetes.io/service-name: s{i}, multicluster.kubernetes.io/source-cluster: c1 }} }}\naddressType: IPv4\nports: [{sp}]\nendpoints: [{eps}]\n")
open(path, "w").write("---\n".join(out))
PY
measure() { # measure DATAPLANE [wrapper...] -- extra agent args...
  local dp=$1; shift
  local wrap=()
  while [[ $1 != -- ]]; do wrap+=("$1"); shift; done; shift
  local port=$((20000 + RANDOM % 10000))
  "${wrap[@]}" "$agent" run --dataplane "$dp" --cluster-id c1 --log-level warn \
    --clusterset-ip-cidr 198.18.96.0/19 --metrics-addr "127.0.0.1:$port" \
    --source "file:$work" "$@" 2>/dev/null &
  pid=$!
  local ok=
  for _ in $(seq 1 600); do
    if "${wrap[@]}" curl -sf "127.0.0.1:$port/readyz" >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.1
  done
  [[ -n $ok ]] || { echo "$dp: agent not ready" >&2; return 1; }
  local fe un hwm metrics
  metrics=$("${wrap[@]}" curl -s "127.0.0.1:$port/metrics")
  fe=$(awk '$1=="mcs_frontends"{print $2}' <<<"$metrics")
  un=$(awk '$1=="mcs_rejected{reason=\"unprogrammable\"}"{print $2}' <<<"$metrics")
  hwm=$(awk '/VmHWM/{printf "%.0f", $2/1024}' "/proc/$pid/status")
  # The wrapper (ip netns exec) execs the agent: same pid.
  echo "$dp: frontends $fe, unprogrammable ${un:-0}, peak RSS ${hwm} MiB"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
}
measure log --
mkdir -p "$cg"
measure ebpf -- --cgroup-root "$cg" --bpf-pin-dir "$pins"
"$agent" uninstall --bpf-pin-dir "$pins" >/dev/null
ip netns add "$ns"; ip -n "$ns" link set lo up
measure userspace ip netns exec "$ns" --
