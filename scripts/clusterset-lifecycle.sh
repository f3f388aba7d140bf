#!/usr/bin/env bash
# Day 2 under load, on the real ClusterSet of scripts/clusterset.sh (up, with mcs-dataplane
# installed on eBPF): each step runs while a probe in a client pod on every node of c1 opens
# new TCP connections to the ClusterSetIP of `web` (exported by c1 and c2) at --rate per second,
# sends UDP requests at the same rate on one flow (mcs-bench probe: every reply checked
# whole) and asks its node's agent `dns-version.clusterset.local` at the same rate (UDP,
# NOERROR required, 2 s wait), and counts tried / failed / cut / longest gap. The steps:
#
#   upgrade-ebpf      helm upgrade to a new image (the same binaries, another tag: deploy/image.sh
#                     with MCS_IMAGE_TAG), agents and controllers; 0 failed required. The
#                     ServiceImports are not rewritten (resourceVersions unchanged), and an export
#                     made during the rollout is imported after it.
#   rollback-ebpf     helm rollback to the release before: the same checks.
#   agents-deleted    every agent pod of c1 deleted at once (eBPF); 0 failed required.
#   to-userspace      helm upgrade --set dataplane=userspace (eBPF -> userspace); counted.
#   upgrade-userspace helm upgrade to the new image on the userspace dataplane (the chart rolls
#                     it with maxSurge: the next agent takes the old one's DNS and metrics
#                     sockets and listens beside it on the frontends; the old one waits for it
#                     before closing); 0 TCP failed required. UDP and DNS are counted: a reply
#                     in flight to the old agent when it closes its flow is lost; a DNS query
#                     can wait (2 s and more) for a next agent the kubelet saw ready through
#                     the old one's answer on the shared metrics socket.
#   rollback-userspace the same, back to the release before.
#   to-ebpf           back to eBPF; counted.
#   drain-ebpf, drain-userspace
#                     kubectl drain of c1's second node (its web pod evicted), then c1's remaining
#                     backends killed outright (SIGKILL; their slices still say ready until the
#                     readiness probe fails): traffic moves to the other node's pod, then to c2,
#                     and back once kubelet restarted them. Counted (userspace retries the next
#                     cluster when every local backend refuses; eBPF cannot retry).
#   blackhole-ebpf, blackhole-userspace
#                     packets to one of c1's web pods (on c1's second node; the pods are spread
#                     one per node first) dropped in every node of the ClusterSet for 15 s, no reset (a backend gone dark: its slices
#                     still say ready, kubelet's probes come from its own node): each client
#                     stops choosing it after one slow connect (eBPF: per client pod, at the
#                     SYN's first retransmission; userspace: per node, at --connect-timeout-ms).
#                     Counted.
#   node-dark-ebpf, node-dark-userspace
#                     c1's second node's pod network unreachable from every other node (and its
#                     pods from reaching theirs) for 15 s: the probes on the other nodes lose
#                     that node's web pod, the probe on it every backend but its own node's.
#                     Counted.
#   crd-upgrade       before it (not measured) c2 is put on upstream v0.4.1's CRDs (v1alpha1
#                     only; ours deleted, c2's exports made again in v1alpha1). Under load: ours
#                     applied over them, c2's exports written again and storedVersions trimmed,
#                     v1alpha1 no longer served (c1's controller moves to v1beta1), an export
#                     made in v1beta1 imported, ours applied again. 0 failed required, and c1's
#                     ServiceImports and slices of c2's endpoints not written (resourceVersions).
#   crd-not-served    c2 serves ServiceExport in no version for 20 s: c1's controller counts
#                     it failing (its imports ClustersReachable=False), keeps its exports and
#                     endpoints (no import deleted, slices unchanged); 0 failed required.
#   soak              (with --soak MINUTES, after the steps) churn under load: an export made
#                     and an older one deleted every 2 s (in c1 and c2 by turns), c2's web
#                     scaled 2 <-> 3 (endpoints coming and going in the ClusterSet), c2's API
#                     server restarted at a quarter; 0 failed required, and the RSS of every
#                     agent and controller at half time must grow less than 10 % by the end.
#
# A step marked "0 required" fails the script if any request failed or came back cut; the
# others are measured and shown. The table is printed (and written to
# $STATE/lifecycle/table.md); everything the suite creates is deleted on exit and the chart is
# left on eBPF at the release it found.
#
#   bash scripts/clusterset-lifecycle.sh [--steps a,b,...] [--rate N] [--soak MINUTES]
#
# The probe and the backends are mcs-bench (MCS_BENCH_BIN_DIR, default target/debug), run in
# the pods from a read-only hostPath of that directory (the node filesystem is this machine's).
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
need_clusterset lifecycle

