#!/usr/bin/env bash
# A real ClusterSet on this machine: N Kubernetes clusters of one or more nodes each (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler on the first node; containerd + runc,
# CNI (ptp, bridge, or both), kubelet, kube-proxy in nftables mode on every node; CoreDNS), each
# node in its own network namespace (its "host network", as kind's node containers), pods of
# every node of every cluster routable to each other, and mcs-dataplane installed into every
# cluster with its Helm chart from our own image.
#
#   bash scripts/clusterset.sh up [--clusters N] [--nodes N] [--ip-family ipv4|dual] [--bare]
#                                 [--dataplane ebpf|userspace] [--cni ptp|bridge|mixed]
#   bash scripts/clusterset.sh install [--dataplane ebpf|userspace]   # (re)install our chart
#   bash scripts/clusterset.sh import-image FILE.oci.tar   # into every node's containerd
#   bash scripts/clusterset.sh restart c<i> kube-apiserver|etcd|kube-controller-manager|kube-scheduler
#                                              # stop it and start it again with the same command line
#                                              # (e.g. an upgrade's image: deploy/image.sh with MCS_IMAGE_TAG)
#   bash scripts/clusterset.sh stop|start c<i> COMPONENT   # stop one (a member down), start it again
#   bash scripts/clusterset.sh rotate-tokens [--revoke]   # new 24 h member tokens for every
#                                              # controller (--revoke: the old ones at once)
#   bash scripts/clusterset.sh status
#   bash scripts/clusterset.sh images     # only build (and cache) the images besides ours
#   bash scripts/clusterset.sh down
#
# `up` prints `KUBECONFIG=<path>` as its last line (one context per cluster, named c1, c2, ...):
#   eval "$(bash scripts/clusterset.sh up | tail -1 | sed 's/^/export /')"
#   kubectl --context c1 get nodes
#
# Nodes of c<i>: c<i>-node (the control plane's too; netns mcs-cs-c<i>), then c<i>-node<k> for
# k = 2..--nodes (netns mcs-cs-c<i>-n<k>; state in $STATE/c<i>/node<k>). Every node of every
# cluster shares this machine's kernel, so each has its own kubelet cgroupRoot
# /mcs-c<i>/<node> and the agents use their node's subdirectory of the chart's cgroupRoot and
# bpfPinDir (chart value nodeSubdirectories). $STATE/nodes lists them (cluster, node, netns,
# address, pod range, cgroup, pin directory), for the suites that look at every node.
# Addresses (all inside 198.18.0.0/15, the only ranges used):
#   node k of c<i> 198.19.32.<i+10(k-1)>/24 on eth0 of its netns, bridged in the host (198.19.32.254)
#   pods of c<i>   198.19.<40+i>.0/24, split in equal parts, one per node (with --nodes 2, /25s)
#   services of c<i> 198.18.<16*i>.0/20
#   ClusterSetIPs  198.19.56.0/21 (every cluster's controller and agents; 2,046 addresses)
# With --ip-family dual, also (all inside 2001:2::/48) and every range above in both families
# (kube-apiserver, kube-controller-manager, kubelet's node IPs, kube-proxy, CNI, CoreDNS's
# Service, mcs-dns, the controllers' and agents' ClusterSetIP ranges):
#   node k of c<i> 2001:2:0:20::<i+10(k-1)>/64 (the host's bridge 2001:2:0:20::fe)
#   pods of c<i>   2001:2:0:4<i>::/64, node k's 2001:2:0:4<i>:<k>::/80
#   services of c<i> 2001:2:0:1<i>::/112
#   ClusterSetIPs  2001:2:0:56::/112
# Services stay single-stack unless they ask (ipFamilyPolicy), as on any dual-stack cluster.
# API server of c<i>: https://198.19.32.<i>:6443. DNS: kube-dns 198.18.<16*i>.10, mcs-dns .11 (both in the
# range's static band, which the API server leaves to fixed addresses).
#
# `down` undoes everything `up` did (processes, containers' cgroups, mounts, network namespaces,
# links, the kernel settings kubelet changes, files kubelet/containerd/CNI leave outside the
# state directory), also after `up` crashed; `up` runs it first when a previous run is left.
# If `up` fails it prints the failing component's log and runs `down` (MCS_CLUSTERSET_KEEP=1
# keeps the wreck for a look).
#
# Env: MCS_CLUSTERSET_DIR (state, default /var/lib/mcs-clusterset), MCS_CLUSTERS (default 2),
#      MCS_CLUSTERSET_NODES (nodes per cluster, 1..4, default 1), MCS_CLUSTERSET_IP_FAMILY
#      (ipv4, default, or dual),
#      MCS_IMAGE_BIN_DIR (binaries for our image; default: a release build),
#      MCS_CLUSTERSET_DATAPLANE (default ebpf), MCS_CLUSTERSET_CNI (ptp, routed pods, default;
#      bridge, pods on a Linux bridge with br_netfilter on as kubeadm requires; or mixed, the
#      odd clusters on ptp and the even ones on bridge), MCS_CLUSTERSET_CIDR (the ClusterSetIP range, default 198.19.56.0/21). Needs
#      root and scripts/setup.sh's tools.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
. scripts/env.sh

STATE="${MCS_CLUSTERSET_DIR:-/var/lib/mcs-clusterset}"
N="${MCS_CLUSTERS:-2}"
NODES="${MCS_CLUSTERSET_NODES:-1}"
IP_FAMILY="${MCS_CLUSTERSET_IP_FAMILY:-ipv4}"
DATAPLANE="${MCS_CLUSTERSET_DATAPLANE:-ebpf}"
CNI="${MCS_CLUSTERSET_CNI:-ptp}"
BARE=0
REVOKE=
BRIDGE=mcscs0
NETNS_PREFIX=mcs-cs-
NODE_NET=198.19.32
CLUSTERSET_CIDR="${MCS_CLUSTERSET_CIDR:-198.19.56.0/21}"
NODE_NET6=2001:2:0:20
CLUSTERSET_CIDR6=2001:2:0:56::/112
IMAGES="$MCS_CACHE/clusterset-images"
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops)
# Paths outside $STATE that kubelet, containerd, CNI or buildah create; removed by `down` when
# `up` found them absent.
OUTSIDE=(/run/containerd /var/lib/cni /var/lib/containers /run/containers /etc/cni /var/log/containers /var/log/pods)

log() { printf '\033[1mclusterset:\033[0m %s\n' "$*" >&2; }
die() { printf 'clusterset: %s\n' "$*" >&2; exit 1; }

