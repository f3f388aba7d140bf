#!/usr/bin/env bash
# `kubectl mcs` (target/debug/kubectl-mcs, the operator's CLI) on the real ClusterSet:
#   1. `status` on the healthy ClusterSet: exit 0, every member's checks OK (and the JSON
#      form says so); also as a user bound only to the chart's mcs-dataplane-operator roles;
#   2. `explain` on a service exported by c1 and c2 and fine everywhere: exit 0, a line per
#      node of both clusters with its programmed frontends and selected backends, DNS OK;
#   3. `explain` on a service whose exports conflict (c1 port 80, c2 port 8080, both named
#      http): exit 1, names the PortConflict, both sides and the fix;
#   4. `explain` on a ServiceImport with a ClusterSetIP outside the agents' ranges (written as
#      the controller's service account): exit 1, names each agent's rejection and the fix;
#   5. c2's API server stopped: `status` exits 1 and names it; started again: exit 0.
# Outputs are kept in target/operate/ (docs/operating.md's "Real output" shows them).
# Usage: bash scripts/clusterset-operate.sh   (after scripts/clusterset.sh up)
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
need_clusterset operate
MCS="${MCS_CTL:-$root/target/debug/kubectl-mcs}"
[[ -x $MCS ]] || { echo "operate: no $MCS (cargo build -p mcs-ctl)" >&2; exit 1; }
NS=mcs-operate
OUT="$root/target/operate"
mkdir -p "$OUT"
failures=0
say() { printf '\033[1moperate:\033[0m %s\n' "$*"; }
fail() { printf 'operate: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }

c2_stopped=0
cleanup() {
  ((c2_stopped)) && bash scripts/clusterset.sh start c2 kube-apiserver >/dev/null 2>&1
  for c in c1 c2; do
    kc "$c" delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
    kc "$c" delete clusterrolebinding mcs-operate-operator >/dev/null 2>&1 || true
    kc "$c" -n mcs-system delete rolebinding mcs-operate-operator >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

# mcs ARGS...: runs kubectl-mcs; its output in $out, its exit code in $rc.
mcs() {
  rc=0
  out=$("$MCS" "$@" 2>&1) || rc=$?
}
# The output of the last `mcs`, indented, for the log.
show() { sed 's/^/    /' <<<"$out"; }

# 1. Healthy.
say "status on the healthy ClusterSet"
mcs status
show
cp <(printf '%s\n' "$out") "$OUT/status-healthy.txt"
((rc == 0)) || fail "status exited $rc on a healthy ClusterSet"
for c in c1 c2; do
  grep -q "^cluster $c " <<<"$out" || fail "status has no section for $c"
done
grep -q '^  FAIL' <<<"$out" && fail "status on a healthy ClusterSet has a FAIL line"
mcs -o json status
level=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["level"])' <<<"$out" 2>/dev/null || echo "not JSON")
[[ $level == ok || $level == warn ]] || fail "status -o json says level $level"

# With no more than the chart's operator roles (read-only, plus pods/proxy in mcs-system).
say "status as a user bound to the chart's mcs-dataplane-operator roles only"
for c in c1 c2; do
  kc "$c" create clusterrolebinding mcs-operate-operator --clusterrole mcs-dataplane-operator --user mcs-operate-user >/dev/null
  kc "$c" -n mcs-system create rolebinding mcs-operate-operator --role mcs-dataplane-operator --user mcs-operate-user >/dev/null
done
mcs status --as mcs-operate-user
((rc == 0)) || { show; fail "status as mcs-operate-user (the operator roles) exited $rc"; }

# 2.-4. The services (in a namespace of their own; one a previous run left must be gone first).
for c in c1 c2; do kc "$c" delete namespace "$NS" --ignore-not-found --wait=true --timeout=120s >/dev/null; done
say "services: fine (c1 and c2), clash (port 80 in c1, 8080 in c2), stray (a hand-written import outside the ranges)"
for c in c1 c2; do
  if [[ $c == c1 ]]; then clash_port=80; else clash_port=8080; fi
  kc "$c" apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: $NS}
---
apiVersion: v1
kind: Pod
metadata: {name: backend, namespace: $NS, labels: {app: backend}}
spec:
  terminationGracePeriodSeconds: 0
  containers:
  - {name: pause, image: docker.io/mcs-clusterset/pause:1, imagePullPolicy: Never}
