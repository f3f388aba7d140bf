#!/usr/bin/env bash
# The chart's monitoring checked on the real ClusterSet of scripts/clusterset.sh: a real
# Prometheus (Debian's) scrapes every agent and controller of every cluster, found as the
# chart's ServiceMonitors would find them (their pods in mcs-system, listed every 5 s into a
# file_sd file: Debian builds Prometheus without Kubernetes discovery), while the suites run; then every query of the Grafana dashboard
# (deploy/helm/mcs-dataplane/monitoring/dashboard.json) must return data over that time, and
# every alert expression (monitoring/alerts.yaml) must be accepted by it.
#
#   bash scripts/clusterset-monitoring.sh start   # before the suites (CI: before the e2e)
#   bash scripts/clusterset-monitoring.sh check   # after them: a table, non-zero on a failure
#   bash scripts/clusterset-monitoring.sh stop    # Prometheus stopped, its files removed
#
# Prometheus runs in c1's first node's network namespace (it reaches every node and pod there)
# and listens on 127.0.0.1:19090 of that namespace only, scraping every 5 s.
set -euo pipefail
# shellcheck source=scripts/clusterset-lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/clusterset-lib.sh"
need_clusterset monitoring
DIR="$STATE/monitoring"
NETNS=mcs-cs-c1
PORT=19090
CHART=deploy/helm/mcs-dataplane

say() { printf '\033[1mmonitoring:\033[0m %s\n' "$*"; }
fail() { printf 'monitoring: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }
failures=0
api() { ip netns exec "$NETNS" curl -sf --max-time 20 "http://127.0.0.1:$PORT/api/v1/$1" "${@:2}"; }

# The scrape targets of every cluster's running agent and controller pods, as the chart's
# ServiceMonitors would find them (Debian's Prometheus has no Kubernetes discovery): a file_sd
# file, written whole and renamed, so Prometheus never reads half of one.
write_targets() {
  local c json="["
  for c in $(kubectl config get-contexts -o name | grep -E '^c[0-9]+$' | sort -V); do
    json+=$(kc "$c" -n mcs-system get pods -o json | python3 -c '
import json, sys
c = sys.argv[1]
out = []
for p in json.load(sys.stdin)["items"]:
    name = p["metadata"]["labels"].get("app.kubernetes.io/name")
    ip = p.get("status", {}).get("podIP")
    gone = p["metadata"].get("deletionTimestamp")
    if name not in ("mcs-agent", "mcs-controller") or p["status"].get("phase") != "Running" or not ip or gone:
        continue
    port = 9464 if name == "mcs-agent" else 9465
    out.append({"targets": [f"{ip}:{port}"], "labels": {"cluster_id": c, "component": name,
                "pod": p["metadata"]["name"], "node": p["spec"].get("nodeName", "")}})
print(",".join(json.dumps(o) for o in out) + ("," if out else ""))' "$c")
  done
  json="${json%,}]"
  printf '%s\n' "$json" >"$DIR/targets.json.tmp" && mv "$DIR/targets.json.tmp" "$DIR/targets.json"
}

start() {
  command -v prometheus >/dev/null || { echo "monitoring: prometheus not found (bash scripts/setup.sh installs Debian's)" >&2; exit 1; }
  stop_prometheus
  mkdir -p "$DIR/data"
  write_targets
  cat >"$DIR/prometheus.yml" <<EOF
global: {evaluation_interval: 15s}
scrape_configs:
- job_name: mcs-dataplane
  scrape_interval: 5s
  file_sd_configs:
  - files: [$DIR/targets.json]
    refresh_interval: 5s
EOF
  local out
  out=$(promtool check config "$DIR/prometheus.yml" 2>&1) || { echo "$out" >&2; exit 1; }
  setsid ip netns exec "$NETNS" prometheus --config.file "$DIR/prometheus.yml" \
    --storage.tsdb.path "$DIR/data" --web.listen-address "127.0.0.1:$PORT" \
    --storage.tsdb.retention.time 1d --log.level warn >"$DIR/prometheus.log" 2>&1 </dev/null &
  echo $! >"$DIR/pid"
  # Pods come and go (the e2e deletes an agent, switches the dataplane, restarts the
  # controllers): the targets follow, from a loop in a session of its own.
  setsid bash "$0" refresh-loop >/dev/null 2>&1 </dev/null &
  echo $! >"$DIR/refresher.pid"
  date +%s >"$DIR/started"
  local deadline=$((SECONDS + 60))
  until api query --data-urlencode 'query=count(up == 1)' 2>/dev/null | grep -q '"value"'; do
    if ((SECONDS > deadline)); then
      tail -20 "$DIR/prometheus.log" >&2
      echo "monitoring: Prometheus scraped nothing within 60 s" >&2
      exit 1
    fi
    sleep 1
  done
  say "Prometheus (pid $(cat "$DIR/pid")) scrapes every agent and controller, every 5 s: $(api query --data-urlencode 'query=count(up == 1)' | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"]["result"][0]["value"][1])') targets up"
}

