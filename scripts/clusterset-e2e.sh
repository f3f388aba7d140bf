#!/usr/bin/env bash
# End to end on real pods, on the ClusterSet of scripts/clusterset.sh (which must be up, with
# mcs-dataplane installed):
#
#   0. Every import in both clusters says `status.endpointSliceObjects: Present` and has MCS
#      EndpointSlices (what a Gateway API implementation reads to pick slices over IPs).
#   1. eBPF: a Deployment exported by c2 is reached from a pod of c1 by its ClusterSetIP and by
#      <svc>.<ns>.svc.clusterset.local (CoreDNS forwarding to the agents), served by both of
#      c2's pods; a UDP echo exported by c2 answers c1's pod from its ClusterSetIP, and one
#      exported by c1 answers c2's pod; the socket LB is attached to the kubelet's cgroup root
#      of each cluster, not the host's.
#   2. Failover: c1 exports the service too, and its local pod is preferred; scaled to 0 under
#      load, c2 takes over with no failed request (the pod drains for 5 s in preStop, as
#      users' graceful pods do).
#   3. The agent pod of c1 deleted under load: the DaemonSet recreates it, and eBPF traffic
#      keeps flowing (pinned maps) with no failed request.
#   4. Userspace: the chart switched to --dataplane userspace (helm upgrade); the new agent
#      removes the pinned socket LB, and the same requests go through its forwarder (its
#      connection counter moves), from c1's pod and from a pod of c2, by IP and by name, and
#      UDP to the echo by ClusterSetIP and by name from both; and from c2's pod to `hello` and
#      the UDP `echo1`, exported by c1 only (the other direction). With
#      `clusterset.sh up --cni mixed` (as CI runs it) c1's pods are routed (ptp) and c2's sit on
#      a Linux bridge with br_netfilter on, so both node networks are crossed. Then back to
#      eBPF.
#   On a ClusterSet of several nodes per cluster (`clusterset.sh up --nodes 2`, as CI runs it)
#   the client pod `client` sits on each cluster's first node, and also: a client on every
#   other node reaches web by ClusterSetIP and by name; a Service of c1 with
#   `internalTrafficPolicy: Local` (one pod per node) is served to each node's client only by
#   the pod on its own node; the socket LB is attached at every node's kubelet cgroup root.
#   On a dual-stack ClusterSet (`clusterset.sh up --ip-family dual`, as CI runs it) web, echo
#   and echo1 are dual-stack Services, so their imports hold a ClusterSetIP of each family: every
#   node's client also reaches web by its IPv6 ClusterSetIP (eBPF and userspace), UDP goes to
#   the IPv6 ClusterSetIP too, the name has an AAAA record equal to it (through CoreDNS, through
#   mcs-dns's IPv6 ClusterIP, and from every agent on its node's IPv6 address).
#   5. Credentials: `clusterset.sh rotate-tokens --revoke` gives every controller new member
#      tokens (files in its Secret) and revokes the old ones; each cluster still imports an
#      export the other makes afterwards. (Open watches outlive a revoked token, so this shows
#      that rotation breaks nothing; that a rotated token file is read again is shown by
#      controller/clusterset/mcs/tests/credentials.rs.)
#
# Every request is checked (the reply names the pod that served it); failures are counted and
# shown, and any in a step that should have none fails the script. Everything it creates (one
# namespace per cluster) is deleted on exit.
#
#   bash scripts/clusterset-e2e.sh
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
need_clusterset e2e
NS="e2e-$(date +%s)"
failures=0
dual=0; [[ $(cat "$STATE/ip-family" 2>/dev/null) == dual ]] && dual=1
# The backends' sockets: IPv6 ones that take IPv4 too (v4-mapped) on a dual-stack ClusterSet.
TCP_LISTEN=TCP-LISTEN V6ONLY="" UDP_HOST=0.0.0.0 PERL_V6ONLY=""
((dual)) && TCP_LISTEN=TCP6-LISTEN V6ONLY=",ipv6only=0" UDP_HOST="::" PERL_V6ONLY=", V6Only => 0"

