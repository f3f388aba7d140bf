#!/usr/bin/env bash
# `helm uninstall` on the real ClusterSet, then every node must be clean: no program of ours
# attached to the kubelet's cgroup, no pins, no nftables table, no policy rule or route of
# ours (checked with bpftool, nft and ip inside each node's network namespace). A restart
# keeps the pinned eBPF programs on purpose (traffic survives it); an uninstall is told
# apart by the agent watching its own DaemonSet (mcs_sync::owner), so it must leave nothing.
#
# Run last, after the suites that share the ClusterSet (it removes the chart), before
# `scripts/clusterset.sh down`. Usage: bash scripts/clusterset-uninstall.sh
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
need_clusterset uninstall
[[ $EUID -eq 0 ]] || { echo "uninstall: needs root (bpftool, nft and ip in the nodes' namespaces)" >&2; exit 1; }

failures=0
# The agents' logs of this run (kept for a look; `clusterset.sh down` removes them).
LOGS="$STATE/uninstall-$(date +%s)"
mkdir -p "$LOGS"
say() { printf '\033[1muninstall:\033[0m %s\n' "$*"; }
fail() { printf 'uninstall: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }

# What of ours the nodes of cluster $1 hold, one word each ("" when clean).
leftovers() {
  local c=$1 node ns ip pods cg pins left=""
  # Each tool's output is captured before it is matched: with pipefail, `grep -q` leaving
  # early would fail the writer (SIGPIPE) and a match would read as none.
  local out
  local fam
  while read -r _ node ns ip pods cg pins _; do
    [[ -n $(find "$pins" -mindepth 1 2>/dev/null) ]] && left+=" $node:pins($pins)"
    out=$(bpftool cgroup tree "$cg" 2>/dev/null || true)
    grep -q ' mcs_' <<<"$out" && left+=" $node:programs(on $cg)"
    ip netns exec "$ns" nft list table inet mcs_dataplane >/dev/null 2>&1 && left+=" $node:nft(inet mcs_dataplane)"
    for fam in -4 -6; do
      out=$(ip "$fam" -n "$ns" rule 2>/dev/null || true)
      grep -q 'fwmark 0x4d43' <<<"$out" && left+=" $node:rule($fam fwmark 0x4d43)"
      out=$(ip "$fam" -n "$ns" route show table 0x4d43 2>/dev/null || true)
      [[ -n $out ]] && left+=" $node:routes($fam table 0x4d43)"
    done
  done < <(cs_nodes "$c")
  echo "$left"
}

clusters=$(kubectl config get-contexts -o name | grep -E '^c[0-9]+$' | sort -V)
for c in $clusters; do
  before=$(leftovers "$c")
  # The suites end on the eBPF dataplane: its programs are attached and pinned now, on every node.
  while read -r _ node _; do
    [[ $before == *" $node:programs"* && $before == *" $node:pins"* ]] ||
      fail "$c: before the uninstall, expected the eBPF programs attached and pinned on $node; found:${before:- nothing}"
  done < <(cs_nodes "$c")
  # Follow the agents' logs to their end: their last words say what they removed.
  for pod in $(kc "$c" -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent -o name); do
    kc "$c" -n mcs-system logs -f "$pod" >"$LOGS/$c-${pod#pod/}.log" 2>&1 &
  done
  say "$c: installed:$before; helm uninstall"
  helm --kube-context "$c" uninstall mcs-dataplane --wait --timeout 120s >/dev/null ||
    fail "$c: helm uninstall failed"
done
# The log followers end with their containers (bounded by the pods' wait below).
trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT
for c in $clusters; do
  # The agents stop when the garbage collector deletes their pods (after the DaemonSet).
  deadline=$((SECONDS + 120))
  while [[ -n $(kc "$c" -n mcs-system get pods -l app.kubernetes.io/name=mcs-agent -o name 2>/dev/null) ]]; do
    ((SECONDS > deadline)) && { fail "$c: agent pods still there 120 s after the uninstall"; break; }
    sleep 0.5
  done
  # A stopping agent removes its pins as it exits; poll (bounded) for the last of it.
  deadline=$((SECONDS + 30))
  left=$(leftovers "$c")
  while [[ -n $left ]] && ((SECONDS <= deadline)); do
    sleep 0.5
    left=$(leftovers "$c")
  done
  wait_logs=$((SECONDS + 10))
  while [[ -n $(jobs -rp) ]] && ((SECONDS <= wait_logs)); do sleep 0.2; done
  if [[ -n $left ]]; then
    fail "$c: left behind after helm uninstall:$left (agent logs: $LOGS/$c-*.log)"
  else
    say "$c: every node clean ($(cs_nodes "$c" | awk '{print $2}' | tr '\n' ' ')): no program attached, no pins, no nftables table, no rule or route of ours"
  fi
  # And it was the agent that removed them, on seeing its DaemonSet deleted.
  for f in "$LOGS/$c"-*.log; do
    grep -q "uninstall: the agent's DaemonSet is deleted" "$f" ||
      fail "$c: the agent did not log its uninstall ($f: $(tail -3 "$f" | tr '\n' ' '))"
  done
  # What stays, by Helm's rules: the CRDs (chart crds/) and the objects of them.
  crds=$(kc "$c" get crd -o name 2>/dev/null | grep -c 'multicluster.x-k8s.io' || true)
  say "$c: CRDs kept by Helm: $crds (ServiceImports stay until deleted; docs/install.md)"
done
if ((failures > 0)); then
  echo "uninstall: $failures failure(s)" >&2
  exit 1
fi
say "every node clean after helm uninstall"