stop_prometheus() {
  local pid
  pid=$(cat "$DIR/refresher.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
  rm -f "$DIR/refresher.pid"
  pid=$(cat "$DIR/pid" 2>/dev/null) || return 0
  if kill "$pid" 2>/dev/null; then
    local deadline=$((SECONDS + 15))
    while kill -0 "$pid" 2>/dev/null; do
      ((SECONDS > deadline)) && { kill -9 "$pid" 2>/dev/null || true; }
      sleep 0.2
    done
  fi
  rm -f "$DIR/pid"
}

check() {
  [[ -f $DIR/pid ]] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null || { echo "monitoring: not started (bash scripts/clusterset-monitoring.sh start)" >&2; exit 1; }
  local from now
  from=$(cat "$DIR/started"); now=$(date +%s)
  kill -0 "$(cat "$DIR/refresher.pid" 2>/dev/null)" 2>/dev/null ||
    say "the target refresher had stopped (its log: $(tail -3 "$DIR/refresher.log" 2>/dev/null | tr '\n' ' ')); refreshing now"
  # Every agent and controller running now is scraped and up (a target whose pod is gone
  # goes from the file within a refresh and a scrape).
  write_targets
  local down="" deadline=$((SECONDS + 30))
  while :; do
    down=$(api query --data-urlencode 'query=up == 0' | python3 -c 'import json,sys; print(" ".join(r["metric"].get("pod","?") for r in json.load(sys.stdin)["data"]["result"]))')
    [[ -z $down ]] || ((SECONDS > deadline)) && break
    sleep 2
  done
  [[ -z $down ]] || fail "targets of running pods down: $down"
  # The dashboard's queries over the time since start, and the alerts' expressions now.
  python3 - "$CHART/monitoring/dashboard.json" "$CHART/monitoring/alerts.yaml" "$from" "$now" "$NETNS" "$PORT" <<'PYEOF' || failures=$((failures + 1))
import json, subprocess, sys, urllib.parse
dash, alerts, start, end, netns, port = sys.argv[1:]
def api(path, **params):
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    out = subprocess.run(["ip", "netns", "exec", netns, "curl", "-s", "--max-time", "30", url],
                         capture_output=True, text=True)
    return json.loads(out.stdout)
bad = 0
panels = [p for p in json.load(open(dash))["panels"] if p.get("targets")]
print(f"| panel | query | series | samples |")
print(f"|---|---|---|---|")
for p in panels:
    for t in p["targets"]:
        r = api("query_range", query=t["expr"], start=start, end=end, step="15")
        if r.get("status") != "success":
            print(f"| {p['title']} | `{t['expr']}` | error: {r.get('error')} | |"); bad += 1; continue
        series = r["data"]["result"]
        samples = sum(len(s["values"]) for s in series)
        print(f"| {p['title']} | `{t['expr']}` | {len(series)} | {samples} |")
        if samples == 0:
            bad += 1
# The alert expressions: valid PromQL over these series (the rule file is parsed by a tiny
# reader of its `expr:` lines: one line each).
exprs = [l.split("expr:", 1)[1].strip() for l in open(alerts) if l.strip().startswith("expr:")]
for e in exprs:
    r = api("query", query=e, time=end)
    if r.get("status") != "success":
        print(f"alert expression refused: `{e}`: {r.get('error')}"); bad += 1
print(f"{len(panels)} panels, {len(exprs)} alert expressions; {bad} without data or refused")
sys.exit(1 if bad else 0)
PYEOF
  if ((failures)); then
    echo "monitoring: $failures check(s) failed (Prometheus's log: $DIR/prometheus.log)" >&2
    exit 1
  fi
  say "every dashboard query returned data from the real ClusterSet; every alert expression is accepted"
}

# The loop behind `start` (its own session): the targets every 5 s while Prometheus runs.
refresh_loop() {
  set +e
  while kill -0 "$(cat "$DIR/pid" 2>/dev/null)" 2>/dev/null; do
    write_targets 2>>"$DIR/refresher.log" || echo "$(date +%T) write_targets failed" >>"$DIR/refresher.log"
    sleep 5
  done
}

case ${1:-} in
  start) start ;;
  refresh-loop) refresh_loop ;;
  check) check ;;
  stop) stop_prometheus; rm -rf "$DIR"; say "stopped" ;;
  *) echo "usage: $0 start|check|stop" >&2; exit 2 ;;
esac
