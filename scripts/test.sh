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

step "format"
cargo fmt --all -- --check

step "generated CRDs are current"
cargo run --locked -q -p mcs-api --bin crdgen -- --check

step "clippy (-D warnings)"
cargo clippy --locked --all-targets -- -D warnings

step "tests"
set +e
cargo test --locked --no-fail-fast 2>&1 | tee "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
status=${PIPESTATUS[0]}
set -e

step "benchmark harness, smoke mode (proves every mode and workload runs; no speed asserted)"
set +e
cargo build --locked -q -p mcs-agent -p mcs-bench --bins &&
  target/debug/mcs-bench --smoke --no-install --out target/mcs-bench-smoke >target/mcs-bench-smoke.md
smoke=$?
set -e
if ((smoke == 0)); then cat target/mcs-bench-smoke.md; echo "harness smoke: ok"; else echo "harness smoke: FAILED"; status=1; fi

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

step "image: deploy/image.sh builds the OCI archive (Debian rootfs + our binaries) and runs them inside it"
set +e
# The debug binaries built above: the same pipeline as the release image (bash deploy/image.sh),
# without a second, release build in CI.
MCS_IMAGE_BIN_DIR=target/debug MCS_IMAGE_OUT=target/image-check bash deploy/image.sh
image=$?
set -e
if ((image == 0)); then echo "image: ok"; else echo "image: FAILED"; status=1; fi

step "upstream MCS conformance suite (Required tests; two clusters, our controller in each)"
set +e
bash scripts/conformance.sh
conformance=$?
set -e
if ((conformance == 0)); then echo "conformance: ok"; else echo "conformance: FAILED"; status=1; fi

step "summary"
# One closing line over all test binaries.
awk '/^test result:/ { for (i=1;i<=NF;i++) { if ($(i+1) ~ /^passed;?$/) p+=$i; if ($(i+1) ~ /^failed;?$/) f+=$i; if ($(i+1) ~ /^ignored;?$/) ig+=$i } }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, ig }' "${MCS_TEST_LOG:-/tmp/mcs-test.log}"
grep -E 'Passed \| ' target/conformance/suite.log 2>/dev/null | sed 's/^/conformance: /' || true
echo "total wall time: $(( $(date +%s) - t0 ))s (after set-up)"
exit "$status"