# Node k (default 1, the control plane's) of cluster i: address, pod range, name, netns, state.
node_ip() { echo "$NODE_NET.$(($1 + 10 * (${2:-1} - 1)))"; }
cluster_pods() { echo "198.19.$((40 + $1)).0/24"; }
# The cluster's /24 in NODES equal parts (1 -> /24, 2 -> /25, 3..4 -> /26).
pod_cidr() {
  local k=${2:-1} bits=0
  while (((1 << bits) < NODES)); do bits=$((bits + 1)); done
  echo "198.19.$((40 + $1)).$(((k - 1) * (256 >> bits)))/$((24 + bits))"
}
node_name() { if ((${2:-1} == 1)); then echo "c$1-node"; else echo "c$1-node$2"; fi; }
node_dir() { if ((${2:-1} == 1)); then echo "$STATE/c$1"; else echo "$STATE/c$1/node$2"; fi; }
node_netns() { if ((${2:-1} == 1)); then netns "$1"; else echo "$NETNS_PREFIX""c$1-n$2"; fi; }
# Services: a /20 per cluster (4,094 addresses: room for the 1,000 exports of
# scripts/clusterset-latency.sh besides the e2e's and the conformance suite's).
svc_cidr() { echo "198.18.$((16 * $1)).0/20"; }
svc_ip() { echo "198.18.$((16 * $1)).$2"; }
netns() { echo "$NETNS_PREFIX""c$1"; }
# --ip-family dual: the IPv6 twin of each (see the address plan above).
dual() { [[ $IP_FAMILY == dual ]]; }
node_ip6() { echo "$NODE_NET6::$(($1 + 10 * (${2:-1} - 1)))"; }
cluster_pods6() { echo "2001:2:0:4$1::/64"; }
pod_cidr6() { echo "2001:2:0:4$1:${2:-1}::/80"; }
svc_cidr6() { echo "2001:2:0:1$1::/112"; }
# The comma list of a range (or address) of cluster/node "$2 $3" in every family of the
# ClusterSet: both svc_cidr 1 -> "198.18.16.0/20" or "198.18.16.0/20,2001:2:0:11::/112".
both() { local f=$1; shift; if dual; then echo "$("$f" "$@"),$("${f}6" "$@")"; else "$f" "$@"; fi; }
in_nodek() { local i=$1 k=$2; shift 2; nsenter --net="/run/netns/$(node_netns "$i" "$k")" -- "$@"; }
# The CNI of cluster i: --cni, or with --cni mixed ptp for the odd clusters and bridge for the
# even ones.
cni_of() { if [[ $CNI == mixed ]]; then (( $1 % 2 )) && echo ptp || echo bridge; else echo "$CNI"; fi; }
kc() { local i=$1; shift; kubectl --kubeconfig "$STATE/kubeconfig" --context "c$i" "$@"; }

# Start a long-running component of node k (default 1) of cluster i in its network namespace,
# in a session of its own, logging to <node dir>/logs/<name>.log; its pid is kept for `down`.
start() { local i=$1; shift; start_on "$i" 1 "$@"; }
start_on() {
  local i=$1 k=$2 name=$3; shift 3
  local d; d=$(node_dir "$i" "$k")
  mkdir -p "$d/logs" "$d/pids"
  setsid nsenter --net="/run/netns/$(node_netns "$i" "$k")" -- "$@" >"$d/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$d/pids/$name"
}

