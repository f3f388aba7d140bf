#!/usr/bin/env bash
# Export → first connection, on real pods of the ClusterSet of scripts/clusterset.sh (which
# must be up, with mcs-dataplane installed): from the create of a ServiceExport in c2 to the
# first connection a c1 pod makes through the ClusterSetIP of its import (controller + agent
# + socket LB; no DNS on the path), with N other exports present.
#
#   bash scripts/clusterset-latency.sh [--others N] [--samples M] [--unexported U]
#                                             # defaults 1000, 20 and 0
#
# How it measures, per sample: c2 has a Service `sJ` (selecting a running web pod) not yet
# exported; c1's client pod waits for a file naming sJ's ClusterSetIP (a hostPath volume),
# which a watch of c1's ServiceImports on the host writes the moment the import has an
# address; the pod then tries to connect to the ClusterSetIP until a connection is made
# (each try bounded by 50 ms: a SYN sent before the agent programmed the address is lost),
# stamps the time, and checks that the connection's reply comes from c2's web pod. The host
# stamps the time just before it creates sJ's ServiceExport. Both stamps read the same clock
# (containers share the host's), so the figure holds no `kubectl exec` start-up. Printed per
# sample and as p50 / p99 / max, with the time to the import alone ("import in c1"). A
# sample that does not connect within 60 s, or whose reply is not c2's, fails the script.
#
# With --unexported U, each cluster first gets U Services nobody exports (headless: the test
# clusters' service range holds 4,096 addresses), each with an EndpointSlice of one ready endpoint (c2's select the web pod, c1's the client pod), as a
# real member runs thousands: the samples are then taken with them present, and it prints
# every controller's RSS before and after them and how many objects c1's leading controller
# received from c2's watches meanwhile (`mcs_controller_member_watch_objects_total`): their
# EndpointSlices must not reach it (fewer than 1 % of U, or the script fails), their
# Services do (watched whole, only exported ones kept).
#
# Everything it creates (two namespaces per cluster, the hostPath directory, the host's
# watch) is removed on exit.
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
OTHERS=1000
SAMPLES=20
UNEXPORTED=0
while (($#)); do
  case $1 in
    --others) OTHERS=$2; shift 2 ;;
    --samples) SAMPLES=$2; shift 2 ;;
    --unexported) UNEXPORTED=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "latency: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $OTHERS =~ ^[0-9]+$ && $SAMPLES =~ ^[1-9][0-9]*$ && $UNEXPORTED =~ ^[0-9]+$ ]] ||
  { echo "latency: --others N (≥ 0), --samples M (≥ 1), --unexported U (≥ 0)" >&2; exit 2; }
need_clusterset latency
stamp=$(date +%s)
NS="lat-$stamp"
ONS="lat-others-$stamp"
DIR="$STATE/latency-$stamp"
say() { printf '\033[1mlatency:\033[0m %s\n' "$*"; }
die() { printf 'latency: FAILED: %s\n' "$*" >&2; exit 1; }
# For until_ok (clusterset-lib.sh): a wait that times out ends the run here.
fail() { die "$@"; }
watch_pid=""
cleanup() {
  local rc=$?
  [[ -z $watch_pid ]] || kill "$watch_pid" 2>/dev/null || true
  for c in c1 c2; do kc "$c" delete namespace "$NS" "$ONS" --wait=false >/dev/null 2>&1 || true; done
  rm -rf "$DIR"
  exit "$rc"
}
trap cleanup EXIT
now_ns() { date +%s%N; }
# Polls CMD every 0.5 s until it succeeds, for at most SECONDS.
imports_with_ip() { kc c1 -n "$1" get serviceimports -o jsonpath='{range .items[*]}{.spec.ips[0]}{"\n"}{end}' | grep -c . || true; }

mkdir -p "$DIR"
for c in c1 c2; do kc "$c" create namespace "$NS" >/dev/null; kc "$c" create namespace "$ONS" >/dev/null; done

