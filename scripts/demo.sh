#!/usr/bin/env bash
# Runs the main job, `mcs-agent demo` (a two-cluster sandbox in network namespaces, with
# traffic, failover and clean-up), then the export story (`mcs-bench export-demo`: a Service
# exported in one real cluster reaches a pod of another through our controller and agent),
# after installing what they need (idempotent, cached in ~/.cache/mcs-dataplane). As root on
# a Debian 12 machine of this kind:
#
#   bash scripts/demo.sh [--dataplane userspace|ebpf|auto]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. scripts/env.sh
cargo build --locked --release -q -p mcs-agent -p mcs-controller -p mcs-bench
status=0
target/release/mcs-agent demo "$@" || status=1
echo
echo "== the export story: ServiceExport in c2 -> our mcs-controller -> ServiceImport in c1 -> our mcs-agent"
target/release/mcs-bench export-demo || status=1
exit "$status"