say() { printf '\033[1me2e:\033[0m %s\n' "$*"; }
fail() { printf 'e2e: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }
cleanup() {
  local rc=${1:-$?}
  for c in c1 c2; do kc "$c" delete namespace "$NS" --wait=false >/dev/null 2>&1 || true; done
  exit "$rc"
}
trap cleanup EXIT

# A web Deployment whose every reply is "<cluster> <pod name>". With `local`: one pod per node
# at most, and its Service has internalTrafficPolicy: Local.
web() { # web CLUSTER REPLICAS [NAME] [local] (NAME: web)
  local spread="" itp=Cluster
  if [[ ${4:-} == local ]]; then
    itp=Local
    spread="affinity: {podAntiAffinity: {requiredDuringSchedulingIgnoredDuringExecution: [{topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: $3}}}]}}"
  fi
  cat <<EOF | kc "$1" apply -f - >/dev/null
apiVersion: apps/v1
kind: Deployment
metadata: {name: ${3:-web}, namespace: $NS}
spec:
  replicas: $2
  selector: {matchLabels: {app: ${3:-web}}}
  template:
    metadata: {labels: {app: ${3:-web}}}
    spec:
      terminationGracePeriodSeconds: 15
      $spread
      containers:
      - name: web
        image: docker.io/alpine/socat:1.7.4.4
        imagePullPolicy: Never
        command: [/bin/sh, -c, 'exec socat $TCP_LISTEN:8080,fork,reuseaddr$V6ONLY SYSTEM:"echo $1 \$(hostname)"', sh, $1]
        ports: [{containerPort: 8080}]
        readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
        lifecycle: {preStop: {exec: {command: [sleep, "5"]}}}
---
apiVersion: v1
kind: Service
metadata: {name: ${3:-web}, namespace: $NS}
spec:
  selector: {app: ${3:-web}}
  ipFamilyPolicy: PreferDualStack
  internalTrafficPolicy: $itp
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceExport
metadata: {name: ${3:-web}, namespace: $NS}
spec: {}
EOF
}

# The client pod the requests below come from: `client` on each cluster's first node (another,
# e.g. client-c1-node2, for a while with CLIENT=... before a call).
CLIENT=client
# Runs N requests (one connection each, 50 ms apart) from the client pod of cluster FROM (c1
# unless given) to TARGET:80 and prints one reply per line ("FAIL" for a request that got
# none). The client sends nothing: the server closing with a byte it never read unsent would
# reset the connection, and a reset can discard the reply before nc reads it (seen 1 in ~300
# with `echo | nc`, direct to a pod).
load() { # load TARGET N [FROM]
  kc "${3:-c1}" -n "$NS" exec "$CLIENT" -- sh -c '
    i=0
    while [ $i -lt '"$2"' ]; do
      r=$(nc -w 2 '"$1"' 80 </dev/null 2>/dev/null | head -1)
      case "$r" in c[0-9]\ web-*|c[0-9]\ hello-*|c[0-9]\ near-*) echo "$r" ;; *) echo FAIL ;; esac
      i=$((i + 1)); sleep 0.05
    done'
}
count() { grep -c -- "$1" "$2" || true; }
# A UDP echo Deployment exported by CLUSTER (port 9000; every reply is "<cluster> <pod name>").
udp_echo() { # udp_echo CLUSTER [NAME] (NAME: echo)
  cat <<EOF | kc "$1" apply -f - >/dev/null
apiVersion: apps/v1
kind: Deployment
metadata: {name: ${2:-echo}, namespace: $NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: ${2:-echo}}}
  template:
    metadata: {labels: {app: ${2:-echo}}}
    spec:
      containers:
      - name: echo
        image: docker.io/nicolaka/netshoot:v0.15
        imagePullPolicy: Never
        # One process answers every datagram. (socat UDP-RECVFROM,fork, one process per
        # datagram, lost some even pod to pod with no load balancer between: 3 of 7,674.)
        command: [perl, -MIO::Socket::IP, -e, 'my \$s = IO::Socket::IP->new(LocalHost => "$UDP_HOST", LocalPort => 9000, Proto => "udp"$PERL_V6ONLY) or die "bind: \$@"; my \$r = "$1 \$ENV{HOSTNAME}\\n"; while (1) { my \$p = \$s->recv(my \$b, 65535); \$s->send(\$r, 0, \$p) if defined \$p }']
        ports: [{containerPort: 9000, protocol: UDP}]