---
apiVersion: v1
kind: Service
metadata: {name: fine, namespace: $NS}
spec:
  ipFamilyPolicy: PreferDualStack
  selector: {app: backend}
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: clash, namespace: $NS}
spec:
  selector: {app: backend}
  ports: [{name: http, port: $clash_port, targetPort: 8080}]
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceExport
metadata: {name: fine, namespace: $NS}
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceExport
metadata: {name: clash, namespace: $NS}
YAML
done
# Only the MCS controller may write ServiceImports (the chart's admission policy): the stray
# one is written as its service account, as a controller given other ranges than the agents'
# would write it.
kc c1 --as system:serviceaccount:mcs-system:mcs-controller apply -f - >/dev/null <<YAML
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceImport
metadata: {name: stray, namespace: $NS}
spec:
  type: ClusterSetIP
  ips: [198.19.250.1]
  ports: [{name: http, port: 80, protocol: TCP}]
YAML

# explain_until SECONDS WANT-RC PATTERN... ARGS: explain until it exits WANT-RC with every
# PATTERN (grep -E) in its output.
explain_until() {
  local secs=$1 want=$2 deadline=$((SECONDS + $1)) p ok; shift 2
  local patterns=()
  while [[ $1 != -- ]]; do patterns+=("$1"); shift; done
  shift
  while :; do
    mcs explain "$@"
    ok=1
    ((rc == want)) || ok=0
    for p in "${patterns[@]}"; do grep -Eq -- "$p" <<<"$out" || ok=0; done
    ((ok)) && return 0
    ((SECONDS > deadline)) && { show; fail "explain $* (exit $rc, want $want; patterns ${patterns[*]}) not within ${secs}s"; return 1; }
    sleep 1
  done
}

say "explain fine: every line OK"
node_lines=()
while read -r _ node _; do node_lines+=("^  OK    node $node +[0-9.]+:80/TCP \\((ebpf|userspace)\\): [1-9][0-9]* selected"); done < <(cs_nodes)
explain_until 120 0 "${node_lines[@]}" "^  OK    exported by +c1, c2" "endpoints +c1: [1-9][0-9]*/[0-9]+ ready, c2: [1-9]" "DNS fine.$NS.svc.clusterset.local. A: NoError 198" -- -n "$NS" fine || true
show
cp <(printf '%s\n' "$out") "$OUT/explain-fine.txt"
grep -q '^  FAIL' <<<"$out" && fail "explain on a service fine everywhere has a FAIL line"

say "explain clash: the PortConflict, both sides, the fix"
explain_until 90 1 "c2 exports port 8080/TCP named http, the import uses port 80/TCP named http" \
  "FAIL  export Conflict +True PortConflict" "fix: make the Service's ports" -- "svc/clash" -n "$NS" || true
show
cp <(printf '%s\n' "$out") "$OUT/explain-clash.txt"

say "explain stray: each agent of c1 rejects it (ClusterSetIP outside the ranges)"
c1_nodes=()
while read -r _ node _; do c1_nodes+=("FAIL  node $node +its agent \\((ebpf|userspace)\\) rejects ServiceImport $NS/stray: (vip_not_allowed|hostile_vip)"); done < <(cs_nodes c1)
explain_until 60 1 "${c1_nodes[@]}" "fix: the import's ClusterSetIP is one this agent may not program" -- "$NS/stray" --context c1 || true
show
cp <(printf '%s\n' "$out") "$OUT/explain-stray.txt"

# 5. A member down.
say "c2's API server stopped: status exits 1 and names it"
bash scripts/clusterset.sh stop c2 kube-apiserver
c2_stopped=1
mcs status
show
cp <(printf '%s\n' "$out") "$OUT/status-c2-down.txt"
((rc == 1)) || fail "status exited $rc with c2's API server stopped (want 1)"
grep -Eq '^  FAIL +reachable +API server unreachable' <<<"$out" || fail "status does not say c2's API server is unreachable"
bash scripts/clusterset.sh start c2 kube-apiserver
c2_stopped=0
say "c2's API server started again: status exits 0"
deadline=$((SECONDS + 120))
until mcs status; ((rc == 0)); do
  ((SECONDS > deadline)) && { show; fail "status not back to exit 0 within 120 s of c2's API server's start"; break; }
  sleep 2
done

if ((failures)); then
  say "$failures check(s) FAILED"
  exit 1
fi
say "status and explain: ok"
