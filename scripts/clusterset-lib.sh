# Sourced (not run) by the scripts that use a running ClusterSet (clusterset-e2e.sh,
# clusterset-latency.sh, clusterset-uninstall.sh): the repository root as working directory,
# the tools' environment, the ClusterSet's state directory and kubeconfig, `kc CONTEXT ARGS…`,
# `need_clusterset NAME` (exits with NAME's message when none is up), `cs_nodes [CLUSTER]`,
# `until_ok SECONDS DESCRIPTION CMD...` (which calls the sourcing script's `fail`),
# `controller_metric CLUSTER SERIES` and `rss_sample`.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=scripts/env.sh
. scripts/env.sh
STATE="${MCS_CLUSTERSET_DIR:-/var/lib/mcs-clusterset}"
export KUBECONFIG="$STATE/kubeconfig"
kc() { local c=$1; shift; kubectl --context "$c" "$@"; }
need_clusterset() {
  [[ -f $KUBECONFIG ]] || { echo "$1: no clusterset (bash scripts/clusterset.sh up)" >&2; exit 1; }
}
# The ClusterSet's nodes (of CLUSTER, or all), one line each as scripts/clusterset.sh wrote
# them: cluster, node name, netns, address, pod range, kubelet cgroup (cgroup2), the agent's
# pin directory, IPv6 address (- unless `up --ip-family dual`). The first line of a cluster is
# its first node (the control plane's). $STATE/ip-family says ipv4 or dual.
cs_nodes() { awk -v c="${1:-}" 'c == "" || $1 == c' "$STATE/nodes"; }
# Polls CMD (quietly) every 0.5 s until it succeeds; after SECONDS, `fail DESCRIPTION` (the
# sourcing script's: it counts and goes on, or exits) and returns 1.
until_ok() {
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS > deadline)) && { fail "$what (not within ${secs}s)"; return 1; }
    sleep 0.5
  done
}
# SERIES's value at CLUSTER's leading controller (its /metrics through the API server's proxy).
controller_metric() {
  local p
  for p in $(kc "$1" -n mcs-system get pods -l app.kubernetes.io/name=mcs-controller -o jsonpath='{.items[*].metadata.name}'); do
    kc "$1" get --raw "/api/v1/namespaces/mcs-system/pods/$p:9465/proxy/metrics" 2>/dev/null |
      awk -v s="$2" '$1 == "mcs_controller_leader" && $2 == 1 { lead = 1 } $1 == s { v = $2 } END { if (lead) print v }'
  done | head -1
}
# The RSS (KiB) of every agent and controller process on this machine (the nodes share it):
# "<cluster>/<node>/<agent|controller>/<pid> <rss>" per line, the node from its cgroup path.
rss_sample() {
  local pid what where rss
  for pid in $(pgrep -f -- '(^|/)mcs-(agent|controller) run' || true); do
    case $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) in
      *mcs-agent\ run*) what=agent ;;
      *mcs-controller\ run*) what=controller ;;
      *) continue ;;
    esac
    where=$(awk 'match($0, /mcs-c[0-9]+\/c[0-9]+-node[0-9]*/) {print substr($0, RSTART + 4, RLENGTH - 4); exit}' "/proc/$pid/cgroup" 2>/dev/null || true)
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [[ -n $where && -n $rss ]] && echo "$where/$what/$pid $rss"
  done
}
