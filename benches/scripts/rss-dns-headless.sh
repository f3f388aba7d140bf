#!/usr/bin/env bash
# The agent's memory with the headless imports issue 32 found hostile: IMPORTS headless
# ServiceImports, each with 10 EndpointSlices of 1,000 ready endpoints × 100 ports (every
# slice within the API's own limits), served by `--dns-listen`, then QUERIES SRV and ANY
# queries at once over TCP and UDP (dig, 20 at a time). Prints the idle RSS, the peak
# (VmHWM) after the queries, the answers' sizes and the rejections. Needs dig (dnsutils);
# after `cargo build --release -p mcs-agent`:
#
#   bash benches/scripts/rss-dns-headless.sh [IMPORTS] [QUERIES]
#
# Files in a temporary directory (one import a file, removed on exit); the agent runs with the
# `log` dataplane and listens on loopback only. Endpoints in 198.19.0.0/16; no traffic but DNS
# on 127.0.0.1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
imports=${1:-10}
queries=${2:-200}
agent=target/release/mcs-agent
[[ -x $agent ]] || { echo "build it first: cargo build --release -p mcs-agent" >&2; exit 2; }
command -v dig >/dev/null || { echo "dig is missing (apt-get install dnsutils)" >&2; exit 2; }
work=$(mktemp -d)
cleanup() {
  [[ -n ${pid:-} ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
python3 - "$imports" "$work" <<'PY'
import sys
n, d = int(sys.argv[1]), sys.argv[2]
ports = "".join(f"  - {{ name: p{p}, protocol: TCP, port: {1000 + p} }}\n" for p in range(100))
for i in range(n):
    out = [f"apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceImport\nmetadata: {{ name: h{i}, namespace: ns }}\nspec:\n  type: Headless\n  ports:\n{ports}"]
    for s in range(10):
        eps = "".join(
            f"  - {{ addresses: [\"198.19.{(s * 1000 + e) // 250}.{(s * 1000 + e) % 250 + 1}\"], hostname: h{e}, conditions: {{ ready: true }} }}\n"
            for e in range(1000))
        out.append(f"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: h{i}-c{s}\n  namespace: ns\n  labels:\n    multicluster.kubernetes.io/service-name: h{i}\n    multicluster.kubernetes.io/source-cluster: c{s}\naddressType: IPv4\nports:\n{ports}endpoints:\n{eps}")
    open(f"{d}/h{i}.yaml", "w").write("---\n".join(out))
PY
port=$((20000 + RANDOM % 10000))
dns=$((30000 + RANDOM % 10000))
"$agent" run --dataplane log --cluster-id c0 --log-level warn \
  --clusterset-ip-cidr 198.18.96.0/19 --metrics-addr "127.0.0.1:$port" \
  --dns-listen "127.0.0.1:$dns" --source "file:$work" 2>"$work/agent.log" &
pid=$!
ok=
for _ in $(seq 1 1200); do
  if curl -sf "127.0.0.1:$port/readyz" >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.1
done
[[ -n $ok ]] || { echo "agent not ready" >&2; tail "$work/agent.log" >&2; exit 1; }
rss() { awk "/$1/{printf \"%.0f\", \$2/1024}" "/proc/$pid/status"; }
echo "offered: $imports headless imports x 10 slices x 1,000 endpoints x 100 ports"
echo "idle: RSS $(rss VmRSS) MiB (peak so far $(rss VmHWM) MiB)"
t0=$(date +%s.%N)
failed=0
batch=()
for ((i = 0; i < queries; i++)); do
  name="h$((i % imports)).ns.svc.clusterset.local"
  case $((i % 4)) in
    0) args=(+tcp "$name" SRV) ;;
    1) args=(+notcp +ignore "$name" SRV) ;;
    2) args=(+tcp "$name" ANY) ;;
    3) args=(+notcp +ignore "nope-$i.c1.$name" A) ;;
  esac
  dig -p "$dns" @127.0.0.1 +tries=1 +time=10 "${args[@]}" >"$work/q$i.out" 2>&1 &
  batch+=($!)
  if ((${#batch[@]} == 20 || i + 1 == queries)); then
    for j in "${batch[@]}"; do wait "$j" || failed=$((failed + 1)); done
    batch=()
  fi
done
t1=$(date +%s.%N)
errors=$(grep -L 'status: NOERROR\|status: NXDOMAIN' "$work"/q*.out | wc -l)
tcp_size=$(grep -h 'MSG SIZE' "$work/q0.out" | awk '{print $NF}')
udp_size=$(grep -h 'MSG SIZE' "$work/q1.out" | awk '{print $NF}')
srv_tcp=$(grep -c 'IN[[:space:]]*SRV' "$work/q0.out" || true)
echo "$queries queries (SRV over TCP and UDP, ANY over TCP, NXDOMAIN under the service), 20 at a time: $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s, $errors without an answer"
echo "one SRV answer: $srv_tcp records, $tcp_size bytes over TCP; $udp_size bytes over UDP (TC)"
echo "after the queries: RSS $(rss VmRSS) MiB, peak $(rss VmHWM) MiB"
curl -s "127.0.0.1:$port/metrics" | grep -E '^mcs_rejected\{|^mcs_dns_truncated_total|^mcs_backends ' || true
((errors == 0 && failed == 0)) || { echo "FAILED: queries without an answer" >&2; exit 1; }