---
apiVersion: v1
kind: Service
metadata: {name: ${2:-echo}, namespace: $NS}
spec:
  selector: {app: ${2:-echo}}
  ipFamilyPolicy: PreferDualStack
  ports: [{name: echo, port: 9000, protocol: UDP}]
---
apiVersion: multicluster.x-k8s.io/v1beta1
kind: ServiceExport
metadata: {name: ${2:-echo}, namespace: $NS}
spec: {}
EOF
}
# N datagrams (a connected UDP socket each) from the client pod of cluster FROM to TARGET:9000;
# prints one reply per line ("FAIL" for a datagram that got none).
udp_load() { # udp_load TARGET N FROM
  kc "$3" -n "$NS" exec "$CLIENT" -- sh -c '
    i=0
    while [ $i -lt '"$2"' ]; do
      r=$(echo q | nc -u -w 2 '"$1"' 9000 2>/dev/null | head -1)
      case "$r" in c[0-9]\ echo-*|c[0-9]\ echo1-*) echo "$r" ;; *) echo FAIL ;; esac
      i=$((i + 1))
    done'
}
# Whether a datagram from the client pod of cluster $1 to $2:9000 gets an echo from cluster
# $3's pods of Deployment $4.
udp_ok() { [[ $(udp_load "$2" 1 "$1") == "$3 $4-"* ]]; }
# Whether one request from the client pod of cluster $2 (c1 unless given) to $vip:80 (or
# to $3) is served by cluster $1's pods (of Deployment $4, web unless given).
served_by() { local r; r=$(kc "${2:-c1}" -n "$NS" exec "$CLIENT" -- sh -c "nc -w 2 ${3:-$vip} 80 </dev/null"); [[ $r == "$1 ${4:-web}-"* ]]; }
# A pod named NAME in CLUSTER's namespace, on NODE, that only sleeps (requests come from it).
client_on() { # client_on CLUSTER NAME NODE
  kc "$1" -n "$NS" run "$2" --image=docker.io/nicolaka/netshoot:v0.15 --image-pull-policy=Never \
    --overrides="{\"apiVersion\": \"v1\", \"spec\": {\"nodeName\": \"$3\"}}" --command -- sleep 3600 >/dev/null
}
# The IPv6 ClusterSetIP of import $2 in cluster $1 (dual-stack: the second of spec.ips).
vip6_of() { kc "$1" -n "$NS" get serviceimport "$2" -o jsonpath='{.spec.ips[1]}'; }
# Nodes of cluster $1 after its first one (empty with one node per cluster).
other_nodes() { cs_nodes "$1" | tail -n +2 | awk '{print $2}'; }

say "namespace $NS in c1 and c2; web (2 pods) exported by c2; a client pod on every node of c1 and c2"
for c in c1 c2; do kc "$c" create namespace "$NS" >/dev/null; done
web c2 2
udp_echo c2
# echo1: a UDP echo exported by c1 only, for the c2 -> c1 direction.
udp_echo c1 echo1
# hello: exported by c1 only, for the c2 -> c1 direction.
web c1 1 hello
for c in c1 c2; do
  client_on "$c" client "$(cs_nodes "$c" | awk 'NR == 1 {print $2}')"
  for n in $(other_nodes "$c"); do client_on "$c" "client-$n" "$n"; done