# Poll until a command succeeds, at most $2 seconds; on timeout show a log and fail.
wait_for() {
  local what=$1 secs=$2 logf=$3; shift 3
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      log "$what: not ready after ${secs}s; last lines of $logf:"
      tail -25 "$logf" >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

# Why the pods of namespace $2 in cluster $1 are not ready: the pods, their events (scheduling,
# mounts, probes), the node's taints and conditions, the free space kubelet's eviction sees, and
# the scheduler's and kubelet's last lines. Printed when a wait in `up` fails.
explain_pods() {
  local i=$1 ns=$2 d="$STATE/c$1"
  {
    echo "--- pods in $ns of c$i"
    kc "$i" -n "$ns" get pods -o wide
    echo "--- events in $ns of c$i (oldest first)"
    kc "$i" -n "$ns" get events --sort-by=.lastTimestamp
    echo "--- nodes of c$i: taints, conditions"
    kc "$i" get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{range .spec.taints[*]}  taint {.key}={.value}:{.effect}{"\n"}{end}{range .status.conditions[*]}  {.type}={.status} ({.reason}) since {.lastTransitionTime}{"\n"}{end}{end}'
    echo "--- components of c$i"
    local f
    for f in "$d"/pids/* "$d"/node*/pids/*; do
      [[ -f $f ]] || continue
      if kill -0 "$(cat "$f")" 2>/dev/null; then echo "${f##*/}: running"; else echo "${f##*/}: NOT RUNNING"; fi
    done
    echo "--- free space under $STATE"
    df -h "$STATE"
    # (The scheduler's complaints about its own serving CA bundle, repeated, are left out.)
    echo "--- kube-scheduler c$i (last lines)"
    grep -v extension-apiserver-authentication "$d/logs/kube-scheduler.log" | tail -15
    echo "--- kubelet c$i (last errors and warnings)"
    grep -E '^[EW][0-9]' "$d/logs/kubelet.log" | tail -15
    for f in "$d"/node*/logs/kubelet.log; do
      [[ -f $f ]] || continue
      echo "--- kubelet of ${f%/logs/kubelet.log} (last errors and warnings)"
      grep -E '^[EW][0-9]' "$f" | tail -10
    done
  } >&2 2>&1 || true
}

# --- down: undo everything, whatever state a previous run left -------------------------------
kill_pidfile() {
  local f=$1 pid
  pid=$(cat "$f" 2>/dev/null) || return 0
  [[ -n $pid ]] && kill "$pid" 2>/dev/null || true
}

cgroup_dirs() {
  # Every cgroup directory of the clusterset's kubelets (cgroupRoot /mcs-c<i>), v1 and v2.
  local h
  for h in /sys/fs/cgroup/*/; do
    ls -d "$h"mcs-c[0-9]* 2>/dev/null || true
  done
}

down() {
  local had=0
  [[ -d $STATE ]] && had=1
  grep -q "^$NETNS_PREFIX" < <(ip netns list 2>/dev/null) && had=1
  ip link show "$BRIDGE" >/dev/null 2>&1 && had=1
  [[ -n $(cgroup_dirs) ]] && had=1
  compgen -G "/sys/fs/bpf/mcs-clusterset-c[0-9]*" >/dev/null && had=1
  if ((had == 0)); then log "nothing to take down"; return 0; fi
  log "taking the clusterset down"
  # 1. Components, in reverse order of start (kubelet first, so it does not restart pods).
  local f
  for f in "$STATE"/c*/pids/kubelet "$STATE"/c*/node*/pids/kubelet "$STATE"/c*/pids/kube-proxy \
    "$STATE"/c*/node*/pids/* "$STATE"/c*/pids/*; do
    [[ -f $f ]] && kill_pidfile "$f"
  done
  # containerd shims outlive containerd; they are found by their -address under $STATE.
  pkill -f -- "-address $STATE/" 2>/dev/null || true
  local deadline=$((SECONDS + 15)) alive
  while :; do
    alive=0
    for f in "$STATE"/c*/pids/* "$STATE"/c*/node*/pids/*; do
      [[ -f $f ]] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1
    done
    pgrep -f -- "-address $STATE/" >/dev/null 2>&1 && alive=1
    ((alive == 0 || SECONDS > deadline)) && break
    sleep 0.2
  done
  for f in "$STATE"/c*/pids/* "$STATE"/c*/node*/pids/*; do [[ -f $f ]] && kill -9 "$(cat "$f")" 2>/dev/null || true; done
  pkill -9 -f -- "-address $STATE/" 2>/dev/null || true
  # 2. Containers' processes: whatever is still in the kubelets' cgroups.
  local d pass
  for pass in 1 2 3 4 5 6 7 8 9 10; do
    local left=0
    while read -r d; do
      [[ -z $d ]] && continue
      while read -r p; do
        [[ -n $p ]] && { kill -9 "$p" 2>/dev/null || true; left=1; }
      done < <(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null)
    done < <(cgroup_dirs)
    ((left == 0)) && break
    sleep 0.3
  done
  # 3. Mounts under the state directory (pod volumes, netns bind mounts, containerd's
  #    snapshots), deepest first.
  if [[ -d $STATE ]]; then
    local m
    while read -r m; do
      umount -l "$m" 2>/dev/null || true
    done < <(awk -v s="$STATE/" 'index($5, s) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  fi
  # 4. cgroups, bottom-up (rmdir, never rm: cgroupfs files cannot be removed).
  while read -r d; do
    [[ -n $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done < <(cgroup_dirs)
  # 5. Network: node namespaces (their bridges, veth ends, nftables/iptables tables and
  #    sysctls go with them), then the host's bridge.
  local ns
  for ns in $(ip netns list 2>/dev/null | awk -v p="$NETNS_PREFIX" 'index($1, p) == 1 { print $1 }'); do
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  # The agents' pinned eBPF maps and links (they outlive the agents by design).
  rm -rf /sys/fs/bpf/mcs-clusterset-c[0-9]* 2>/dev/null || true
  # 6. The kernel settings kubelet changes (global, not per network namespace), and bpffs's
  #    mount propagation.
  if [[ -f $STATE/sysctl.saved ]]; then
    local k v
    while read -r k v; do sysctl -qw "$k=$v" >/dev/null 2>&1 || log "could not restore $k=$v"; done <"$STATE/sysctl.saved"
  fi
  if [[ -f $STATE/propagation.saved ]]; then
    local mp prop
    while read -r mp prop; do
      case $prop in private|shared|slave|unbindable) mount --make-"$prop" "$mp" || log "could not make $mp $prop again" ;; esac
    done <"$STATE/propagation.saved"
  fi
  # 7. Files outside the state directory: the ones `up` found absent go; in ones that were
  #    there, only what points into the state directory (log symlinks, CNI results of our
  #    networks).
  if [[ -f $STATE/outside.absent ]]; then
    while read -r p; do [[ -n $p ]] && rm -rf "$p"; done <"$STATE/outside.absent"
  fi
  find /var/log/containers -maxdepth 1 -lname "$STATE/*" -delete 2>/dev/null || true
  rm -f /var/lib/cni/results/"$NETNS_PREFIX"* 2>/dev/null || true
  if [[ -d $STATE ]]; then
    chmod -R u+w "$STATE" 2>/dev/null || true
    rm -rf "$STATE" || log "could not remove all of $STATE"
  fi
  # What is left, if anything, is said.
  local left=""
  [[ -n $(cgroup_dirs) ]] && left+=" cgroups($(cgroup_dirs | tr '\n' ' '))"
  grep -q "^$NETNS_PREFIX" < <(ip netns list 2>/dev/null) && left+=" netns"
  compgen -G "/sys/fs/bpf/mcs-clusterset-c[0-9]*" >/dev/null && left+=" bpffs pins"
  pgrep -f -- "$STATE/" >/dev/null 2>&1 && left+=" processes($(pgrep -f -- "$STATE/" | tr '\n' ' '))"
  [[ -n $left ]] && die "down: left behind:$left"
  log "down: done"
}

# --- images (no registry: built here, imported into each node's containerd) -----------------
# shellcheck source=deploy/rootfs.sh
. deploy/rootfs.sh

# buildah with a private vfs store under $1.
bah() { local w=$1; shift; buildah --root "$w/storage" --runroot "$w/run" --storage-driver vfs "$@"; }

# image_from NAME:TAG FILE|TAR OUT.tar [buildah config options: entrypoint, cmd]
image_from() {
  local ref=$1 src=$2 out=$3 w c; shift 3
  w=$(mktemp -d "$IMAGES/work.XXXXXX")
  c=$(bah "$w" from scratch)
  bah "$w" add "$c" "$src" / >/dev/null
  bah "$w" config "$@" \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
  bah "$w" commit --quiet --format oci "$c" "$ref" >/dev/null
  rm -f "$out.tmp"
  bah "$w" push --quiet "$ref" "oci-archive:$out.tmp:$ref"
  bah "$w" rm "$c" >/dev/null 2>&1 || true
  chmod -R u+w "$w" 2>/dev/null || true
  rm -rf "$w"
  mv "$out.tmp" "$out"
}

# The images every node needs besides ours; cached in $IMAGES, keyed by what they are made of.
TOOLS_PKGS=socat,netcat-openbsd,bind9-dnsutils,mawk,curl,iproute2,procps,iputils-ping
build_images() {
  mkdir -p "$IMAGES"
  if [[ ! -f $IMAGES/pause.tar ]]; then
    log "image: pause (static C program)"
    local w; w=$(mktemp -d "$IMAGES/pause.XXXXXX")
    gcc -static -O2 -o "$w/pause" scripts/clusterset/pause.c
    image_from docker.io/mcs-clusterset/pause:1 "$w/pause" "$IMAGES/pause.tar" --entrypoint '["/pause"]'
    rm -rf "$w"
  fi
  if [[ ! -f $IMAGES/coredns-$COREDNS_VERSION.tar ]]; then
    log "image: CoreDNS $COREDNS_VERSION (the binary setup.sh built)"
    [[ -x $MCS_COREDNS_BIN_DIR/coredns ]] || die "no CoreDNS in $MCS_COREDNS_BIN_DIR (run bash scripts/setup.sh)"
    image_from "docker.io/mcs-clusterset/coredns:$COREDNS_VERSION" "$MCS_COREDNS_BIN_DIR/coredns" \
      "$IMAGES/coredns-$COREDNS_VERSION.tar" --entrypoint '["/coredns"]'
  fi
  # The upstream conformance suite's images, under the names it uses, from Debian packages
  # with the tools it runs in them (sh, socat, grep, awk, tr; nslookup, nc -4/-6 -v -w).
  local key; key=$(echo "$TOOLS_PKGS entrypoints-2" | sha256sum | cut -c1-12)
  if [[ ! -f $IMAGES/tools-$key.tar ]]; then
    log "image: Debian tools rootfs ($TOOLS_PKGS), about 1 min"
    local w; w=$(mktemp -d "$IMAGES/tools.XXXXXX")
    debian_rootfs bookworm "$TOOLS_PKGS" "$w/rootfs.tar"
    # Entrypoint and command as the originals have them: socat's is socat; netshoot has none
    # (the suite's request pod gives only args, a shell command line).
    image_from docker.io/alpine/socat:1.7.4.4 "$w/rootfs.tar" "$IMAGES/socat.tar.new" \
      --entrypoint '["socat"]' --cmd ''
    image_from docker.io/nicolaka/netshoot:v0.15 "$w/rootfs.tar" "$IMAGES/netshoot.tar.new" \
      --entrypoint '' --cmd /bin/bash
    mv "$IMAGES/socat.tar.new" "$IMAGES/socat-$key.tar"
    mv "$IMAGES/netshoot.tar.new" "$IMAGES/netshoot-$key.tar"
    rm -rf "$w"
    # Older builds of these images (another package list) go.
    find "$IMAGES" -maxdepth 1 \( -name 'socat-*.tar' -o -name 'netshoot-*.tar' -o -name 'tools-*.tar' \) \
      ! -name "*-$key.tar" -delete
    touch "$IMAGES/tools-$key.tar"
  fi
  TOOL_IMAGES=("$IMAGES/socat-$key.tar" "$IMAGES/netshoot-$key.tar")
}

# Our image from $MCS_IMAGE_BIN_DIR (or a release build), into $STATE/images.
build_our_image() {
  log "image: mcs-dataplane (deploy/image.sh)"
  MCS_IMAGE_OUT="$STATE/images" bash deploy/image.sh >"$STATE/images.log" 2>&1 ||
    { tail -20 "$STATE/images.log" >&2; die "deploy/image.sh failed"; }
  OUR_IMAGE=$(ls "$STATE"/images/*.oci.tar | head -1)
}

ctr_import() {
  local d=$1 f=$2
  ctr --address "$d/containerd/containerd.sock" -n k8s.io images import "$f" >/dev/null
}

# --- up ---------------------------------------------------------------------------------------
pki() {
  local p="$STATE/pki"
  mkdir -p "$p"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=mcs-clusterset-ca" \
    -keyout "$p/ca.key" -out "$p/ca.crt" 2>/dev/null
  openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
  openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
}

# cert NAME CN O SANs...
cert() {
  local p="$STATE/pki" name=$1 cn=$2 o=$3; shift 3
  local san="" s
  for s in "$@"; do san+="${san:+,}$s"; done
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn${o:+/O=$o}" -keyout "$p/$name.key" \
    -out "$p/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    [[ -n $san ]] && echo "subjectAltName=$san"
  } >"$p/$name.ext"
  openssl x509 -req -in "$p/$name.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
    -days 30 -extfile "$p/$name.ext" -out "$p/$name.crt" 2>/dev/null
}

# kubeconfig FILE CURRENT-CONTEXT "NAME SERVER TOKEN"...: one cluster, user and context per
# entry, all three named NAME, trusting the clusterset's CA (CURRENT-CONTEXT may be empty). A
# TOKEN of the form file:PATH is written as `tokenFile: PATH` (read again when it changes).
kubeconfig() {
  local file=$1 current=$2 e name server token ca
  shift 2
  ca=$(base64 -w0 <"$STATE/pki/ca.crt")
  {
    echo "apiVersion: v1"; echo "kind: Config"; echo "clusters:"
    for e in "$@"; do
      read -r name server token <<<"$e"
      echo "- name: $name"; echo "  cluster:"; echo "    server: $server"
      echo "    certificate-authority-data: $ca"
    done
    echo "users:"
    for e in "$@"; do
      read -r name server token <<<"$e"
      echo "- name: $name"; echo "  user:"
      if [[ $token == file:* ]]; then echo "    tokenFile: ${token#file:}"; else echo "    token: $token"; fi
    done
    echo "contexts:"
    for e in "$@"; do
      read -r name server token <<<"$e"
      echo "- name: $name"; echo "  context: {cluster: $name, user: $name}"
    done
    if [[ -n $current ]]; then echo "current-context: $current"; fi
  } >"$file"
}

network() {
  log "network: bridge $BRIDGE ($NODE_NET.254/24), $N clusters of $NODES node(s)"
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_NET.254/24" dev "$BRIDGE"
  dual && ip -6 addr add "$NODE_NET6::fe/64" dev "$BRIDGE" nodad
  ip link set "$BRIDGE" up
  local i k j l
  : >"$STATE/nodes"
  for ((i = 1; i <= N; i++)); do
    for ((k = 1; k <= NODES; k++)); do
      local ns; ns=$(node_netns "$i" "$k")
      ip netns add "$ns"
      # The host end's name: mcscs-c<i> for the first node, mcscs-c<i>n<k> for the others.
      local host_end="mcscs-c$i"; ((k == 1)) || host_end+="n$k"
      ip link add "$host_end" type veth peer name eth0 netns "$ns"
      ip link set "$host_end" master "$BRIDGE" up
      in_nodek "$i" "$k" ip link set lo up
      in_nodek "$i" "$k" ip addr add "$(node_ip "$i" "$k")/24" dev eth0
      in_nodek "$i" "$k" ip link set eth0 up
      if dual; then
        in_nodek "$i" "$k" ip -6 addr add "$(node_ip6 "$i" "$k")/64" dev eth0 nodad
        in_nodek "$i" "$k" sysctl -qw net.ipv6.conf.all.forwarding=1
      fi
      # What docs/install.md#upgrades asks of a node for the userspace forwarder's handover to
      # the next agent (a container cannot set it).
      in_nodek "$i" "$k" sysctl -qw net.ipv4.tcp_migrate_req=1
      if [[ $(cni_of "$i") == bridge ]]; then
        # kubeadm's preflight requires these where pods sit on a bridge (per network namespace).
        in_nodek "$i" "$k" sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
      fi
      # Every other node's pods (this cluster's and the others') through that node.
      for ((j = 1; j <= N; j++)); do
        for ((l = 1; l <= NODES; l++)); do
          ((j == i && l == k)) && continue
          in_nodek "$i" "$k" ip route add "$(pod_cidr "$j" "$l")" via "$(node_ip "$j" "$l")"
          if dual; then in_nodek "$i" "$k" ip -6 route add "$(pod_cidr6 "$j" "$l")" via "$(node_ip6 "$j" "$l")"; fi
        done
      done
      # The node's "default" route, inside our range only: the host's bridge address. Without a
      # route, the node's own connections to ClusterIPs (kube-proxy DNATs them after routing)
      # fail with ENETUNREACH; the host does not forward, so nothing leaves through it.
      in_nodek "$i" "$k" ip route add 198.18.0.0/15 via "$NODE_NET.254"
      # The host reaches the pods too (kubectl port-forward is not needed to look at them).
      ip route add "$(pod_cidr "$i" "$k")" via "$(node_ip "$i" "$k")"
      if dual; then
        in_nodek "$i" "$k" ip -6 route add 2001:2::/48 via "$NODE_NET6::fe"
        ip -6 route add "$(pod_cidr6 "$i" "$k")" via "$(node_ip6 "$i" "$k")"
      fi
      # For the suites: cluster, node, netns, address, pod range, kubelet cgroup (cgroup2),
      # the agent's pin directory, IPv6 address (- when IPv4 only).
      printf 'c%s %s %s %s %s %s %s %s\n' "$i" "$(node_name "$i" "$k")" "$ns" "$(node_ip "$i" "$k")" \
        "$(pod_cidr "$i" "$k")" "/sys/fs/cgroup/unified/mcs-c$i/$(node_name "$i" "$k")" \
        "/sys/fs/bpf/mcs-clusterset-c$i/$(node_name "$i" "$k")" "$(dual && node_ip6 "$i" "$k" || echo -)" >>"$STATE/nodes"
    done
  done
}

control_plane() {
  local i=$1 d="$STATE/c$i" ip; ip=$(node_ip "$i")
  mkdir -p "$d/etcd"
  cert "apiserver-c$i" kube-apiserver "" "IP:$ip" "IP:$(svc_ip "$i" 1)" IP:127.0.0.1 \
    DNS:kubernetes DNS:kubernetes.default DNS:kubernetes.default.svc \
    DNS:kubernetes.default.svc.cluster.local DNS:localhost
  # Tokens: an admin (the user's kubeconfig), and each component as itself; each node its own
  # (NodeRestriction lets a kubelet write only its own Node and pods).
  local t k; : >"$d/tokens.csv"
  for t in admin kcm scheduler proxy; do echo "$(openssl rand -hex 16)" >"$d/token.$t"; done
  for ((k = 1; k <= NODES; k++)); do
    cert "kubelet-$(node_name "$i" "$k")" "$(node_name "$i" "$k")" "" "IP:$(node_ip "$i" "$k")" "DNS:$(node_name "$i" "$k")"
    openssl rand -hex 16 >"$d/token.node-$k"
  done
  {
    echo "$(cat "$d/token.admin"),clusterset-admin,clusterset-admin,system:masters"
    for ((k = 1; k <= NODES; k++)); do
      echo "$(cat "$d/token.node-$k"),system:node:$(node_name "$i" "$k"),node-c$i-$k,system:nodes"
    done
    echo "$(cat "$d/token.kcm"),system:kube-controller-manager,kcm-c$i"
    echo "$(cat "$d/token.scheduler"),system:kube-scheduler,scheduler-c$i"
    echo "$(cat "$d/token.proxy"),system:kube-proxy,proxy-c$i"
  } >"$d/tokens.csv"
  for t in kcm scheduler; do
    kubeconfig "$d/$t.kubeconfig" local "local https://127.0.0.1:6443 $(cat "$d/token.$t")"
  done
  # Each node's kubelet and kube-proxy: the first node's through loopback, the others' through
  # the first node's address.
  local nd server
  for ((k = 1; k <= NODES; k++)); do
    nd=$(node_dir "$i" "$k"); server="https://$ip:6443"
    ((k == 1)) && server=https://127.0.0.1:6443
    mkdir -p "$nd"
    kubeconfig "$nd/node.kubeconfig" local "local $server $(cat "$d/token.node-$k")"
    kubeconfig "$nd/proxy.kubeconfig" local "local $server $(cat "$d/token.proxy")"
  done
  local p="$STATE/pki"
  start "$i" etcd etcd --name "c$i" --data-dir "$d/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster "c$i=http://127.0.0.1:2380" --listen-metrics-urls= --log-level warn --unsafe-no-fsync
  start "$i" kube-apiserver "$MCS_KUBE_BIN_DIR/kube-apiserver" \
    --etcd-servers http://127.0.0.1:2379 --bind-address 0.0.0.0 --advertise-address "$ip" \
    --secure-port 6443 --tls-cert-file "$p/apiserver-c$i.crt" --tls-private-key-file "$p/apiserver-c$i.key" \
    --client-ca-file "$p/ca.crt" --token-auth-file "$d/tokens.csv" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --allow-privileged \
    --kubelet-client-certificate "$p/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$p/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$p/ca.crt" --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
    --service-cluster-ip-range "$(both svc_cidr "$i")" --v 1
}

controllers() {
  local i=$1 d="$STATE/c$i" p="$STATE/pki"
  start "$i" kube-controller-manager "$MCS_KUBE_BIN_DIR/kube-controller-manager" \
    --kubeconfig "$d/kcm.kubeconfig" --authentication-kubeconfig "$d/kcm.kubeconfig" \
    --authorization-kubeconfig "$d/kcm.kubeconfig" --bind-address 127.0.0.1 \
    --use-service-account-credentials --service-account-private-key-file "$p/sa.key" \
    --root-ca-file "$p/ca.crt" --service-cluster-ip-range "$(both svc_cidr "$i")" \
    --cluster-name "c$i" --leader-elect=false --v 1
  start "$i" kube-scheduler "$MCS_KUBE_BIN_DIR/kube-scheduler" \
    --kubeconfig "$d/scheduler.kubeconfig" --authentication-kubeconfig "$d/scheduler.kubeconfig" \
    --authorization-kubeconfig "$d/scheduler.kubeconfig" --bind-address 127.0.0.1 \
    --leader-elect=false --v 2
}

start_node() {
  local i=$1 k=$2 p="$STATE/pki" ip h d name cg; ip=$(node_ip "$i" "$k") d=$(node_dir "$i" "$k") name=$(node_name "$i" "$k")
  mkdir -p "$d"/{kubelet,pods-logs,cni/net.d,cni/ipam,containerd,runc}
  # kubelet's cgroupRoot, /mcs-c<i>/<node>, exists beforehand in every hierarchy (cpuset
  # copied from the parent at each level). One per node: they share this kernel, and the
  # agent attaches its programs to its own node's.
  cg="mcs-c$i/$name"
  for h in /sys/fs/cgroup/*/; do
    mkdir -p "$h/$cg"
    if [[ -f $h/cpuset.cpus ]]; then
      local lvl
      for lvl in "mcs-c$i" "$cg"; do
        cat "$h/cpuset.cpus" >"$h/$lvl/cpuset.cpus"
        cat "$h/cpuset.mems" >"$h/$lvl/cpuset.mems"
      done
    fi
  done
  # ptp (default): routed pods, one veth each, as Calico, Cilium and most cloud CNIs; bridge:
  # pods on a Linux bridge with br_netfilter on, as the bridge CNI, kubenet and flannel.
  local plugin='"type": "ptp"'
  [[ $(cni_of "$i") == bridge ]] && plugin='"type": "bridge", "bridge": "cni0", "isGateway": true, "hairpinMode": true'
  cat >"$d/cni/net.d/10-clusterset.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "$(node_netns "$i" "$k")",
  "plugins": [{
    $plugin, "ipMasq": false,
    "ipam": {
      "type": "host-local", "dataDir": "$d/cni/ipam",
      "ranges": [[{ "subnet": "$(pod_cidr "$i" "$k")" }]$(dual && echo ", [{ \"subnet\": \"$(pod_cidr6 "$i" "$k")\" }]")],
      "routes": [{ "dst": "198.18.0.0/15" }$(dual && echo ', { "dst": "2001:2::/48" }')]
    }
  }]
}
EOF
  cat >"$d/containerd/config.toml" <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$d/containerd/containerd.sock"
[ttrpc]
  address = "$d/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/mcs-clusterset/pause:1"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$d/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni/net.d"
EOF
  start_on "$i" "$k" containerd containerd --config "$d/containerd/config.toml"
  wait_for "containerd $name" 30 "$d/logs/containerd.log" \
    ctr --address "$d/containerd/containerd.sock" version
  local f
  for f in "$IMAGES/pause.tar" "$IMAGES/coredns-$COREDNS_VERSION.tar" "${TOOL_IMAGES[@]}" ${OUR_IMAGE:+"$OUR_IMAGE"}; do
    ctr_import "$d" "$f"
  done
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
cgroupDriver: cgroupfs
cgroupRoot: /$cg
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$d/containerd/containerd.sock
tlsCertFile: $p/kubelet-$name.crt
tlsPrivateKeyFile: $p/kubelet-$name.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $p/ca.crt}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
clusterDNS: [$(svc_ip "$i" 10)]
resolvConf: ""
podLogsDir: $d/pods-logs
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
# Our images are imported, not pulled: never garbage-collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOF
  start_on "$i" "$k" kubelet "$MCS_KUBE_BIN_DIR/kubelet" --config "$d/kubelet.yaml" \
    --kubeconfig "$d/node.kubeconfig" --root-dir "$d/kubelet" --hostname-override "$name" \
    --node-ip "$(both node_ip "$i" "$k")" --v 1
  cat >"$d/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection: {kubeconfig: $d/proxy.kubeconfig}
