#!/usr/bin/env bash
# Quick side-by-side of the userspace forwarder against a direct connection and HAProxy
# (interim, until the mcs-bench harness of issue 6). As root, after `bash scripts/setup.sh`
# and `cargo build --release -p mcs-agent`; installs haproxy, nginx-light and wrk from Debian.
#
#   bash benches/scripts/quick-compare.sh [SECONDS_PER_RUN] [REPEATS]
#
# Topology (network namespaces, 198.18.0.0/15 only), everything removed on exit:
#   cli 198.18.30.2 ── node 198.18.30.1 | 198.18.31.1 ── be 198.18.31.2:8080 (nginx, 1 worker)
# Modes: direct (client → backend IP, routed by the node's kernel), mcs-ebpf (client in a
# cgroup with the socket LB attached → ClusterSetIP 198.18.100.11:80, rewritten at connect to
# the backend, then routed like direct), mcs-userspace (client → ClusterSetIP
# 198.18.100.10:80, mcs-agent TPROXY forwarder on the node), haproxy (client →
# 198.18.30.1:80, HAProxy on the node, mode tcp, 2 threads, splice). Workloads with wrk -t2 -c50: keep-alive
# requests/s, and new connections/s (Connection: close). Runs interleaved; prints medians.
set -euo pipefail
DUR="${1:-5}"
REPS="${2:-3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
AGENT="$ROOT/target/release/mcs-agent"
[[ -x "$AGENT" ]] || { echo "build first: cargo build --release -p mcs-agent" >&2; exit 1; }
for p in haproxy nginx wrk; do
  command -v "$p" >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy nginx-light wrk >/dev/null; break; }
done
P="mcsq$$"
WORK="$(mktemp -d)"
PINS="/sys/fs/bpf/$P"
CG2="$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)"
CG="$CG2/$P"
cleanup() {
  set +e
  [[ -n "${AGENT_PID:-}" ]] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null
  [[ -n "${EBPF_PID:-}" ]] && kill "$EBPF_PID" 2>/dev/null && wait "$EBPF_PID" 2>/dev/null
  "$AGENT" uninstall --bpf-pin-dir "$PINS" >/dev/null 2>&1
  [[ -n "${CG:-}" ]] && rmdir "$CG" 2>/dev/null
  [[ -f "$WORK/haproxy.pid" ]] && kill "$(cat "$WORK/haproxy.pid")" 2>/dev/null
  [[ -f "$WORK/nginx.pid" ]] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null
  for n in cli node be; do ip netns del "$P$n" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
for n in cli node be; do ip netns add "$P$n"; ip -n "$P$n" link set lo up; done
ip -n "${P}cli" link add eth0 type veth peer name cli0 netns "${P}node"
ip -n "${P}node" link add be0 type veth peer name eth0 netns "${P}be"
ip -n "${P}cli" addr add 198.18.30.2/24 dev eth0; ip -n "${P}cli" link set eth0 up
ip -n "${P}node" addr add 198.18.30.1/24 dev cli0; ip -n "${P}node" link set cli0 up
ip -n "${P}node" addr add 198.18.31.1/24 dev be0; ip -n "${P}node" link set be0 up
ip -n "${P}be" addr add 198.18.31.2/24 dev eth0; ip -n "${P}be" link set eth0 up
ip -n "${P}cli" route add default via 198.18.30.1
ip -n "${P}be" route add default via 198.18.31.1
ip netns exec "${P}node" sysctl -qw net.ipv4.ip_forward=1

cat > "$WORK/nginx.conf" <<NGX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server { listen 198.18.31.2:8080; location / { return 200 "ok\n"; } }
}
NGX
ip netns exec "${P}be" nginx -c "$WORK/nginx.conf"

cat > "$WORK/haproxy.cfg" <<HAP
global
  nbthread 2
  pidfile $WORK/haproxy.pid
  daemon
  maxconn 4096
defaults
  mode tcp
  timeout connect 2s
  timeout client 60s
  timeout server 60s
  option splice-auto
listen vip
  bind 198.18.30.1:80
  server be 198.18.31.2:8080
HAP
ip netns exec "${P}node" haproxy -f "$WORK/haproxy.cfg"