done
until_ok 90 "web Ready in c2" kc c2 -n "$NS" rollout status deploy/web --timeout=2s
until_ok 90 "echo Ready in c2" kc c2 -n "$NS" rollout status deploy/echo --timeout=2s
until_ok 90 "echo1 Ready in c1" kc c1 -n "$NS" rollout status deploy/echo1 --timeout=2s
until_ok 90 "hello Ready in c1" kc c1 -n "$NS" rollout status deploy/hello --timeout=2s
for c in c1 c2; do
  until_ok 60 "client pods Ready in $c" kc "$c" -n "$NS" wait --for=condition=Ready pod --all --timeout=2s
done
vip=""
deadline=$((SECONDS + 60))
while [[ -z $vip ]] && ((SECONDS < deadline)); do
  vip=$(kc c1 -n "$NS" get serviceimport web -o jsonpath='{.spec.ips[0]}' 2>/dev/null || true)
  [[ -z $vip ]] && sleep 0.5
done
[[ -n $vip ]] || { fail "no ServiceImport web with a ClusterSetIP in c1"; exit 1; }
say "ServiceImport web in c1: ClusterSetIP $vip"

# --- 0. what a Gateway API implementation reads ------------------------------------------------
# status.endpointSliceObjects tells it whether to read the MCS EndpointSlices of an import or
# only its IPs: every import of ours must say Present, and have its slices.
# Prints "<import> <endpointSliceObjects> <MCS slices>" per import in cluster $1 and fails
# unless each is Present with at least one slice.
imports_present_with_slices() {
  local c=$1 rows bad=0 name objects slices
  rows=$(kc "$c" -n "$NS" get serviceimport -o jsonpath='{range .items[*]}{.metadata.name} {.status.endpointSliceObjects}{"\n"}{end}')
  [[ -n $rows ]] || return 1
  while read -r name objects; do
    slices=$(kc "$c" -n "$NS" get endpointslices -l "multicluster.kubernetes.io/service-name=$name" -o name | wc -l)
    echo "$name ${objects:-unset} $slices"
    [[ $objects == Present ]] && ((slices > 0)) || bad=1
  done <<<"$rows"
  return "$bad"
}
for c in c1 c2; do
  if until_ok 30 "every import in $c Present with MCS slices" imports_present_with_slices "$c" >/dev/null; then
    say "0. $c: every import says endpointSliceObjects Present and has MCS EndpointSlices: $(imports_present_with_slices "$c" | awk '{printf "%s(%s slices) ", $1, $3}')"
  else
    say "   $c's imports (name, endpointSliceObjects, MCS slices): $(imports_present_with_slices "$c" | tr '\n' ';')"
  fi
done