hostnameOverride: $name
clusterCIDR: $(both cluster_pods "$i")
bindAddress: $ip
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# Leave the host's conntrack settings alone (0 = do not set).
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start_on "$i" "$k" kube-proxy "$MCS_KUBE_BIN_DIR/kube-proxy" --config "$d/kube-proxy.yaml" --v 1
}

# clusterset_secret I [revoke]: the Secret of c<I>'s controller: a kubeconfig of the other
# members whose users read their tokens from files beside it (docs/install.md), and those
# files: a fresh token of each member's read-only mcs-controller-reader, valid 24 h and bound
# to a Secret in that member (deleting it revokes the token). Run again (`rotate-tokens`)
# before they expire: the controller reads a changed file within about two minutes
# (kubelet's Secret refresh, then kube-rs's token file re-read), without a restart. With
# `revoke`, the tokens minted before are revoked at once (their Secrets deleted).
clusterset_secret() {
  local i=$1 revoke=${2:-} j gen f="$STATE/c$1/clusterset-for-controller.kubeconfig" members=() files=()
  gen=$(date +%s%N)
  for ((j = 1; j <= N; j++)); do
    ((j == i)) && continue
    kc "$j" -n mcs-system create secret generic "mcs-reader-token-c$i-$gen" >/dev/null
    kc "$j" -n mcs-system label secret "mcs-reader-token-c$i-$gen" \
      mcs-dataplane.io/reader-token-for="c$i" mcs-dataplane.io/reader-token-generation="$gen" >/dev/null
    kc "$j" -n mcs-system create token mcs-controller-reader --duration=24h \
      --bound-object-kind Secret --bound-object-name "mcs-reader-token-c$i-$gen" >"$STATE/c$i/c$j.token"
    members+=("c$j https://$(node_ip "$j"):6443 file:/etc/mcs/clusterset/c$j.token")
    files+=(--from-file="c$j.token=$STATE/c$i/c$j.token")
  done
  kubeconfig "$f" "" "${members[@]}"
  kc "$i" -n mcs-system create secret generic mcs-clusterset-kubeconfig \
    --from-file=kubeconfig="$f" "${files[@]}" --dry-run=client -o yaml | kc "$i" apply -f - >/dev/null
  if [[ $revoke == revoke ]]; then
    for ((j = 1; j <= N; j++)); do
      ((j == i)) && continue
      kc "$j" -n mcs-system delete secret --wait=false \
        -l "mcs-dataplane.io/reader-token-for=c$i,mcs-dataplane.io/reader-token-generation!=$gen" >/dev/null
    done
  fi
}