if ((OTHERS > 0)); then
  say "$OTHERS other exports in c2 ($ONS), imported into c1"
  t=$SECONDS
  for ((i = 0; i < OTHERS; i++)); do
    printf -- '---\napiVersion: v1\nkind: Service\nmetadata: {name: o%d, namespace: %s}\nspec: {selector: {app: o%d}, ports: [{name: http, port: 80, targetPort: 8080}]}\n' "$i" "$ONS" "$i"
    printf -- '---\napiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: o%d, namespace: %s}\nspec: {}\n' "$i" "$ONS"
  done | kc c2 create -f - >/dev/null
  deadline=$((SECONDS + 600))
  until (($(imports_with_ip "$ONS") == OTHERS)); do
    ((SECONDS > deadline)) && die "c1 holds $(imports_with_ip "$ONS") of the $OTHERS other imports after 600 s"
    sleep 2
  done
  say "   every one imported into c1 (with its ClusterSetIP) $((SECONDS - t)) s after the first write"
fi

say "a web pod and $SAMPLES Services selecting it in c2 ($NS), not exported; a client pod in c1"
{
  cat <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: $NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
      - name: web
        image: docker.io/alpine/socat:1.7.4.4
        imagePullPolicy: Never
        command: [/bin/sh, -c, 'exec socat TCP-LISTEN:8080,fork,reuseaddr SYSTEM:"echo c2 \$(hostname)"']
        ports: [{containerPort: 8080}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
EOF
  for ((j = 0; j < SAMPLES; j++)); do
    printf -- '---\napiVersion: v1\nkind: Service\nmetadata: {name: s%d, namespace: %s}\nspec: {selector: {app: web}, ports: [{name: http, port: 80, targetPort: 8080}]}\n' "$j" "$NS"
  done
} | kc c2 apply -f - >/dev/null
cat <<EOF | kc c1 apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: $NS}
spec:
  containers:
  - name: client
    image: docker.io/nicolaka/netshoot:v0.15
    imagePullPolicy: Never
    command: [sleep, "3600"]
    volumeMounts: [{name: lat, mountPath: /lat}]
  volumes: [{name: lat, hostPath: {path: $DIR, type: Directory}}]
EOF
until_ok 90 "web Ready in c2" kc c2 -n "$NS" rollout status deploy/web --timeout=2s
until_ok 60 "client pod Ready in c1" kc c1 -n "$NS" wait --for=condition=Ready pod/client --timeout=2s
# Every Service's slice holds the ready web pod before it is exported.
until_ok 60 "s$((SAMPLES - 1))'s EndpointSlice ready in c2" sh -c \
  "kubectl --context c2 -n $NS get endpointslices -l kubernetes.io/service-name=s$((SAMPLES - 1)) -o jsonpath='{.items[*].endpoints[*].conditions.ready}' | grep -q true"

if ((UNEXPORTED > 0)); then
  received() { controller_metric c1 "mcs_controller_member_watch_objects_total{cluster=\"c2\",kind=\"$1\"}"; }
  controllers_rss() { rss_sample | awk '$1 ~ /\/controller\// { sub(/\/[0-9]+$/, "", $1); printf "%s %d MiB; ", $1, $2 / 1024 }'; }
  rss_before=$(controllers_rss)
  slices_before=$(received EndpointSlice) services_before=$(received Service)
  say "$UNEXPORTED Services nobody exports in each cluster ($NS), each with an EndpointSlice of one ready endpoint"
  t=$SECONDS
  for c in c1 c2; do
    if [[ $c == c2 ]]; then sel=web; else sel=client; kc c1 -n "$NS" label pod client app=client --overwrite >/dev/null; fi
    for ((i = 0; i < UNEXPORTED; i++)); do
      printf -- '---\napiVersion: v1\nkind: Service\nmetadata: {name: u%d, namespace: %s}\nspec: {clusterIP: None, selector: {app: %s}, ports: [{name: http, port: 80, targetPort: 8080}]}\n' "$i" "$NS" "$sel"
    done | kc "$c" create -f - >/dev/null
  done
  slices_of() { kc "$1" -n "$NS" get endpointslices -o name | grep -c . || true; }
  # Every Service's slice written by the EndpointSlice controller (c2 also holds the samples').
  for c in c1 c2; do
    want=$UNEXPORTED; [[ $c == c2 ]] && want=$((UNEXPORTED + SAMPLES))
    deadline=$((SECONDS + 900))
    until (($(slices_of "$c") >= want)); do
      ((SECONDS > deadline)) && die "$c holds $(slices_of "$c") of $want EndpointSlices after 900 s"
      sleep 2
    done
  done
  say "   every slice written $((SECONDS - t)) s after the first Service"
  slices_after=$(received EndpointSlice) services_after=$(received Service)
  for v in "$slices_before" "$slices_after" "$services_before" "$services_after"; do
    [[ $v =~ ^[0-9]+$ ]] || die "no mcs_controller_member_watch_objects_total from c1's leading controller"
  done
  rss_after=$(controllers_rss)
  say "   c1's leading controller received from c2's watches meanwhile: $((slices_after - slices_before)) EndpointSlices, $((services_after - services_before)) Services"
  say "   controllers' RSS before: $rss_before"
  say "   controllers' RSS after:  $rss_after"
  (((slices_after - slices_before) * 100 < UNEXPORTED)) ||
    die "c1's controller received $((slices_after - slices_before)) EndpointSlices of Services nobody exports"