# --- 1. eBPF, by IP and by name ---------------------------------------------------------------
out=$(mktemp); trap 'rc=$?; rm -f "$out"; cleanup "$rc"' EXIT
# The first requests may race the agent's table; wait until one succeeds, then count.
until_ok 30 "a first reply through $vip" served_by c2
load "$vip" 40 >"$out"
ok=$(count '^c2 web-' "$out"); bad=$(count FAIL "$out"); pods=$(grep '^c2 web-' "$out" | sort -u | wc -l)
say "1. eBPF by ClusterSetIP: $ok/40 served by c2 ($pods distinct pods), $bad failed"
((ok == 40)) || fail "by ClusterSetIP: $bad of 40 failed"
((pods == 2)) || fail "by ClusterSetIP: served by $pods of c2's 2 pods"
name="web.$NS.svc.clusterset.local"
got=$(kc c1 -n "$NS" exec client -- dig +short +time=2 +tries=2 A "$name" | tail -1)
say "   $name A ${got:-nothing} in c1's pod (CoreDNS -> mcs-dns -> agent)"
[[ $got == "$vip" ]] || fail "$name resolved to '${got}', not $vip"
load "$name" 20 >"$out"
ok=$(count '^c2 web-' "$out")
say "   by name: $ok/20 served by c2"
((ok == 20)) || fail "by name: $((20 - ok)) of 20 failed"
if ((dual)); then
  vip6=$(vip6_of c1 web)
  say "   dual-stack: web's IPv6 ClusterSetIP in c1: ${vip6:-none}"
  if [[ $vip6 != *:* ]]; then
    fail "import web in c1 has no IPv6 ClusterSetIP (ips: $(kc c1 -n "$NS" get serviceimport web -o jsonpath='{.spec.ips}'))"
  else
    until_ok 30 "a first reply through $vip6" served_by c2 c1 "$vip6"
    load "$vip6" 20 >"$out"
    ok=$(count '^c2 web-' "$out")
    say "   eBPF by IPv6 ClusterSetIP: $ok/20 served by c2"
    ((ok == 20)) || fail "by IPv6 ClusterSetIP: $((20 - ok)) of 20 failed"
    aaaa() { kc c1 -n "$NS" exec client -- dig +short +time=2 +tries=2 ${1:+"@$1"} AAAA "$name" | tail -1; }
    got=$(aaaa)
    say "   $name AAAA ${got:-nothing} (CoreDNS -> mcs-dns -> agent)"
    [[ $got == "$vip6" ]] || fail "$name AAAA: '$got', not $vip6"
    dns6=$(kc c1 -n mcs-system get service mcs-dns -o jsonpath='{.spec.clusterIPs[1]}')
    if [[ $dns6 != *:* ]]; then
      fail "Service mcs-dns in c1 has no IPv6 ClusterIP (clusterIPs: $(kc c1 -n mcs-system get service mcs-dns -o jsonpath='{.spec.clusterIPs}'))"
    else
      got=$(aaaa "$dns6")
      say "   $name AAAA through mcs-dns's IPv6 ClusterIP $dns6: ${got:-nothing}"
      [[ $got == "$vip6" ]] || fail "AAAA through mcs-dns [$dns6]: '$got', not $vip6"
    fi
    # Every agent on its node's IPv6 address (status.podIPs), for its own cluster's import.
    while read -r c node ns _ _ _ _ ip6; do
      want=$(vip6_of "$c" web)
      got=$(ip netns exec "$ns" dig +short +time=2 +tries=2 -p 10053 "@$ip6" AAAA "$name" | tail -1)
      say "   $c/$node's agent at [$ip6]:10053: AAAA ${got:-nothing}"
      [[ -n $want && $got == "$want" ]] || fail "$c/$node's agent at [$ip6]:10053 answered '$got' for AAAA, not '$want'"
    done < <(cs_nodes)
  fi
fi
echo_ip() { [[ -n $(kc "$1" -n "$NS" get serviceimport "$2" -o jsonpath='{.spec.ips[0]}' 2>/dev/null) ]]; }
for c in c1 c2; do
  for e in echo echo1; do until_ok 60 "a ServiceImport $e with a ClusterSetIP in $c" echo_ip "$c" "$e"; done
