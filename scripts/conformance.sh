#!/usr/bin/env bash
# The upstream MCS conformance suite (../shared/conformance/mcs-api, kubernetes-sigs/mcs-api
# conformance/, unchanged) against mcs-dataplane, in one of two modes (it says which):
#
#   real     the ClusterSet of scripts/clusterset.sh, when it is up: real kubelets and pods,
#            our image installed by our chart (agents and controllers in the clusters), CoreDNS
#            with our clusterset.local block. Every test runs (default label filter: none).
#   testbed  otherwise: two clusters from `mcs-testbed` (etcd + kube-apiserver +
#            kube-controller-manager each, our CRDs; no kubelet: Pending pods are bound and
#            reported Running and Ready with an address, so Services get real EndpointSlices)
#            and `mcs-controller` run here for each. Pods do not run, so only the Required
#            tests are meaningful (default label filter: Required).
#
# Both build the suite from a copy (go test -c; the original is never touched) and run it with
# -contexts c1,c2.
#
# Reports: target/conformance/report.yaml (the suite's), junit.xml, suite.log, and the
# controllers' and testbed's logs, and summary.txt (passed/run per label). Exits 0 when every
# test of the gating label passed. Everything it starts is
# stopped on exit, also on failure or Ctrl-C.
#
# Env: MCS_CONFORMANCE_MODE (auto, real or testbed; default auto: real when the clusterset is
#      up), MCS_CONFORMANCE_LABELS (ginkgo label filter; default: none in real mode, Required
#      in testbed mode), MCS_CONFORMANCE_GATE (the label whose every test must pass for exit 0;
#      default Required; "all" for every test that ran), MCS_CLUSTERSET_DIR (as
#      scripts/clusterset.sh),
#      MCS_CONFORMANCE_SUITE (suite directory; default ../shared/conformance/mcs-api beside the
#      checkout, else /work/shared/conformance/mcs-api), MCS_CONFORMANCE_ORGANIZATION,
#      _PROJECT, _VERSION, _URL (the report's implementation fields; defaults: mcs-dataplane,
#      mcs-dataplane, the workspace version + the commit, the workspace's repository URL).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# shellcheck source=/dev/null
. scripts/env.sh
# The suite: $MCS_CONFORMANCE_SUITE, else ../shared beside this checkout, else the machine's
# /work/shared (a clone elsewhere on a machine of this kind).
suite=${MCS_CONFORMANCE_SUITE:-}
if [[ -z $suite ]]; then
    for d in "$root/../shared/conformance/mcs-api" /work/shared/conformance/mcs-api; do
        if [[ -f $d/go.mod ]]; then suite=$d; break; fi
    done
fi
out=$root/target/conformance
mkdir -p "$out"
mode=${MCS_CONFORMANCE_MODE:-auto}
clusterset_kubeconfig="${MCS_CLUSTERSET_DIR:-/var/lib/mcs-clusterset}/kubeconfig"
if [[ $mode == auto ]]; then
    mode=testbed
    if [[ -f $clusterset_kubeconfig ]] &&
        kubectl --kubeconfig "$clusterset_kubeconfig" --context c1 get --raw /readyz >/dev/null 2>&1 &&
        kubectl --kubeconfig "$clusterset_kubeconfig" --context c2 get --raw /readyz >/dev/null 2>&1; then
        mode=real
    fi
fi
case $mode in
    real) labels=${MCS_CONFORMANCE_LABELS-}
          echo "conformance: mode real: the ClusterSet of scripts/clusterset.sh ($clusterset_kubeconfig): kubelets, pods, our chart" ;;
    testbed) labels=${MCS_CONFORMANCE_LABELS-Required}
          echo "conformance: mode testbed: mcs-testbed API servers, no kubelets (pods do not run), mcs-controller here" ;;
    *) echo "conformance: MCS_CONFORMANCE_MODE must be auto, real or testbed" >&2; exit 1 ;;
esac
echo "mode: $mode" >"$out/mode"

if [[ -z $suite || ! -f $suite/go.mod ]]; then
    echo "conformance: the upstream suite is not at ../shared/conformance/mcs-api or /work/shared/conformance/mcs-api (set MCS_CONFORMANCE_SUITE)" >&2
    exit 1
fi
echo "conformance: suite from $suite"
command -v go >/dev/null || { echo "conformance: go not found" >&2; exit 1; }

echo "conformance: building the suite (go test -c, from a copy of $suite)"
rm -rf "$out/src"
cp -r "$suite" "$out/src"
chmod -R u+w "$out/src"
(cd "$out/src" && go test -c -o "$out/conformance.test" .)

if [[ $mode == real ]]; then
    kubeconfig=$clusterset_kubeconfig
else
echo "conformance: building mcs-controller and mcs-testbed"
cargo build -q -p mcs-controller --bin mcs-controller
cargo build -q -p mcs-test-support --bin mcs-testbed

pids=()
fifo=$(mktemp -u "${TMPDIR:-/tmp}/mcs-conformance.XXXXXX")
mkfifo "$fifo"
cleanup() {
    local rc=$?
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    # Closing the testbed's stdin stops it; it stops the API servers and removes their data.
    exec 3>&- 2>/dev/null || true
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -f "$fifo"
    exit "$rc"
}
trap cleanup EXIT INT TERM

