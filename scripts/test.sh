#!/usr/bin/env bash
# Runs every test of mcs-dataplane, after installing what they need (idempotent, cached in
# ~/.cache/mcs-dataplane). As root on a Debian 12 machine of this kind:
#
#   bash scripts/test.sh
#
# With CI=true, a test whose prerequisite is missing (root, eBPF, kube-apiserver) fails
# instead of skipping.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. scripts/env.sh
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
t0=$(date +%s)
# Every binary the steps after the tests run, built by one command (the same packages each time,
# so the same features: the second build is a no-op instead of a rebuild of shared crates).
BINS=(-p mcs-agent -p mcs-bench -p mcs-controller -p mcs-ctl)
# Free disk where the build goes, at the start and at the end (a full run needs tens of GiB:
# target/, Go's caches, the clusters' nodes; the summary says what was left).
disk_free() { df -h --output=avail . | tail -1 | tr -d ' '; }
echo "disk: $(disk_free) free in $(pwd) before the build"

step "format"
cargo fmt --all -- --check

step "generated CRDs are current"
cargo run --locked -q -p mcs-api --bin crdgen -- --check

step "clippy (-D warnings)"
cargo clippy --locked --all-targets -- -D warnings

step "tests"
set +e
# The userspace tests run on the io_uring TCP workers here (the agent's default where the kernel
# allows it; set explicitly so that a fallback to epoll fails them), and again on epoll below.
MCS_TEST_TCP_ENGINE=io-uring cargo test --locked --no-fail-fast 2>&1 | tee "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
status=${PIPESTATUS[0]}
set -e

step "userspace forwarder tests again, on the epoll TCP workers (--tcp-engine epoll, the fallback)"
set +e
MCS_TEST_TCP_ENGINE=epoll cargo test --locked --no-fail-fast -p mcs-agent --test userspace 2>&1 | tee -a "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
epoll=${PIPESTATUS[0]}
set -e
if ((epoll == 0)); then echo "epoll forwarder tests: ok"; else echo "epoll forwarder tests: FAILED"; status=1; fi

step "userspace forwarder tests again, the client pod behind a Linux bridge with br_netfilter on"
set +e
MCS_TEST_CLIENT_NET=bridge-nf MCS_TEST_TCP_ENGINE=io-uring cargo test --locked --no-fail-fast -p mcs-agent --test userspace 2>&1 | tee -a "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
bridged=${PIPESTATUS[0]}
set -e
if ((bridged == 0)); then echo "bridged (br_netfilter) forwarder tests: ok"; else echo "bridged (br_netfilter) forwarder tests: FAILED"; status=1; fi

step "benchmark harness, smoke mode (proves every mode and workload runs; no speed asserted)"
set +e
cargo build --locked -q "${BINS[@]}" --bins &&
  target/debug/mcs-bench --smoke --no-install --out target/mcs-bench-smoke >target/mcs-bench-smoke.md
smoke=$?
set -e
if ((smoke == 0)); then cat target/mcs-bench-smoke.md; echo "harness smoke: ok"; else echo "harness smoke: FAILED"; status=1; fi

step "control-plane bench, smoke size (20 imports against a real API server and the real agent binary; proves it runs, asserts no speed)"
set +e
MCS_BENCH_IMPORTS=20 MCS_BENCH_SAMPLES=5 cargo test --locked -q -p mcs-bench --bench control_plane
cp=$?
set -e
if ((cp == 0)); then echo "control-plane bench smoke: ok"; else echo "control-plane bench smoke: FAILED"; status=1; fi

step "agent memory bench, smoke size (200 imports from files; the real agent with each dataplane, in a netns / cgroup of its own; asserts no size)"
set +e
MCS_BENCH_IMPORTS=200 cargo test --locked -q -p mcs-bench --bench agent_memory
am=$?
set -e
if ((am == 0)); then echo "agent memory bench smoke: ok"; else echo "agent memory bench smoke: FAILED"; status=1; fi

step "fault suite, smoke mode (3 s per scenario; asserts no cut reply and that load was served, not speed)"
set +e
target/debug/mcs-bench faults --smoke --out target/mcs-bench-smoke
faults=$?
set -e
if ((faults == 0)); then echo "fault suite smoke: ok"; else echo "fault suite smoke: FAILED"; status=1; fi

step "DNS bench, smoke mode (10 names, 1 s each against the agent and CoreDNS; asserts right answers and none lost at a capped rate, not speed)"
set +e
target/debug/mcs-bench dns --smoke --out target/mcs-bench-smoke
dns=$?
set -e
if ((dns == 0)); then echo "DNS bench smoke: ok"; else echo "DNS bench smoke: FAILED"; status=1; fi

