#!/usr/bin/env bash
# Runs the main job, `mcs-agent demo` (a two-cluster sandbox in network namespaces, with
# traffic, failover and clean-up), after installing what it needs (idempotent, cached in
# ~/.cache/mcs-dataplane). As root on a Debian 12 machine of this kind:
#
#   bash scripts/demo.sh [--dataplane userspace|ebpf|auto]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. scripts/env.sh
cargo build --locked --release -q -p mcs-agent
exec target/release/mcs-agent demo "$@"