agents_ready() {
  local i=$1 ready
  kc "$i" -n mcs-system rollout status ds/mcs-agent --timeout=2s >/dev/null || return 1
  ready=$(kc "$i" -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c '^True$' || true)
  ((ready == NODES))
}

# Our chart into every cluster: the agents and the MCS controller (with a kubeconfig of the
# other members, tokens of their read-only mcs-controller-reader), mcs-dns at a fixed
# ClusterIP, and CoreDNS's Corefile gains our shipped clusterset.local block.
install_chart() {
  local i j dp=$DATAPLANE replicas=1
  # One controller on a single node (two would only share its two cores); with more nodes, the
  # chart's two, on different nodes (one leads, the other takes over).
  ((NODES == 1)) || replicas=2
  for ((i = 1; i <= N; i++)); do
    log "helm: mcs-dataplane into c$i (dataplane $dp)"
    helm --kubeconfig "$STATE/kubeconfig" --kube-context "c$i" upgrade --install mcs-dataplane \
      deploy/helm/mcs-dataplane --wait=false \
      --set controller.enabled=true --set clusterId="c$i" \
      --set "clustersetIPCIDRs={$CLUSTERSET_CIDR$(dual && echo ",$CLUSTERSET_CIDR6")}" --set dataplane="$dp" \
      --set cgroupRoot="/sys/fs/cgroup/unified/mcs-c$i" --set bpfPinDir="/sys/fs/bpf/mcs-clusterset-c$i" \
      --set nodeSubdirectories=true --set handoverDir="$STATE/handover/c$i" \
      --set image.pullPolicy=Never --set dns.clusterIP="$(svc_ip "$i" 11)" \
      --set controller.replicas="$replicas" >/dev/null
  done
  for ((i = 1; i <= N; i++)); do
    clusterset_secret "$i"
    kc "$i" -n mcs-system rollout restart deployment/mcs-controller >/dev/null
    # CoreDNS: our shipped clusterset.local block, pointed at this cluster's mcs-dns.
    local block corefile
    block=$(grep -v '^#' deploy/dns/Corefile.clusterset.local | sed "s/MCS_DNS_IP/$(svc_ip "$i" 11)/")
    corefile=$(kc "$i" -n kube-system get configmap coredns -o jsonpath='{.data.Corefile}' | awk '/^clusterset.local:53/{skip=1} skip&&/^}/{skip=0; next} !skip')
    kc "$i" -n kube-system create configmap coredns --from-literal=Corefile="$corefile
$block" --dry-run=client -o yaml | kc "$i" apply -f - >/dev/null
    # CoreDNS's reload plugin sees the new Corefile only once kubelet has refreshed the volume
    # (up to a minute); a restart makes it now.
    kc "$i" -n kube-system rollout restart deploy/coredns >/dev/null
  done
  for ((i = 1; i <= N; i++)); do
    # Rolled out, and a Ready agent on every node (a DaemonSet just created can report done
    # before its pods are counted).
    wait_for "mcs-agent in c$i" 120 /dev/null agents_ready "$i" ||
      { explain_pods "$i" mcs-system; kc "$i" -n mcs-system logs ds/mcs-agent --tail=30 >&2 || true; return 1; }
    wait_for "mcs-controller in c$i" 120 /dev/null kc "$i" -n mcs-system rollout status deploy/mcs-controller --timeout=2s ||
      { explain_pods "$i" mcs-system; kc "$i" -n mcs-system logs deploy/mcs-controller --tail=30 >&2 || true; return 1; }
  done
  # clusterset.local answered through each cluster's DNS (CoreDNS -> mcs-dns -> the agents).
  for ((i = 1; i <= N; i++)); do
    wait_for "CoreDNS in c$i" 90 /dev/null kc "$i" -n kube-system rollout status deploy/coredns --timeout=2s ||
      { explain_pods "$i" kube-system; return 1; }
    wait_for "clusterset.local through c$i's DNS" 60 /dev/null sh -c \
      "nsenter --net=/run/netns/$(netns "$i") -- dig +short +time=1 +tries=1 @$(svc_ip "$i" 10) dns-version.clusterset.local TXT | grep -q ."
  done
  log "mcs-dataplane runs in every cluster (agent: $dp); clusterset.local answered by every cluster's DNS"
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root"
  local t
  for t in etcd containerd ctr runc nsenter openssl gcc buildah mmdebstrap helm kubectl; do
    command -v "$t" >/dev/null || die "$t not found (run bash scripts/setup.sh)"
  done
  for t in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
    [[ -x $MCS_KUBE_BIN_DIR/$t ]] || die "$MCS_KUBE_BIN_DIR/$t missing (run bash scripts/setup.sh)"
  done
  [[ -x /usr/lib/cni/bridge ]] || die "CNI plugins missing (run bash scripts/setup.sh)"
  # The layout this machine kind has (REALNODE.md): cgroup v1 controllers under /sys/fs/cgroup
  # and cgroup2 at /sys/fs/cgroup/unified. A pure cgroup v2 host would need other paths for
  # kubelet's cgroupRoot and the agent's cgroupRoot; not done yet, so say so instead of
  # making directories in the wrong places.
  [[ $(stat -fc %T /sys/fs/cgroup/unified 2>/dev/null) == cgroup2fs && -d /sys/fs/cgroup/cpu ]] ||
    die "needs the hybrid cgroup layout (v1 controllers, cgroup2 at /sys/fs/cgroup/unified); this host has $(stat -fc %T /sys/fs/cgroup 2>/dev/null) at /sys/fs/cgroup"
  down
  local t0=$SECONDS
  mkdir -p "$STATE"
  echo "$IP_FAMILY" >"$STATE/ip-family"
  # What `down` must restore or remove.
  for t in "${SYSCTLS[@]}"; do echo "$t $(sysctl -n "$t")"; done >"$STATE/sysctl.saved"
  for t in "${OUTSIDE[@]}"; do [[ -e $t ]] || echo "$t"; done >"$STATE/outside.absent"
  # bpffs shared, as systemd leaves every mount on a real node (the agent's bpffs volume is
  # mounted with HostToContainer propagation, which needs it); `down` puts it back.
  echo "/sys/fs/bpf $(findmnt -no PROPAGATION /sys/fs/bpf)" >"$STATE/propagation.saved"
  mount --make-shared /sys/fs/bpf
  trap 'rc=$?; if ((rc != 0)); then log "up failed (rc $rc)"; if [[ ${MCS_CLUSTERSET_KEEP:-0} == 1 ]]; then log "kept for a look: $STATE (bash scripts/clusterset.sh down removes it)"; else down || true; fi; fi' EXIT
  build_images
  ((BARE)) || build_our_image
  network
  pki
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  local i
  for ((i = 1; i <= N; i++)); do control_plane "$i"; done
  # The user's kubeconfig: one context per cluster, named by its cluster id.
  local admins=()
  for ((i = 1; i <= N; i++)); do
    admins+=("c$i https://$(node_ip "$i"):6443 $(cat "$STATE/c$i/token.admin")")
  done
  kubeconfig "$STATE/kubeconfig" c1 "${admins[@]}"
  for ((i = 1; i <= N; i++)); do
    wait_for "kube-apiserver c$i" 60 "$STATE/c$i/logs/kube-apiserver.log" kc "$i" get --raw /readyz
    controllers "$i"
  done
  local k
  for ((i = 1; i <= N; i++)); do
    for ((k = 1; k <= NODES; k++)); do start_node "$i" "$k"; done
  done
  for ((i = 1; i <= N; i++)); do
    for ((k = 1; k <= NODES; k++)); do
      wait_for "node $(node_name "$i" "$k") Ready" 60 "$(node_dir "$i" "$k")/logs/kubelet.log" \
        kc "$i" wait --for=condition=Ready "node/$(node_name "$i" "$k")" --timeout=2s
    done
    sed -e "s/@SERVICE_DNS_IP@/$(svc_ip "$i" 10)/" -e "s#@IMAGE@#docker.io/mcs-clusterset/coredns:$COREDNS_VERSION#" \
      scripts/clusterset/coredns.yaml | kc "$i" apply -f - >/dev/null
  done
  for ((i = 1; i <= N; i++)); do
    wait_for "CoreDNS in c$i" 90 "$STATE/c$i/logs/kubelet.log" \
      kc "$i" -n kube-system rollout status deploy/coredns --timeout=2s ||
      { explain_pods "$i" kube-system; return 1; }
  done
  ((BARE)) || install_chart
  trap - EXIT
  log "up in $((SECONDS - t0))s: $N clusters of $NODES node(s), $IP_FAMILY (contexts c1..c$N); state in $STATE; take down with: bash scripts/clusterset.sh down"
  echo "KUBECONFIG=$STATE/kubeconfig"
}