done
udp_checks() { # udp_checks FROM WHAT [SERVICE SERVER] (echo of c2; by FROM's own import, and by name)
  local svc=${3:-echo} server=${4:-c2} ok ip
  local ename="$svc.$NS.svc.clusterset.local"
  ip=$(kc "$1" -n "$NS" get serviceimport "$svc" -o jsonpath='{.spec.ips[0]}')
  until_ok 30 "$2: a first UDP echo through $ip from $1" udp_ok "$1" "$ip" "$server" "$svc" || return 0
  { udp_load "$ip" 10 "$1"; udp_load "$ename" 10 "$1"; } >"$out"
  ok=$(count "^$server $svc-" "$out")
  say "   $2 UDP from a pod of $1: $ok/20 echoed by $server's $svc (by $ip and $ename)"
  ((ok == 20)) || fail "$2 UDP from $1 to $svc: $((20 - ok)) of 20 got no echo from $server"
  if ((dual)); then
    ip=$(vip6_of "$1" "$svc")
    [[ $ip == *:* ]] || { fail "$2: import $svc in $1 has no IPv6 ClusterSetIP (ips: $(kc "$1" -n "$NS" get serviceimport "$svc" -o jsonpath='{.spec.ips}'))"; return 0; }
    until_ok 30 "$2: a first UDP echo through $ip from $1" udp_ok "$1" "$ip" "$server" "$svc" || return 0
    udp_load "$ip" 10 "$1" >"$out"
    ok=$(count "^$server $svc-" "$out")
    say "   $2 UDP over IPv6 from a pod of $1: $ok/10 echoed by $server's $svc (by $ip)"
    ((ok == 10)) || fail "$2 UDP over IPv6 from $1 to $svc: $((10 - ok)) of 10 got no echo from $server"
  fi
}
udp_checks c1 eBPF
udp_checks c2 eBPF echo1 c1
hostprogs=$(bpftool cgroup show /sys/fs/cgroup/unified 2>/dev/null | grep -c connect4 || true)
((hostprogs == 0)) || fail "a connect4 program is attached at the host's cgroup root"
while read -r c node _ _ _ cg _; do
  progs=$(bpftool cgroup show "$cg" 2>/dev/null | grep -c connect4 || true)
  say "   $c/$node: socket LB attached at the kubelet's cgroup root $cg ($progs connect4), host root ($hostprogs)"
  ((progs == 1)) || fail "$c/$node: no connect4 program at $cg"
done < <(cs_nodes)
# Every other node's client: by ClusterSetIP and by name.
for c in c1 c2; do
  vip_c=$(kc "$c" -n "$NS" get serviceimport web -o jsonpath='{.spec.ips[0]}')
  for n in $(other_nodes "$c"); do
    CLIENT=client-$n
    until_ok 30 "a first reply through $vip_c from $n" served_by c2 "$c" "$vip_c"
    { load "$vip_c" 10 "$c"; load "$name" 10 "$c"; } >"$out"
    ok=$(count '^c2 web-' "$out")
    say "   from a pod on $c/$n: $ok/20 served by c2 (by $vip_c and $name)"
    ((ok == 20)) || fail "from $c/$n: $((20 - ok)) of 20 failed"
    if ((dual)); then
      v6=$(vip6_of "$c" web)
      load "$v6" 10 "$c" >"$out"
      ok=$(count '^c2 web-' "$out")
      say "   from a pod on $c/$n: $ok/10 served by c2 (by $v6)"
      ((ok == 10)) || fail "from $c/$n by $v6: $((10 - ok)) of 10 failed"
    fi
    CLIENT=client
  done
done
# internalTrafficPolicy: Local, one pod per node of c1: each node's client only its own node's pod.
if [[ -n $(other_nodes c1) ]]; then
  web c1 "$(cs_nodes c1 | wc -l)" near local
  until_ok 90 "near Ready in c1 (a pod per node)" kc c1 -n "$NS" rollout status deploy/near --timeout=2s
  itp() { [[ $(kc c1 -n "$NS" get serviceimport near -o jsonpath='{.spec.internalTrafficPolicy}' 2>/dev/null) == Local ]]; }
  until_ok 60 "ServiceImport near with internalTrafficPolicy Local in c1" itp
  nip=$(kc c1 -n "$NS" get serviceimport near -o jsonpath='{.spec.ips[0]}')
  while read -r _ n _; do
    CLIENT=client; [[ $n == "$(cs_nodes c1 | awk 'NR == 1 {print $2}')" ]] || CLIENT=client-$n
    mine=$(kc c1 -n "$NS" get pods -l app=near --field-selector "spec.nodeName=$n" -o jsonpath='{.items[0].metadata.name}')
    own() { [[ $(kc c1 -n "$NS" exec "$CLIENT" -- sh -c "nc -w 2 $nip 80 </dev/null") == "c1 $mine" ]]; }
    until_ok 60 "a first reply from $mine through $nip on $n" own
    load "$nip" 10 c1 >"$out"
    ok=$(count "^c1 $mine\$" "$out")
    say "   internalTrafficPolicy Local, from $n: $ok/10 served by $mine (its own node's pod)"
    ((ok == 10)) || fail "internalTrafficPolicy Local from $n: $((10 - ok)) of 10 not served by $mine: $(sort "$out" | uniq -c | tr '\n' ' ')"
  done < <(cs_nodes c1)
  CLIENT=client