fi

# The host's watch of c1's imports: a file per import with its ClusterSetIP (written whole,
# then renamed), and when it was seen.
kc c1 -n "$NS" get serviceimports --watch -o jsonpath='{.metadata.name} {.spec.ips[0]}{"\n"}' 2>/dev/null |
  while read -r name ip; do
    if [[ -n ${ip:-} && ! -e $DIR/$name ]]; then
      now_ns >"$DIR/$name.seen"
      echo "$ip" >"$DIR/.$name"
      mv "$DIR/.$name" "$DIR/$name"
    fi
  done &
watch_pid=$!

exports=() imports=()
for ((j = 0; j < SAMPLES; j++)); do
  out="$DIR/out-$j"
  : >"$out"
  # The pod waits for the file, then tries until served; it prints "waiting" when it starts.
  kc c1 -n "$NS" exec client -- sh -c '
    echo waiting
    n=0
    while [ ! -s /lat/s'"$j"' ]; do sleep 0.002; n=$((n + 1)); [ $n -lt 30000 ] || { echo "no import"; exit 1; }; done
    ip=$(cat /lat/s'"$j"')
    n=0
    until timeout 0.05 nc -z -w 1 "$ip" 80 2>/dev/null; do
      n=$((n + 1)); [ $n -lt 1200 ] || { echo "no connection"; exit 1; }
    done
    t=$(date +%s%N)
    r=$(nc -w 2 "$ip" 80 </dev/null 2>/dev/null | head -1)
    [ "${r#c2 web-}" != "$r" ] || { echo "connected, but the reply was \"$r\", not c2'"'"'s web pod"; exit 1; }
    echo "served $t $ip $n"' >"$out" 2>&1 &
  exec_pid=$!
  deadline=$((SECONDS + 30))
  until grep -q waiting "$out"; do
    ((SECONDS > deadline)) && die "sample $j: the client pod's loop did not start: $(cat "$out")"
    sleep 0.05
  done
  t0=$(now_ns)
  printf 'apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: s%d, namespace: %s}\nspec: {}\n' "$j" "$NS" |
    kc c2 create -f - >/dev/null
  wait "$exec_pid" || die "sample $j: $(tail -1 "$out")"
  read -r _ t1 ip tries < <(grep '^served ' "$out")
  seen=$(cat "$DIR/s$j.seen")
  e=$(((t1 - t0) / 1000000)) i=$(((seen - t0) / 1000000))
  exports+=("$e") imports+=("$i")
  say "   s$j: imported into c1 after $i ms; first connection to $ip after $e ms ($tries tries before failed)"
done

pct() { # pct P values...: the P-th percentile (nearest rank)
  local p=$1; shift
  printf '%s\n' "$@" | sort -n | awk -v p="$p" '{v[NR]=$1} END {i=int((NR-1)*p/100+0.5)+1; print v[i]}'
}
say "export in c2 → import in c1: p50 $(pct 50 "${imports[@]}") ms, p99 $(pct 99 "${imports[@]}") ms, max $(pct 100 "${imports[@]}") ms"
say "export in c2 → first connection from a c1 pod by ClusterSetIP: p50 $(pct 50 "${exports[@]}") ms, p99 $(pct 99 "${exports[@]}") ms, max $(pct 100 "${exports[@]}") ms ($SAMPLES samples, $OTHERS other exports, $UNEXPORTED unexported Services per cluster)"