status() {
  [[ -f $STATE/kubeconfig ]] || { echo "clusterset: not up (no $STATE/kubeconfig)"; return 1; }
  local i rc=0
  for ((i = 1; ; i++)); do
    [[ -d $STATE/c$i ]] || break
    echo "== c$i (API server https://$(node_ip "$i"):6443, netns $(netns "$i"))"
    local name nd
    for name in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy \
      "$STATE/c$i"/node*/pids/{containerd,kubelet,kube-proxy}; do
      nd=$STATE/c$i
      if [[ $name == */pids/* ]]; then
        [[ -f $name ]] || continue
        nd=${name%/pids/*} name=${name##*/}
      fi
      local label=$name
      [[ $nd == "$STATE/c$i" ]] || label="${nd##*/}/$name"
      if kill -0 "$(cat "$nd/pids/$name" 2>/dev/null)" 2>/dev/null; then
        printf '  %-24s running (pid %s)\n' "$label" "$(cat "$nd/pids/$name")"
      else
        printf '  %-24s NOT RUNNING (log %s)\n' "$label" "$nd/logs/$name.log"; rc=1
      fi
    done
    kc "$i" get nodes -o wide 2>&1 | sed 's/^/  /' || rc=1
    kc "$i" get pods -A -o wide 2>&1 | sed 's/^/  /' || rc=1
  done
  echo "KUBECONFIG=$STATE/kubeconfig"
  return "$rc"
}

# restart_component I NAME: a control-plane component of c<I> stopped (TERM, KILL after 15 s)
# and started again with the command line it had; its old log kept beside the new one.
restart_component() {
  local i=$1 name=$2 f="$STATE/c$1/pids/$2" pid
  pid=$(cat "$f" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || die "c$i: $name is not running"
  stop_component "$i" "$name"
  start_component "$i" "$name"
  log "c$i: $name restarted (pid $pid -> $(cat "$f"))"
}

# stop_component I NAME: stops it (SIGTERM, SIGKILL after 15 s) and keeps its command line
# in $STATE/c<I>/stopped/NAME for start_component.
stop_component() {
  local i=$1 name=$2 f="$STATE/c$1/pids/$2" pid
  pid=$(cat "$f" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || die "c$i: $name is not running"
  mkdir -p "$STATE/c$i/stopped"
  cp "/proc/$pid/cmdline" "$STATE/c$i/stopped/$name"
  kill "$pid"
  local deadline=$((SECONDS + 15))
  while kill -0 "$pid" 2>/dev/null; do
    ((SECONDS > deadline)) && { kill -9 "$pid" 2>/dev/null || true; }
    sleep 0.1
  done
  mv "$STATE/c$i/logs/$name.log" "$STATE/c$i/logs/$name.log.$(date +%s)"
}

# start_component I NAME: starts what stop_component stopped, with the same command line
# (an API server: until it is ready).
start_component() {
  local i=$1 name=$2 saved="$STATE/c$1/stopped/$2" args=()
  [[ -f $saved ]] || die "c$i: $name was not stopped by this script (no $saved)"
  mapfile -d '' args <"$saved"
  rm -f "$saved"
  start "$i" "$name" "${args[@]}"
  if [[ $name == kube-apiserver ]]; then
    wait_for "kube-apiserver c$i" 60 "$STATE/c$i/logs/kube-apiserver.log" kc "$i" get --raw /readyz
  fi
}

# N and NODES of the ClusterSet that is up (for the commands after `up`).
shape_from_state() {
  N=$(find "$STATE" -mindepth 1 -maxdepth 1 -type d -name 'c[0-9]' | wc -l)
  NODES=$(awk '$1 == "c1"' "$STATE/nodes" 2>/dev/null | wc -l)
  ((NODES > 0)) || NODES=1
  IP_FAMILY=$(cat "$STATE/ip-family" 2>/dev/null || echo ipv4)
}

cmd=${1:-}; shift || true
while (($#)); do
  case $1 in
    --clusters) N=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --ip-family) IP_FAMILY=$2; shift 2 ;;
    --bare) BARE=1; shift ;;
    --dataplane) DATAPLANE=$2; shift 2 ;;
    --cni) CNI=$2; shift 2 ;;
    --revoke) REVOKE=revoke; shift ;;
    -h|--help) cmd=help; shift ;;
    *.tar) IMPORT=$1; shift ;;
    c[0-9]) TARGET=$1; shift ;;
    etcd|kube-apiserver|kube-controller-manager|kube-scheduler) COMPONENT=$1; shift ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ $N =~ ^[1-9]$ ]] || die "--clusters must be 1..9"