fi
# Output captured before matching: with pipefail, `grep -q` leaving early fails the writer.
st=$(kc c1 -n mcs-system exec ds/mcs-agent -- mcs-agent status --bpf-pin-dir /run/mcs/bpf)
grep -q "$vip" <<<"$st" || fail "c1's agent status does not list $vip"

# --- 2. Failover ------------------------------------------------------------------------------
say "2. c1 exports web too (1 pod); local first, then scaled to 0 under load"
web c1 1
until_ok 90 "web Ready in c1" kc c1 -n "$NS" rollout status deploy/web --timeout=2s
until_ok 60 "c1's own pod serving $vip" served_by c1
load "$vip" 10 >"$out"
say "   before: $(count '^c1 web-' "$out")/10 served by c1's own pod"
(($(count '^c1 web-' "$out") == 10)) || fail "local endpoints not preferred: $(tr '\n' ' ' <"$out")"
load "$vip" 160 >"$out" &
lp=$!
sleep 2
kc c1 -n "$NS" scale deploy/web --replicas=0 >/dev/null
wait "$lp"
c1n=$(count '^c1 web-' "$out"); c2n=$(count '^c2 web-' "$out"); bad=$(count FAIL "$out")
say "   under load while scaled to 0: $c1n by c1, $c2n by c2, $bad failed (of 160)"
((bad == 0)) || fail "failover: $bad requests failed"
grep -v '^c2 web-' <(tail -20 "$out") >/dev/null && fail "failover: the last 20 requests were not all served by c2"

# --- 3. Agent pod deleted under load ----------------------------------------------------------
node1=$(cs_nodes c1 | awk 'NR == 1 {print $2}')
agent_on() { kc c1 -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent --field-selector "spec.nodeName=$1" -o jsonpath='{.items[0].metadata.name}'; }
old=$(agent_on "$node1")
say "3. the agent pod $old of the client's node ($node1) deleted under load (eBPF)"
load "$vip" 200 >"$out" &
lp=$!
sleep 1
kc c1 -n mcs-system delete pod "$old" --wait=false >/dev/null
wait "$lp"
ok=$(count '^c2 web-' "$out"); bad=$(count FAIL "$out")
until_ok 120 "a new agent pod Ready in c1" kc c1 -n mcs-system rollout status ds/mcs-agent --timeout=2s
new=$(agent_on "$node1")
say "   $ok/200 served, $bad failed; the DaemonSet made $new"
((bad == 0)) || fail "agent deletion: $bad requests failed"
[[ $new != "$old" ]] || fail "the agent pod was not replaced"

# --- 4. Userspace -----------------------------------------------------------------------------
say "4. the chart switched to the userspace dataplane"
bash scripts/clusterset.sh install --dataplane userspace >/dev/null
for pod in $(kc c1 -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent -o name); do
  agentlog=$(kc c1 -n mcs-system logs "$pod")
  grep -q "removed the eBPF socket LB a previous agent left pinned" <<<"$agentlog" ||
    fail "the userspace agent $pod did not report removing the pinned socket LB; its log begins: $(head -5 <<<"$agentlog")"