STEPS=upgrade-ebpf,rollback-ebpf,agents-deleted,drain-ebpf,blackhole-ebpf,node-dark-ebpf,to-userspace,upgrade-userspace,rollback-userspace,drain-userspace,blackhole-userspace,node-dark-userspace,to-ebpf,crd-upgrade,crd-not-served
RATE=50
# The agents' clusterset.local DNS port on each node's address (the chart's dns.port, which
# scripts/clusterset.sh keeps).
AGENT_DNS_PORT=10053
SOAK=0
while (($#)); do
  case $1 in
    --soak) SOAK=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "lifecycle: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
BENCH_DIR=${MCS_BENCH_BIN_DIR:-$root/target/debug}
[[ -x $BENCH_DIR/mcs-bench ]] || { echo "lifecycle: no $BENCH_DIR/mcs-bench (cargo build -p mcs-bench)" >&2; exit 1; }
NS="life-$(date +%s)"
RUN="$STATE/lifecycle/$NS"
TABLE="$STATE/lifecycle/table.md"
NEXT_TAG=lifecycle-next
mkdir -p "$RUN"
failures=0
c2_crds_changed=0 # c2's MCS CRDs are not ours as installed (put back on exit)
say() { printf '\033[1mlifecycle:\033[0m %s\n' "$*"; }
fail() { printf 'lifecycle: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }
clusters=$(kubectl config get-contexts -o name | grep -E '^c[0-9]+$' | sort -V)
helm_c() { local c=$1; shift; helm --kube-context "$c" "$@"; }
# The revision of cluster $1's mcs-dataplane release now.
release_of() { helm_c "$1" status mcs-dataplane -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])'; }
# The release each cluster had when the suite started: put back on exit.
declare -A first_rev
for c in $clusters; do
  first_rev[$c]=$(release_of "$c")
done
# --- a backend or a node gone dark ---------------------------------------------------------------
# An nftables table in every node's namespace that drops, before anything else, forwarded
# (pods') and locally sent (the node's, the userspace forwarder's) packets matching RULE.
DARK_TABLE=mcs_lifecycle_dark
dark() { # dark NETNS RULE...: one table per node, its rules in both hooks
  local ns=$1; shift
  {
    echo "add table inet $DARK_TABLE"
    echo "add chain inet $DARK_TABLE dark_forward { type filter hook forward priority -310; }"
    echo "add chain inet $DARK_TABLE dark_output { type filter hook output priority -310; }"
    local r
    for r in "$@"; do
      echo "add rule inet $DARK_TABLE dark_forward $r drop"
      echo "add rule inet $DARK_TABLE dark_output $r drop"
    done
  } | ip netns exec "$ns" nft -f -
}
lights_on() { # every node's table gone (also at exit, whatever happened)
  local ns
  for ns in $(cs_nodes | awk '{print $3}'); do
    ip netns exec "$ns" nft delete table inet "$DARK_TABLE" 2>/dev/null || true
  done
}
cleanup() {
  local rc=$?
  jobs -p | xargs -r kill 2>/dev/null || true
  lights_on
  if ((c2_crds_changed)); then ours_in_c2 || echo "lifecycle: c2's MCS CRDs could not be made ours again (kubectl apply --server-side -k deploy/crds)" >&2; fi
  for c in $clusters; do
    kc "$c" delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
    kc "$c" uncordon --all >/dev/null 2>&1 || true
  done
  rm -rf "$RUN"
  exit "$rc"
}
trap cleanup EXIT

# --- the service and the clients ---------------------------------------------------------------
bench_volume="{name: bench, hostPath: {path: $BENCH_DIR, type: Directory}}"
backends() { # backends CLUSTER REPLICAS: web, TCP 80 and UDP 9000 -> mcs-bench serve on 8080
  cat <<EOF | kc "$1" apply -f - >/dev/null
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: $NS}
spec:
  replicas: $2
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: 5
      affinity: {podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 100, podAffinityTerm: {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: web}}}}]}}
      containers:
      - name: web
        image: docker.io/nicolaka/netshoot:v0.15
        imagePullPolicy: Never
        command: [/opt/bench/mcs-bench, serve, --listen, "0.0.0.0:8080", --name, "$1/\$(POD_NAME)"]
        env: [{name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]
        ports: [{containerPort: 8080}, {containerPort: 8080, protocol: UDP}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
        volumeMounts: [{name: bench, mountPath: /opt/bench, readOnly: true}]
      volumes: [$bench_volume]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: $NS}
spec:
  selector: {app: web}
  ports: [{name: tcp, port: 80, targetPort: 8080}, {name: udp, port: 9000, targetPort: 8080, protocol: UDP}]
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceExport
metadata: {name: web, namespace: $NS}
spec: {}
EOF
}
nodes_c1=$(cs_nodes c1 | awk '{print $2}')
say "namespace $NS: web (mcs-bench serve) exported by c1 (a pod per node) and c2 (2 pods); a probe pod on every node of c1"
for c in $clusters; do kc "$c" create namespace "$NS" >/dev/null; done
backends c1 "$(wc -w <<<"$nodes_c1")"
backends c2 2
for n in $nodes_c1; do
  cat <<EOF | kc c1 apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: probe-$n, namespace: $NS}
spec:
  nodeName: $n
  terminationGracePeriodSeconds: 1
  containers:
  - name: probe
    image: docker.io/nicolaka/netshoot:v0.15
    imagePullPolicy: Never
    command: [sleep, "3600"]
    volumeMounts: [{name: bench, mountPath: /opt/bench, readOnly: true}, {name: run, mountPath: /run/life}]
  volumes: [$bench_volume, {name: run, hostPath: {path: $RUN, type: Directory}}]
EOF
done
for c in $clusters; do
  until_ok 120 "web Ready in $c" kc "$c" -n "$NS" rollout status deploy/web --timeout=2s || exit 1
done
until_ok 60 "probe pods Ready" kc c1 -n "$NS" wait --for=condition=Ready pod --all --timeout=2s || exit 1
vip=""
until_ok 60 "ServiceImport web with a ClusterSetIP in c1" \
  sh -c "kubectl --context c1 -n $NS get serviceimport web -o jsonpath='{.spec.ips[0]}' | grep -q ." || exit 1
vip=$(kc c1 -n "$NS" get serviceimport web -o jsonpath='{.spec.ips[0]}')
# Both clusters' backends reach every probe before the steps start.
probe_once() { # probe_once NODE: one second of probing; whole replies from both clusters
  kc c1 -n "$NS" exec "probe-$1" -- /opt/bench/mcs-bench probe --tcp "$vip:80" --udp "$vip:9000" \
    --rate 20 --max-seconds 1 | python3 -c '
import json, sys
r = json.load(sys.stdin)
ok = r["tcp"]["ok"] == r["tcp"]["tried"] and r["udp"]["answered"] == r["udp"]["tried"]
sys.exit(0 if ok else 1)'
}
for n in $nodes_c1; do until_ok 60 "every probe request answered from $n through $vip" probe_once "$n" || exit 1; done
say "ServiceImport web in c1: ClusterSetIP $vip; probes from $(tr '\n' ' ' <<<"$nodes_c1")answered"