mkdir -p "$WORK/objects"
cat > "$WORK/objects/objects.yaml" <<OBJ
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: { name: web, namespace: bench }
spec: { type: ClusterSetIP, ips: ["198.18.100.10"], ports: [{ name: http, protocol: TCP, port: 80 }] }
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-c1
  namespace: bench
  labels: { multicluster.kubernetes.io/service-name: web, multicluster.kubernetes.io/source-cluster: c1 }
addressType: IPv4
ports: [{ name: http, protocol: TCP, port: 8080 }]
endpoints: [{ addresses: ["198.18.31.2"], conditions: { ready: true } }]
OBJ
ip netns exec "${P}node" "$AGENT" run --dataplane userspace --cluster-id c1 \
  --metrics-addr 127.0.0.1:9464 --source "file:$WORK/objects" ${MCS_AGENT_ARGS:-} 2>"$WORK/agent.log" &
AGENT_PID=$!
for _ in $(seq 100); do
  ip netns exec "${P}node" bash -c 'exec 3<>/dev/tcp/127.0.0.1/9464; printf "GET /readyz HTTP/1.0\r\n\r\n" >&3; grep -q "200 OK" <&3' 2>/dev/null && break
  sleep 0.1
done

# The eBPF socket LB: its own ServiceImport (198.18.100.11), attached to a cgroup that only the
# mcs-ebpf client joins; the agent runs outside the netns (it touches no network config).
mkdir -p "$CG" "$WORK/objects-ebpf"
sed 's/198.18.100.10/198.18.100.11/' "$WORK/objects/objects.yaml" > "$WORK/objects-ebpf/objects.yaml"
"$AGENT" run --dataplane ebpf --cluster-id c1 --cgroup-root "$CG" --bpf-pin-dir "$PINS" \
  --metrics-addr 127.0.0.1:0 --source "file:$WORK/objects-ebpf" 2>"$WORK/agent-ebpf.log" &
EBPF_PID=$!
for _ in $(seq 100); do "$AGENT" status --bpf-pin-dir "$PINS" 2>/dev/null | grep -q '198.18.100.11:80/TCP' && break; sleep 0.1; done

declare -A URL=([direct]="http://198.18.31.2:8080/" [mcs-ebpf]="http://198.18.100.11/" [mcs-userspace]="http://198.18.100.10/" [haproxy]="http://198.18.30.1/")
MODES=(direct mcs-ebpf mcs-userspace haproxy)
run() { # mode, extra wrk args -> req/s
  if [[ "$1" == mcs-ebpf ]]; then
    sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$CG" ip netns exec "${P}cli" wrk -t2 -c50 -d"${DUR}s" "${@:2}" "${URL[$1]}" | awk '/Requests\/sec/ {print $2}'
  else
    ip netns exec "${P}cli" wrk -t2 -c50 -d"${DUR}s" "${@:2}" "${URL[$1]}" | awk '/Requests\/sec/ {print $2}'
  fi
}
declare -A KA CRR
for r in $(seq "$REPS"); do
  for m in "${MODES[@]}"; do
    KA[$m]+="$(run "$m") "
    CRR[$m]+="$(run "$m" -H 'Connection: close') "
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
minmax() { tr ' ' '\n' | grep -v '^$' | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {printf "%.0f-%.0f", lo, hi}'; }
d_ka=$(echo "${KA[direct]}" | median); d_crr=$(echo "${CRR[direct]}" | median)
echo
echo "wrk -t2 -c50 -d${DUR}s, $REPS interleaved runs, medians (min-max); ratio to direct"
printf "| %-14s | %-28s | %-28s |\n" mode "keep-alive req/s" "new connections/s"
printf "|%s|%s|%s|\n" "----------------" "------------------------------" "------------------------------"
for m in "${MODES[@]}"; do
  ka=$(echo "${KA[$m]}" | median); crr=$(echo "${CRR[$m]}" | median)
  printf "| %-14s | %7.0f (%.2f) [%s] | %7.0f (%.2f) [%s] |\n" "$m" "$ka" "$(echo "$ka / $d_ka" | bc -l)" "$(echo "${KA[$m]}" | minmax)" \
    "$crr" "$(echo "$crr / $d_crr" | bc -l)" "$(echo "${CRR[$m]}" | minmax)"
done