done
while read -r c node _ _ _ cg _; do
  progs=$(bpftool cgroup show "$cg" 2>/dev/null | grep -c connect4 || true)
  ((progs == 0)) || fail "eBPF programs still attached at $cg ($c/$node) under the userspace dataplane"
done < <(cs_nodes)
# The forwarder's connection count on the first node of c$1 (where `client` is).
metric() { curl -s "http://$(cs_nodes "c$1" | awk 'NR == 1 {print $4}'):9464/metrics" | awk '/^mcs_proxy_connections_total/ {s += $2} END {print s + 0}'; }
for i in 1 2; do
  net=$(ip netns exec "mcs-cs-c$i" sysctl -n net.bridge.bridge-nf-call-iptables 2>/dev/null || echo 0)
  if ip -n "mcs-cs-c$i" link show cni0 >/dev/null 2>&1; then net="pods on bridge cni0, br_netfilter $net"; else net="routed pods"; fi
  vip_i=$(kc "c$i" -n "$NS" get serviceimport web -o jsonpath='{.spec.ips[0]}')
  until_ok 30 "a first reply through c$i's forwarder" served_by c2 "c$i" "$vip_i"
  before=$(metric "$i")
  load "$vip_i" 30 "c$i" >"$out"
  load "$name" 10 "c$i" >>"$out"
  want=40
  if ((dual)); then load "$(vip6_of "c$i" web)" 10 "c$i" >>"$out"; want=50; fi
  after=$(metric "$i")
  ok=$(count '^c2 web-' "$out")
  say "   userspace, from a pod of c$i ($net): $ok/$want served by c2 (by $vip_i$( ((dual)) && echo ", $(vip6_of "c$i" web)") and name); forwarder connections $before -> $after"
  ((ok == want)) || fail "userspace from c$i: $((want - ok)) of $want failed"
  ((after - before >= want)) || fail "userspace from c$i: the forwarder counted $((after - before)) connections, not $want"
  udp_checks "c$i" userspace
done
# The other direction: from c2's bridged pod to hello, exported by c1 only.
hip=$(kc c2 -n "$NS" get serviceimport hello -o jsonpath='{.spec.ips[0]}')
if until_ok 30 "a first reply from c1's hello through c2's forwarder" served_by c1 c2 "$hip" hello; then
  { load "$hip" 20 c2; load "hello.$NS.svc.clusterset.local" 10 c2; } >"$out"
  ok=$(count '^c1 hello-' "$out")
  say "   userspace, c2 -> c1: $ok/30 served by c1's hello (by $hip and name)"
  ((ok == 30)) || fail "userspace c2 -> c1: $((30 - ok)) of 30 failed"
fi
udp_checks c2 userspace echo1 c1
say "   back to eBPF"
bash scripts/clusterset.sh install --dataplane ebpf >/dev/null
until_ok 30 "a reply through eBPF again" served_by c2

say "5. every controller's member tokens rotated, the old ones revoked at once"
bash scripts/clusterset.sh rotate-tokens --revoke >/dev/null
t0=$SECONDS
for c in c1 c2; do
  kc "$c" -n "$NS" create service clusterip "after-$c" --tcp=80:8080 >/dev/null
  printf 'apiVersion: multicluster.x-k8s.io/v1beta1\nkind: ServiceExport\nmetadata: {name: after-%s, namespace: %s}\n' "$c" "$NS" |
    kc "$c" apply -f - >/dev/null
done
until_ok 300 "c1 imports c2's export made after the rotation" kc c1 -n "$NS" get serviceimport after-c2 &&
  until_ok 300 "c2 imports c1's export made after the rotation" kc c2 -n "$NS" get serviceimport after-c1 &&
  say "   each cluster imported the other's new export $((SECONDS - t0)) s after the revocation"
until_ok 30 "a reply through eBPF after the rotation" served_by c2

if ((failures)); then
  echo "e2e: $failures check(s) failed" >&2
  exit 1
fi
say "all checks passed"