# --- steps -------------------------------------------------------------------------------------
rollout_all() { # every cluster's agents and controllers rolled out
  local c
  for c in $clusters; do
    kc "$c" -n mcs-system rollout status ds/mcs-agent --timeout=300s >/dev/null || fail "$c: agents not rolled out"
    kc "$c" -n mcs-system rollout status deploy/mcs-controller --timeout=300s >/dev/null || fail "$c: controllers not rolled out"
  done
}
upgrade() { # upgrade KEY=VALUE...: helm upgrade --reuse-values in every cluster, then the rollout
  local c sets=() kv
  for kv in "$@"; do sets+=(--set "$kv"); done
  for c in $clusters; do
    helm_c "$c" upgrade mcs-dataplane deploy/helm/mcs-dataplane --reuse-values "${sets[@]}" >/dev/null ||
      fail "$c: helm upgrade $*"
  done
  rollout_all
}
declare -A before_rev
rollback() { # to the release each cluster had before the last upgrade
  local c
  for c in $clusters; do
    helm_c "$c" rollback mcs-dataplane "${before_rev[$c]}" >/dev/null || fail "$c: helm rollback to ${before_rev[$c]}"
  done
  rollout_all
}
remember_rev() {
  local c
  for c in $clusters; do
    before_rev[$c]=$(release_of "$c")
  done
}
import_versions() { # "cluster/ns/name=resourceVersion" of the suite's ServiceImports, sorted
  local c
  for c in $clusters; do
    kc "$c" -n "$NS" get serviceimports -o jsonpath='{range .items[*]}'"$c"'/{.metadata.namespace}/{.metadata.name}={.metadata.resourceVersion}{"\n"}{end}'
  done | sort
}
import_ready() { # CLUSTER NAME: the suite's ServiceImport NAME in CLUSTER has Ready=True
  [[ $(kc "$1" -n "$NS" get serviceimport "$2" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]
}
next_image() {
  local img="$STATE/images/mcs-agent-$NEXT_TAG.oci.tar"
  if [[ ! -f $img ]]; then
    say "   building the next image (the same binaries, tag $NEXT_TAG) and importing it into every node"
    MCS_IMAGE_BIN_DIR="${MCS_IMAGE_BIN_DIR:-$root/target/debug}" MCS_IMAGE_TAG=$NEXT_TAG MCS_IMAGE_OUT="$STATE/images" \
      bash deploy/image.sh >"$STATE/images-next.log" 2>&1 || { tail -20 "$STATE/images-next.log" >&2; return 1; }
    bash scripts/clusterset.sh import-image "$img" >/dev/null
  fi
}
# A step that changes the chart's images: imports untouched, and an export made during it
# imported after it (by every other cluster).
with_import_checks() {
  local before after c t=$((++late_exports))
  before=$(import_versions)
  kc c2 -n "$NS" create service clusterip "late-$t" --tcp=80:8080 >/dev/null
  printf 'apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: late-%s, namespace: %s}\n' "$t" "$NS" |
    kc c2 apply -f - >/dev/null
  "$@"
  # Imported = its status written too (Ready): an import whose status write was still on its
  # way when the next step took its resourceVersions looked rewritten by that step (CI once).
  for c in $clusters; do
    until_ok 120 "$c imports late-$t (status Ready), exported during the step" import_ready "$c" "late-$t" || true
  done
  after=$(import_versions | grep -v "/$NS/late-$t=")
  local changed
  changed=$(comm -13 <(grep -v "/$NS/late-$t=" <<<"$before") <(sort <<<"$after") | tr '\n' ' ')
  if [[ -n $changed ]]; then fail "ServiceImports rewritten by the step: $changed"; else say "   ServiceImports untouched ($(wc -l <<<"$before") resourceVersions the same); late-$t imported everywhere"; fi
}
late_exports=0

{
  echo "| step | dataplane | TCP tried | failed | cut | longest gap (ms) | UDP tried | lost / refused / wrong | longest gap (ms) | DNS tried | failed | took (s) | required |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} >"$TABLE"
# step NAME DATAPLANE REQUIRED(zero|tcp-zero|measured) ACTION...: the action under load from
# every probe (tcp-zero: no TCP connection may fail or be cut; UDP is measured). DNS is
# measured in every step.
step() {
  local name=$1 dp=$2 required=$3; shift 3
  say "$name ($dp): under load"
  rm -f "$RUN/stop"
  local n pids=()
  for n in $nodes_c1; do
    kc c1 -n "$NS" exec "probe-$n" -- /opt/bench/mcs-bench probe --tcp "$vip:80" --udp "$vip:9000" \
      --dns "$(cs_nodes c1 | awk -v n="$n" '$2 == n { print $4 }'):$AGENT_DNS_PORT" \
      --rate "$RATE" --stop-file /run/life/stop --max-seconds $((900 + 60 * SOAK)) >"$RUN/$name-$n.json" 2>"$RUN/$name-$n.err" &
    pids+=($!)
  done
  # Load before the step (the probes' first seconds), the step, load after it.
  sleep 3
  local t0=$SECONDS
  # A failed action is counted and the step still reports what the probes saw.
  "$@" || fail "$name: the step did not complete"
  local took=$((SECONDS - t0))
  sleep 3
  touch "$RUN/stop"
  local p
  for p in "${pids[@]}"; do wait "$p" || fail "$name: a probe ended badly: $(cat "$RUN/$name"-*.err)"; done
  local row
  row=$(python3 - "$name" "$dp" "$took" "$required" "$RUN/$name"-*.json <<'PYEOF'
import json, sys
name, dp, took, required, files = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
t = dict(tried=0, failed=0, cut=0, gap=0.0)
u = dict(tried=0, lost=0, refused=0, wrong=0, gap=0.0)
d = dict(tried=0, failed=0)
errors = []
for f in files:
    r = json.load(open(f))
    tcp, udp = r["tcp"], r["udp"]
    t["tried"] += tcp["tried"]; t["failed"] += tcp["failed"]; t["cut"] += tcp["incomplete"]
    t["gap"] = max(t["gap"], tcp["longest_gap_ms"])
    u["tried"] += udp["tried"]; u["lost"] += udp["lost"]; u["refused"] += udp["refused"]; u["wrong"] += udp["wrong"]
    u["gap"] = max(u["gap"], udp["longest_gap_ms"])
    dns = r.get("dns") or {}
    d["tried"] += dns.get("tried", 0)
    d["failed"] += dns.get("lost", 0) + dns.get("refused", 0) + dns.get("wrong", 0)
    for e in (tcp.get("first_error"), udp.get("first_error"), dns.get("first_error")):
        if e: errors.append(e)
bad = t["failed"] + t["cut"] + (0 if required == "tcp-zero" else u["lost"] + u["refused"] + u["wrong"])
gate = {"zero": "0 failed (TCP, UDP)", "tcp-zero": "0 TCP failed"}.get(required, "measured")
print(f'| {name} | {dp} | {t["tried"]} | {t["failed"]} | {t["cut"]} | {t["gap"]:.0f} | {u["tried"]} | {u["lost"]} / {u["refused"]} / {u["wrong"]} | {u["gap"]:.0f} | {d["tried"]} | {d["failed"]} | {took} | {gate} |')
print(bad)
print("; ".join(errors[:3]))
PYEOF
  )
  local line bad errs
  line=$(sed -n 1p <<<"$row"); bad=$(sed -n 2p <<<"$row"); errs=$(sed -n 3p <<<"$row")
  echo "$line" >>"$TABLE"
  say "   $line"
  [[ -n $errs ]] && say "   first problems: $errs"
  if [[ $required != measured ]] && ((bad > 0)); then fail "$name: $bad request(s) failed, cut or lost where 0 are required ($errs)"; fi
}

agent_pods() { # name=ready of c1's agent pods
  kc c1 -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent \
    -o jsonpath='{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}'
}
# Every agent pod is a new one and Ready, one per node.
agents_replaced() {
  local now; now=$(agent_pods)
  [[ $(grep -c '=True$' <<<"$now") == "$(wc -w <<<"$nodes_c1")" ]] || return 1
  [[ $(wc -l <<<"$now") == "$(wc -w <<<"$nodes_c1")" ]] || return 1
  ! grep -qxFf <(sed 's/=.*//' <<<"$old_agents") <(sed 's/=.*//' <<<"$now")
}
delete_agents() {
  old_agents=$(agent_pods)
  kc c1 -n mcs-system delete pods -l app.kubernetes.io/name=mcs-agent --wait=false >/dev/null
  until_ok 180 "c1's agents replaced and Ready" agents_replaced
}
drain() {
  local second
  second=$(sed -n 2p <<<"$nodes_c1")
  if [[ -n $second ]]; then
    kc c1 drain "$second" --ignore-daemonsets --delete-emptydir-data --pod-selector app=web --timeout=120s >/dev/null ||
      fail "drain of $second"
    until_ok 60 "web of c1 without a pod on $second" sh -c \
      "! kubectl --context c1 -n $NS get pods -l app=web --field-selector spec.nodeName=$second -o name | grep -q ."
  fi
  # The remaining backends of c1 killed outright (SIGKILL from the host, as a crash or the OOM
  # killer would): their EndpointSlices still say ready until the readiness probe fails, so
  # the first connections meet refusals; then kubelet restarts them.
  until_ok 120 "c1's web rolled out again after the drain" kc c1 -n "$NS" rollout status deploy/web --timeout=2s
  restarts() { kc c1 -n "$NS" get pods -l app=web -o jsonpath='{range .items[*]}{.status.containerStatuses[0].restartCount}{"\n"}{end}' | awk '{s += $1} END {print s + 0}'; }
  local r0; r0=$(restarts)
  pkill -9 -f -- "mcs-bench serve --listen 0.0.0.0:8080 --name c1/" || fail "drain: no backend process of c1 to kill"
  restarted() { (($(restarts) > r0)); }
  until_ok 60 "c1's web containers restarted by kubelet after the kill" restarted
  until_ok 120 "c1's web ready again" kc c1 -n "$NS" rollout status deploy/web --timeout=2s
  if [[ -n $second ]]; then kc c1 uncordon "$second" >/dev/null; fi
}
# c1's second node (its first if it has one): name, netns, and its pod ranges' rules.
dark_node() { cs_nodes c1 | awk 'NR == 2 || (NR == 1 && c == 0) { line = $0 } { c++ } END { print line }'; }
# c1's web pods one per node again (a drain leaves them on one node), before a dark step, so
# that each measures the same placement: a pod of a node that has two is deleted and its
# replacement goes where the Deployment's anti-affinity prefers, a node without one.
web_nodes() { kc c1 -n "$NS" get pods -l app=web --field-selector status.phase=Running -o jsonpath='{range .items[*]}{.spec.nodeName} {.metadata.name}{"\n"}{end}' | sort; }
web_spread() { (($(web_nodes | awk '{print $1}' | sort -u | wc -l) >= $(wc -w <<<"$nodes_c1"))); }
spread_web() {
  local try pod n
  for try in 1 2 3; do
    web_spread && break
    pod=$(web_nodes | awk 'seen[$1]++ { print $2; exit }')
    say "   c1's web pods share a node: $pod deleted so its replacement spreads them again"
    kc c1 -n "$NS" delete pod "$pod" --wait=false >/dev/null
    until_ok 120 "c1's web rolled out again" kc c1 -n "$NS" rollout status deploy/web --timeout=2s || return 1
    until_ok 30 "c1's old web pod gone" sh -c "! kubectl --context c1 -n $NS get pod $pod >/dev/null 2>&1" || return 1
  done
  web_spread || return 1
  for n in $nodes_c1; do until_ok 60 "every probe request answered from $n through $vip" probe_once "$n" || return 1; done
}
blackhole() {
  local node pod ips ip rules=() ns
  node=$(dark_node | awk '{print $2}')
  pod=$(kc c1 -n "$NS" get pods -l app=web --field-selector "spec.nodeName=$node" -o jsonpath='{.items[0].metadata.name}')
  [[ -n $pod ]] || pod=$(kc c1 -n "$NS" get pods -l app=web -o jsonpath='{.items[0].metadata.name}')
  ips=$(kc c1 -n "$NS" get pod "$pod" -o jsonpath='{range .status.podIPs[*]}{.ip}{"\n"}{end}')
  [[ -n $ips ]] || { fail "blackhole: no web pod on $node"; return 1; }
  for ip in $ips; do
    if [[ $ip == *:* ]]; then rules+=("ip6 daddr $ip"); else rules+=("ip daddr $ip"); fi
  done
  say "   packets to c1's $pod ($(tr '\n' ' ' <<<"$ips")) dropped on every node for 15 s"
  for ns in $(cs_nodes | awk '{print $3}'); do dark "$ns" "${rules[@]}" || fail "blackhole: nft in $ns"; done
  sleep 15
  lights_on
}
node_dark() {
  local line name ns range k range6 other
  line=$(dark_node)
  name=$(awk '{print $2}' <<<"$line"); ns=$(awk '{print $3}' <<<"$line"); range=$(awk '{print $5}' <<<"$line")
  k=$(cs_nodes c1 | awk -v n="$name" '$2 == n { print NR }')
  range6="2001:2:0:41:$k::/80"
  say "   $name's pods ($range, $range6) cut off from every other node for 15 s"
  # On the node: nothing of its pods (or its own) to the other nodes' pods.
  dark "$ns" "ip daddr 198.19.40.0/21 ip daddr != $range" "ip6 daddr 2001:2:0:40::/60 ip6 daddr != $range6" ||
    fail "node-dark: nft in $ns"
  for other in $(cs_nodes | awk -v n="$ns" '$3 != n {print $3}'); do
    dark "$other" "ip daddr $range" "ip6 daddr $range6" || fail "node-dark: nft in $other"
  done
  sleep 15
  lights_on
}

# --- c2's MCS CRDs from upstream v0.4 (v1alpha1 only) to ours, under load ------------------------
EXPORTS_CRD=serviceexports.multicluster.x-k8s.io
IMPORTS_CRD=serviceimports.multicluster.x-k8s.io
UPSTREAM_V1ALPHA1_ONLY=v0.4.1
ours_in_c2() { # c2's MCS CRDs exactly ours again, both versions served (also at exit)
  kc c2 apply --server-side --force-conflicts -f deploy/crds/multicluster.x-k8s.io_serviceexports.yaml \
    -f deploy/crds/multicluster.x-k8s.io_serviceimports.yaml >/dev/null &&
    kc c2 wait --for condition=Established --timeout=60s crd "$EXPORTS_CRD" "$IMPORTS_CRD" >/dev/null
}
unserve() { # unserve CRD VERSION...: those versions of c2's CRD no longer served
  local crd=$1 patch; shift
  patch=$(kc c2 get crd "$crd" -o json | python3 -c '
import json, sys
names = [v["name"] for v in json.load(sys.stdin)["spec"]["versions"]]
print(json.dumps([{"op": "replace", "path": f"/spec/versions/{names.index(v)}/served", "value": False} for v in sys.argv[1:]]))' "$@") &&
    kc c2 patch crd "$crd" --type=json -p "$patch" >/dev/null
}
c1_reads_c2_in() { [[ $(controller_metric c1 "mcs_controller_member_export_version{cluster=\"c2\",version=\"$1\"}") == 1 ]]; }
c1_counts_c2() { [[ $(controller_metric c1 'mcs_controller_member_up{cluster="c2"}') == "$1" ]]; }
# "name=resourceVersion" of c1's MCS EndpointSlices of c2's endpoints in the suite's namespace.
c2_slices_in_c1() {
  kc c1 -n "$NS" get endpointslices -l multicluster.kubernetes.io/source-cluster=c2 \
    -o jsonpath='{range .items[*]}{.metadata.name}={.metadata.resourceVersion}{"\n"}{end}' | sort
}
c1_has_c2_web() {
  [[ -n $(kc c1 -n "$NS" get endpointslices -l multicluster.kubernetes.io/source-cluster=c2,multicluster.kubernetes.io/service-name=web \
    -o jsonpath='{.items[*].endpoints[*].addresses[0]}') ]]
}
c2_ours_again() { # after a CRD step that failed halfway: c2's CRDs ours before the next step
  if ((c2_crds_changed)); then ours_in_c2 && c2_crds_changed=0 || fail "c2's MCS CRDs could not be made ours again"; fi
}
c1_imports() { # "ns/name=resourceVersion" of c1's ServiceImports in the suite's namespace
  kc c1 -n "$NS" get serviceimports -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}={.metadata.resourceVersion}{"\n"}{end}' | sort
}
# Before crd-upgrade (not measured): c2 as a cluster on upstream v0.4's CRDs. Its MCS CRDs are
# deleted (its ServiceExports and ServiceImports with them: c1 drops c2's part of every
# import), upstream v0.4.1's installed (v1alpha1 served and stored), and c2's exports of the
# suite made again in v1alpha1; ready when c1's controller reads c2 in v1alpha1 and imports
# every one of them with c2's endpoints.
c2_on_v1alpha1_crds() {
  local dir names n
  dir=$(cd "${TMPDIR:-/tmp}" && go mod download -json "sigs.k8s.io/mcs-api@$UPSTREAM_V1ALPHA1_ONLY" |
    python3 -c 'import json, sys; print(json.load(sys.stdin).get("Dir", ""))')/config/crd
  [[ -d $dir ]] || { fail "crd-upgrade: upstream $UPSTREAM_V1ALPHA1_ONLY's CRDs not found (go mod download sigs.k8s.io/mcs-api@$UPSTREAM_V1ALPHA1_ONLY)"; return 1; }
  names=$(kc c2 -n "$NS" get serviceexports -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
  say "   before it: c2's MCS CRDs replaced by upstream $UPSTREAM_V1ALPHA1_ONLY's (v1alpha1 only); its exports ($(tr '\n' ' ' <<<"$names")) made again in v1alpha1"
  c2_crds_changed=1
  kc c2 delete crd "$EXPORTS_CRD" "$IMPORTS_CRD" --timeout=120s >/dev/null || return 1
  until_ok 60 "c1 without c2's endpoints once c2's exports are gone" sh -c "out=\$(kubectl --context c1 -n $NS get endpointslices -l multicluster.kubernetes.io/source-cluster=c2 -o name) && [ -z \"\$out\" ]" || return 1
  kc c2 apply -f "$dir" >/dev/null || return 1
  kc c2 wait --for condition=Established --timeout=60s crd "$EXPORTS_CRD" "$IMPORTS_CRD" >/dev/null || return 1
  for n in $names; do
    printf 'apiVersion: multicluster.x-k8s.io/v1alpha1\nkind: ServiceExport\nmetadata: {name: %s, namespace: %s}\n' "$n" "$NS" |
      kc c2 apply -f - >/dev/null || return 1
  done
  until_ok 120 "c1's controller reads c2's ServiceExports in v1alpha1" c1_reads_c2_in v1alpha1 || return 1
  until_ok 120 "c1 imports c2's web endpoints again" c1_has_c2_web || return 1
  for n in $names; do until_ok 120 "c1 imports $n from c2 (status Ready)" import_ready c1 "$n" || return 1; done
  for n in $nodes_c1; do until_ok 60 "every probe request answered from $n through $vip" probe_once "$n" || return 1; done
}
# crd-upgrade, under load: ours applied over v0.4's in c2 (v1beta1 stored), its exports written
# again and storedVersions trimmed (a storage-version migration), then v1alpha1 no longer
# served (c1's controller moves to v1beta1), an export made in v1beta1 imported by c1, and ours
# applied again (both served). c1's imports and its slices of c2's endpoints are never written.
crd_upgrade() {
  local before_imports before_slices key t=$((++late_exports))
  before_imports=$(c1_imports); before_slices=$(c2_slices_in_c1)
  ours_in_c2 || { fail "crd-upgrade: our CRDs not applied in c2"; return 1; }
  local keys
  keys=$(kc c2 get serviceexports.v1beta1.multicluster.x-k8s.io -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{"\n"}{end}') ||
    { fail "crd-upgrade: c2's ServiceExports not listed for the migration"; return 1; }
  for key in $keys; do
    until_ok 30 "c2's ServiceExport $key written again (stored in v1beta1)" sh -c \
      "kubectl --context c2 -n ${key%/*} get serviceexports.v1beta1.multicluster.x-k8s.io ${key#*/} -o json | kubectl --context c2 replace -f -" || return 1
  done
  # c2 held no ServiceImport stored in v1alpha1: its controller writes v1beta1, not served before.
  for key in "$EXPORTS_CRD" "$IMPORTS_CRD"; do
    kc c2 patch crd "$key" --subresource=status --type=merge -p '{"status":{"storedVersions":["v1beta1"]}}' >/dev/null ||
      { fail "crd-upgrade: storedVersions of $key"; return 1; }
  done
  unserve "$EXPORTS_CRD" v1alpha1 || return 1
  until_ok 120 "c1's controller reads c2's ServiceExports in v1beta1" c1_reads_c2_in v1beta1 || return 1
  kc c2 -n "$NS" create service clusterip "late-$t" --tcp=80:8080 >/dev/null
  printf 'apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: late-%s, namespace: %s}\n' "$t" "$NS" |
    kc c2 apply -f - >/dev/null
  until_ok 120 "c1 imports late-$t, exported in v1beta1 after v1alpha1 stopped being served" import_ready c1 "late-$t" || return 1
  ours_in_c2 || { fail "crd-upgrade: our CRDs not applied again in c2"; return 1; }
  until_ok 120 "c2's controller imports web in c2 again (its CRDs serve v1beta1)" import_ready c2 web || return 1
  c2_crds_changed=0
  local imports slices
  imports=$(comm -3 <(echo "$before_imports") <(c1_imports | grep -v "^$NS/late-$t=") | tr -s '\t\n' '  ')
  slices=$(comm -3 <(echo "$before_slices") <(c2_slices_in_c1 | grep -v "^late-$t-") | tr -s '\t\n' '  ')
  [[ -z $imports ]] || fail "crd-upgrade: c1's ServiceImports written (before and after): $imports"
  [[ -z $slices ]] || fail "crd-upgrade: c1's slices of c2's endpoints written (before and after): $slices"
  [[ -n $imports$slices ]] ||
    say "   c1's $(wc -l <<<"$before_imports") ServiceImport(s) and $(wc -l <<<"$before_slices") slice(s) of c2's endpoints untouched; late-$t imported"
}
# crd-not-served, under load: c2 serves ServiceExport in no version for 20 s (a CRD briefly
# not served, as in a botched upgrade). c1's controller counts c2 as failing and keeps its
# last-known exports and endpoints (its slices of them untouched; the imports say
# ClustersReachable=False meanwhile, a status write), and reads c2 again once it is served
# (at its watch's next retry, at most --watch-retry-max-ms later).
web_reach_is() {
  [[ $(kc c1 -n "$NS" get serviceimport web -o jsonpath='{.status.conditions[?(@.type=="ClustersReachable")].status}') == "$1" ]]
}
crd_not_served() {
  local before_slices uids_before i
  before_slices=$(c2_slices_in_c1)
  uids_before=$(kc c1 -n "$NS" get serviceimports -o jsonpath='{range .items[*]}{.metadata.name}={.metadata.uid}{"\n"}{end}' | sort)
  c2_crds_changed=1
  unserve "$EXPORTS_CRD" v1alpha1 v1beta1 || return 1
  local t0=$SECONDS
  until_ok 60 "c1's controller counts c2 as failing (no ServiceExport version served)" c1_counts_c2 0 || true
  until_ok 60 "c1's import web says ClustersReachable=False (c2 failing past the controller's grace)" web_reach_is False || true
  local left=$((20 - (SECONDS - t0)))
  ((left <= 0)) || sleep "$left"
  ours_in_c2 || { fail "crd-not-served: our CRDs not applied again in c2"; return 1; }
  c2_crds_changed=0
  until_ok 120 "c1's controller counts c2 as up again" c1_counts_c2 1 || return 1
  until_ok 60 "c1's import web says ClustersReachable=True again" web_reach_is True || return 1
  for i in $(sed 's/=.*//' <<<"$uids_before"); do until_ok 60 "c1's $i Ready again" import_ready c1 "$i" || return 1; done
  local imports slices
  imports=$(comm -3 <(echo "$uids_before") <(kc c1 -n "$NS" get serviceimports -o jsonpath='{range .items[*]}{.metadata.name}={.metadata.uid}{"\n"}{end}' | sort) | tr -s '\t\n' '  ')
  slices=$(comm -3 <(echo "$before_slices") <(c2_slices_in_c1) | tr -s '\t\n' '  ')
  [[ -z $imports ]] || fail "crd-not-served: c1's ServiceImports deleted or made again (before and after): $imports"
  [[ -z $slices ]] || fail "crd-not-served: c1's slices of c2's endpoints written (before and after): $slices"
  [[ -n $imports$slices ]] ||
    say "   c1's $(wc -l <<<"$uids_before") ServiceImport(s) kept (same uids) and its $(wc -l <<<"$before_slices") slice(s) of c2's endpoints untouched"
}

soak() {
  # The API server restart at a quarter, the warm-up sample at half (after the agents' and
  # controllers' re-lists), the last at the end: growth between the two is steady churn's.
  local start=$SECONDS end=$((SECONDS + 60 * SOAK)) restart_at=$((SECONDS + 15 * SOAK)) warm_at=$((SECONDS + 30 * SOAK))
  local n=0 restarted=0 warm="" c next_sample=$SECONDS
  # Every process's RSS every 30 s ("<seconds> <key> <KiB> <threads> <huge KiB>"), to tell a
  # slope from a step (and a step from a new thread's, or from khugepaged's huge pages).
  local series="$root/target/lifecycle/soak-rss.txt"
  mkdir -p "${series%/*}"
  : >"$series"
  series_sample() {
    local key rss thr huge
    rss_sample | while read -r key rss; do
      thr=$(awk '/^Threads:/ {print $2}' "/proc/${key##*/}/status" 2>/dev/null || true)
      huge=$(awk '/^AnonHugePages:/ {print $2}' "/proc/${key##*/}/smaps_rollup" 2>/dev/null || true)
      echo "$((SECONDS - start)) $key $rss ${thr:-?} ${huge:-?}"
    done >>"$series"
  }
  while ((SECONDS < end)); do
    if ((SECONDS >= next_sample)); then
      series_sample
      next_sample=$((SECONDS + 30))
    fi
    n=$((n + 1))
    c=c$((n % 2 + 1))
    kc "$c" -n "$NS" create service clusterip "churn-$n" --tcp=80:8080 >/dev/null
    printf 'apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: churn-%s, namespace: %s}\n' "$n" "$NS" |
      kc "$c" apply -f - >/dev/null
    if ((n > 5)); then
      c=c$(((n - 5) % 2 + 1))
      kc "$c" -n "$NS" delete serviceexport,service "churn-$((n - 5))" --wait=false >/dev/null
    fi
    ((n % 3 == 0)) && kc c2 -n "$NS" scale deploy/web --replicas=$((n % 2 + 2)) >/dev/null
    if ((!restarted && SECONDS >= restart_at)); then
      say "   restarting c2's API server"
      bash scripts/clusterset.sh restart c2 kube-apiserver >/dev/null || fail "soak: c2's API server did not come back"
      restarted=1
    fi
    if [[ -z $warm ]] && ((SECONDS >= warm_at)); then warm=$(rss_sample); fi
    sleep 2
  done
  [[ -n $warm ]] || warm=$(rss_sample)
  kc c2 -n "$NS" scale deploy/web --replicas=2 >/dev/null
  until_ok 120 "c2's web back at 2 after the soak" kc c2 -n "$NS" rollout status deploy/web --timeout=2s
  local last grown=0 key w l pct
  last=$(rss_sample)
  say "   soak: $n exports made (the last 5 kept), RSS after warm-up -> at the end:"
  while read -r key w; do
    l=$(awk -v k="$key" '$1 == k {print $2}' <<<"$last")
    if [[ -z $l ]]; then fail "soak: $key is gone by the end (restarted?)"; continue; fi
    pct=$(awk -v w="$w" -v l="$l" 'BEGIN {printf "%.1f", (l - w) * 100 / w}')
    say "     ${key%/*}: $((w / 1024)) -> $((l / 1024)) MiB ($pct %)"
    awk -v p="$pct" 'BEGIN {exit !(p >= 10)}' && { fail "soak: ${key%/*} RSS grew $pct % after warm-up"; grown=1; }
  done <<<"$warm"
  if ((grown == 0)); then say "   soak: every agent and controller within 10 % of its size after warm-up"; fi
  series_sample
  # Per process: its RSS at each quarter, and its largest rise between two samples (when).
  say "   soak: RSS (MiB) at 0, 1/4, 1/2, 3/4, end; largest rise between samples 30 s apart; most in huge pages ($series):"
  awk -v q=$((15 * SOAK)) '
    { k = $2; t = $1; r = $3
      if (!(k in first)) { first[k] = r; keys[++nk] = k }
      for (i = 1; i <= 3; i++) if (t <= i * q) at[k, i] = r
      if (k in prev && r - prev[k] > rise[k]) { rise[k] = r - prev[k]; when[k] = t }
      if ($5 ~ /^[0-9]+$/ && $5 > huge[k]) huge[k] = $5
      prev[k] = r }
    END { for (j = 1; j <= nk; j++) { k = keys[j]; sub(/\/[0-9]+$/, "", k); kk = keys[j]
      printf "     %s: %d %d %d %d %d; +%.1f MiB at %d s; %d MiB huge\n", k, first[kk] / 1024, at[kk, 1] / 1024, at[kk, 2] / 1024, at[kk, 3] / 1024, prev[kk] / 1024, rise[kk] / 1024, when[kk], huge[kk] / 1024 } }' "$series"
}

current_dp=ebpf
for s in ${STEPS//,/ }; do
  case $s in
    upgrade-ebpf|upgrade-userspace)
      next_image || { fail "$s: could not build the next image"; continue; }
      remember_rev
      step "$s" "$current_dp" "$([[ $current_dp == ebpf ]] && echo zero || echo tcp-zero)" \
        with_import_checks upgrade image.tag=$NEXT_TAG ;;
    rollback-ebpf|rollback-userspace)
      step "$s" "$current_dp" "$([[ $current_dp == ebpf ]] && echo zero || echo tcp-zero)" with_import_checks rollback ;;
    agents-deleted) step "$s" "$current_dp" "$([[ $current_dp == ebpf ]] && echo zero || echo measured)" delete_agents ;;
    to-userspace) step "$s" "ebpf -> userspace" measured upgrade dataplane=userspace; current_dp=userspace ;;
    to-ebpf) step "$s" "userspace -> ebpf" measured upgrade dataplane=ebpf; current_dp=ebpf ;;
    drain-ebpf|drain-userspace)
      [[ ${s#drain-} == "$current_dp" ]] || { fail "$s: the dataplane is $current_dp here (reorder --steps)"; continue; }
      step "$s" "$current_dp" measured drain ;;
    blackhole-ebpf|blackhole-userspace)
      [[ ${s#blackhole-} == "$current_dp" ]] || { fail "$s: the dataplane is $current_dp here (reorder --steps)"; continue; }
      spread_web || fail "$s: c1's web pods could not be spread over its nodes"
      step "$s" "$current_dp" measured blackhole ;;
    node-dark-ebpf|node-dark-userspace)
      [[ ${s#node-dark-} == "$current_dp" ]] || { fail "$s: the dataplane is $current_dp here (reorder --steps)"; continue; }
      spread_web || fail "$s: c1's web pods could not be spread over its nodes"
      step "$s" "$current_dp" measured node_dark ;;
    crd-upgrade)
      c2_on_v1alpha1_crds || { fail "$s: c2 could not be put on upstream $UPSTREAM_V1ALPHA1_ONLY's CRDs"; c2_ours_again; continue; }
      step "$s" "$current_dp" "$([[ $current_dp == ebpf ]] && echo zero || echo tcp-zero)" crd_upgrade
      c2_ours_again ;;
    crd-not-served)
      step "$s" "$current_dp" "$([[ $current_dp == ebpf ]] && echo zero || echo tcp-zero)" crd_not_served
      c2_ours_again ;;
    *) fail "unknown step $s" ;;
  esac
done

if ((SOAK > 0)); then
  [[ $current_dp == ebpf ]] || { upgrade dataplane=ebpf; current_dp=ebpf; }
  step soak "$current_dp" zero soak
fi

# Put the chart back where it was (the uninstall check and conformance that follow in CI
# expect eBPF at the first release's values).
for c in $clusters; do
  cur=$(release_of "$c")
  if [[ $cur != "${first_rev[$c]}" ]]; then
    helm_c "$c" rollback mcs-dataplane "${first_rev[$c]}" >/dev/null || fail "$c: rollback to release ${first_rev[$c]} at the end"
  fi
done
rollout_all
echo
cat "$TABLE"
echo
if ((failures)); then
  echo "lifecycle: $failures check(s) failed" >&2
  exit 1
fi
say "every step done; the 0-failure steps had none"