# Four /26 pod ranges per cluster at most (each node's pods come from the cluster's /24).
[[ $NODES =~ ^[1-4]$ ]] || die "--nodes must be 1..4"
case $DATAPLANE in ebpf|userspace|auto) ;; *) die "--dataplane must be ebpf, userspace or auto" ;; esac
case $CNI in ptp|bridge|mixed) ;; *) die "--cni must be ptp, bridge or mixed" ;; esac
case $IP_FAMILY in ipv4|dual) ;; *) die "--ip-family must be ipv4 or dual" ;; esac
case $cmd in
  up) up ;;
  down) down ;;
  status) status ;;
  images) build_images; printf '%s\n' "$IMAGES/pause.tar" "$IMAGES/coredns-$COREDNS_VERSION.tar" "${TOOL_IMAGES[@]}" ;;
  install)
    [[ -f $STATE/kubeconfig ]] || die "not up"
    shape_from_state
    install_chart ;;
  import-image)
    [[ -f $STATE/kubeconfig ]] || die "not up"
    [[ -f ${IMPORT:-} ]] || die "import-image needs an image archive (FILE.oci.tar)"
    shape_from_state
    for ((i = 1; i <= N; i++)); do
      for ((k = 1; k <= NODES; k++)); do ctr_import "$(node_dir "$i" "$k")" "$IMPORT"; done
    done
    log "imported $IMPORT into every node ($N clusters of $NODES node(s))" ;;
  restart)
    [[ -f $STATE/kubeconfig ]] || die "not up"
    [[ -n ${TARGET:-} && -n ${COMPONENT:-} ]] || die "restart needs a cluster (c1, ...) and a component (kube-apiserver, ...)"
    restart_component "${TARGET#c}" "$COMPONENT" ;;
  stop|start)
    [[ -f $STATE/kubeconfig ]] || die "not up"
    [[ -n ${TARGET:-} && -n ${COMPONENT:-} ]] || die "$cmd needs a cluster (c1, ...) and a component (kube-apiserver, ...)"
    "${cmd}_component" "${TARGET#c}" "$COMPONENT"
    if [[ $cmd == stop ]]; then log "c${TARGET#c}: $COMPONENT stopped (start it with: $0 start $TARGET $COMPONENT)"; else log "c${TARGET#c}: $COMPONENT started"; fi ;;
  rotate-tokens)
    [[ -f $STATE/kubeconfig ]] || die "not up"
    shape_from_state
    for ((i = 1; i <= N; i++)); do clusterset_secret "$i" "$REVOKE"; done
    log "new 24 h reader tokens in every controller's Secret (read within about two minutes, no restart)${REVOKE:+; the old ones revoked}" ;;
  help|"") sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' ;;
  *) die "unknown command $cmd (up, down, status, install, import-image, restart, stop, start, rotate-tokens)" ;;
esac