step "real ClusterSet: two dual-stack clusters of two nodes with kubelets (scripts/clusterset.sh up: our image, our chart, CoreDNS), end to end on real pods, kubectl mcs status/explain, the lifecycle suite under load, the whole upstream conformance suite, helm uninstall, down"
set +e
# Whatever happens below (a failure, a timeout's TERM), the clusters go.
trap 'bash scripts/clusterset-monitoring.sh stop >/dev/null 2>&1 || true; bash scripts/clusterset.sh down >/dev/null 2>&1 || true' EXIT
# c1 with routed pods (ptp), c2 with pods on a Linux bridge and br_netfilter on (kubeadm's
# settings): the e2e crosses both node networks, in both families (--ip-family dual). Our image from the debug binaries built above,
# by the release image's pipeline (deploy/image.sh,
# which also runs them inside the image), imported into every node.
cargo build --locked -q "${BINS[@]}" --bins &&
  MCS_IMAGE_BIN_DIR=target/debug bash scripts/clusterset.sh up --cni mixed --nodes 2 --ip-family dual >target/clusterset-up.out
up=$?
# Bringing up two clusters on two shared cores once failed in CI with the controller's pods left
# Pending and no reason kept (before up explained its failed waits). One second attempt, said
# out loud here and in the summary; the tests below run once, as always.
up_note=""
if ((up != 0)); then
  echo "clusterset up: failed once (its explanation is above); taking it down and trying once more"
  up_note="clusterset up needed a second attempt (the first one's explanation is in the log)"
  MCS_IMAGE_BIN_DIR=target/debug bash scripts/clusterset.sh up --cni mixed --nodes 2 --ip-family dual >target/clusterset-up.out
  up=$?
fi
if ((up == 0)); then
  echo "clusterset up: ok ($(tail -1 target/clusterset-up.out))"
  # A real Prometheus scrapes every agent and controller while the e2e runs (eBPF, userspace,
  # DNS, exports); then every query of the chart's dashboard must return data and every alert
  # expression be accepted.
  bash scripts/clusterset-monitoring.sh start
  monitoring=$?
  bash scripts/clusterset-e2e.sh
  e2e=$?
  if ((e2e == 0)); then echo "clusterset end to end: ok"; else echo "clusterset end to end: FAILED"; status=1; fi
  ((monitoring == 0)) && { bash scripts/clusterset-monitoring.sh check; monitoring=$?; }
  bash scripts/clusterset-monitoring.sh stop >/dev/null 2>&1
  if ((monitoring == 0)); then echo "clusterset monitoring (dashboard queries, alert expressions): ok"; else echo "clusterset monitoring (dashboard queries, alert expressions): FAILED"; status=1; fi
  # The operator's CLI: `kubectl mcs status` healthy (also with only the chart's operator
  # roles), `explain` on a fine, a conflicting and a rejected service, then c2's API server
  # stopped (status names it, exit 1) and started again.
  bash scripts/clusterset-operate.sh
  operate=$?
  if ((operate == 0)); then echo "clusterset kubectl mcs status/explain: ok"; else echo "clusterset kubectl mcs status/explain: FAILED"; status=1; fi
  # Export → first connection from a pod, at a smoke size (proves it runs; asserts no speed).
  bash scripts/clusterset-latency.sh --others 100 --samples 5
  latency=$?
  if ((latency == 0)); then echo "clusterset export latency (smoke): ok"; else echo "clusterset export latency (smoke): FAILED"; status=1; fi
  # Day 2 under load (upgrade, rollback, agents deleted, dataplane switch, drain + kill, then a
  # 2-minute soak: export churn, endpoints flapping, c2's API server restarted): the 0-failure
  # steps and the soak's RSS bound gate, the rest are measured; the chart is put back on eBPF
  # at its release.
  bash scripts/clusterset-lifecycle.sh --soak 2
  lifecycle=$?
  if ((lifecycle == 0)); then echo "clusterset lifecycle under load: ok"; else echo "clusterset lifecycle under load: FAILED"; status=1; fi
  # Every test runs; the Required ones must pass (MCS_CONFORMANCE_GATE), the rest are reported.
  MCS_CONFORMANCE_MODE=real bash scripts/conformance.sh
  conformance=$?
  if ((conformance == 0)); then echo "conformance: ok"; else echo "conformance: FAILED"; status=1; fi
  # Last (it removes the chart): helm uninstall leaves no program, pin, table or rule on a node.
  bash scripts/clusterset-uninstall.sh
  uninstall=$?
  if ((uninstall == 0)); then echo "clusterset helm uninstall (nodes clean): ok"; else echo "clusterset helm uninstall (nodes clean): FAILED"; status=1; fi
else
  echo "clusterset up: FAILED"; status=1
fi
bash scripts/clusterset.sh down
down=$?
trap - EXIT
if ((down == 0)); then echo "clusterset down: ok"; else echo "clusterset down: FAILED (left something behind)"; status=1; fi
set -e

step "summary"
# One closing line over all test binaries.
awk '/^test result:/ { for (i=1;i<=NF;i++) { if ($(i+1) ~ /^passed;?$/) p+=$i; if ($(i+1) ~ /^failed;?$/) f+=$i; if ($(i+1) ~ /^ignored;?$/) ig+=$i } }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, ig }' "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
grep -E 'Passed \| ' target/conformance/suite.log 2>/dev/null | sed 's/^/conformance: /' || true
cat target/conformance/summary.txt 2>/dev/null || true
[[ -z ${up_note:-} ]] || echo "note: $up_note"
echo "disk: $(disk_free) free at the end (target/ $(du -sh target 2>/dev/null | cut -f1))"
echo "total wall time: $(( $(date +%s) - t0 ))s (after set-up)"
exit "$status"