kubeconfig=$out/clusterset.kubeconfig
rm -f "$kubeconfig" "$out/testbed.out"
target/debug/mcs-testbed --clusters c1,c2 --kubeconfig-out "$kubeconfig" --pods-running \
    <"$fifo" >"$out/testbed.out" 2>"$out/testbed.log" &
pids+=($!)
exec 3>"$fifo"
deadline=$((SECONDS + 120))
until grep -q '^KUBECONFIG=' "$out/testbed.out" 2>/dev/null; do
    if ((SECONDS > deadline)) || ! kill -0 "${pids[0]}" 2>/dev/null; then
        echo "conformance: the clusters did not come up; testbed log:" >&2
        tail -30 "$out/testbed.log" >&2
        exit 1
    fi
    sleep 0.2
done
echo "conformance: clusters c1, c2 up ($kubeconfig)"

for c in c1 c2; do
    MCS_LOG=info target/debug/mcs-controller run --cluster-id "$c" \
        --clusterset-kubeconfig "$kubeconfig" \
        --clusterset-ip-cidr 198.18.100.0/24 --clusterset-ip-cidr 2001:2::100:0/112 \
        --metrics-addr 127.0.0.1:0 --lease-namespace default \
        --watch-retry-max-ms 1000 >"$out/controller-$c.log" 2>&1 &
    pids+=($!)
done
deadline=$((SECONDS + 60))
for c in c1 c2; do
    until grep -q 'first pass written as leader' "$out/controller-$c.log"; do
        if ((SECONDS > deadline)); then
            echo "conformance: mcs-controller in $c did not become ready; its log:" >&2
            tail -30 "$out/controller-$c.log" >&2
            exit 1
        fi
        sleep 0.2
    done
done
echo "conformance: mcs-controller ready in c1 and c2"
fi

# The implementation fields of the report (the conformance report program's report.yaml).
workspace_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
report_organization=${MCS_CONFORMANCE_ORGANIZATION:-mcs-dataplane}
report_project=${MCS_CONFORMANCE_PROJECT:-mcs-dataplane}
report_version=${MCS_CONFORMANCE_VERSION:-$workspace_version+g$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
report_url=${MCS_CONFORMANCE_URL:-$(sed -n 's/^repository = "\(.*\)"$/\1/p' Cargo.toml | head -1)}
echo "conformance: report for $report_organization/$report_project $report_version ($report_url)"
echo "conformance: running the suite (label filter: ${labels:-none, every test})"
set +e
(cd "$out" && ./conformance.test -test.v -test.timeout 60m \
    -kubeconfig "$kubeconfig" -contexts c1,c2 \
    -organization "$report_organization" -project "$report_project" \
    -version "$report_version" -url "$report_url" \
    ${labels:+-ginkgo.label-filter="$labels"} -ginkgo.junit-report="$out/junit.xml" \
    -ginkgo.no-color) >"$out/suite.log" 2>&1
rc=$?
set -e
grep -E '^(Ran|PASS|FAIL|ok|--- )' "$out/suite.log" | tail -5 || true
if [[ -f $out/report.yaml ]]; then
    echo "conformance: report in $out/report.yaml, JUnit in $out/junit.xml"
fi
if ((rc != 0)); then
    echo "conformance: failures:" >&2
    grep -E '^\s*\[FAIL\]' "$out/suite.log" | sort -u >&2 || true
fi
# Passed/run per label, from the JUnit report; the exit status is whether every test with the
# gating label passed (MCS_CONFORMANCE_GATE, default Required; "all": every test that ran).
gate=${MCS_CONFORMANCE_GATE:-Required}
[[ -f $out/junit.xml ]] || { echo "conformance: no JUnit report (the suite did not run)" >&2; exit 1; }
python3 - "$out/junit.xml" "$gate" "$mode" <<'PY' | tee "$out/summary.txt"
import re, sys, xml.etree.ElementTree as ET
path, gate, mode = sys.argv[1:4]
per = {}
gate_failed = 0
for tc in ET.parse(path).iter("testcase"):
    if tc.find("skipped") is not None:
        continue
    name = tc.get("name", "")
    ok = tc.find("failure") is None and tc.find("error") is None
    if re.match(r"\[(Synchronized|Report)?(Before|After)Suite\]", name):
        # Set-up and tear-down: not a test, but their failure fails the run.
        gate_failed += 0 if ok else 1
        continue
    m = re.search(r"\[([A-Za-z, ]+)\]\s*$", name)
    labels = [l.strip() for l in m.group(1).split(",")] if m else []
    for l in labels or ["(none)"]:
        p, n = per.get(l, (0, 0))
        per[l] = (p + ok, n + 1)
    if not ok and (gate == "all" or gate in labels):
        gate_failed += 1
print(f"conformance ({mode} mode): " + ", ".join(f"{l} {p}/{n}" for l, (p, n) in sorted(per.items())))
print(f"conformance gate ({gate}): {'passed' if gate_failed == 0 else f'{gate_failed} failed'}")
sys.exit(1 if gate_failed else 0)
PY
