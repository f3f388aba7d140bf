#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kubectl, and the node's kube-scheduler, kubelet
# and kube-proxy (scripts/clusterset.sh) from the Go module proxy with the machine's Go.
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces the k8s.io/* staging
# modules with local paths. We make a wrapper module that requires k8s.io/kubernetes and
# replaces each staging module with its published v0.X.Y twin, then build the commands.
# Output: $MCS_CACHE/kube/$KUBE_VERSION/{kube-apiserver,kube-controller-manager,kubectl,
#         kube-scheduler,kubelet,kube-proxy}.
# Idempotent (a cache without one of them is rebuilt; the Go build cache makes that quick).
set -euo pipefail
KUBE_VERSION="${KUBE_VERSION:-v1.36.3}"
CACHE="${MCS_CACHE:-$HOME/.cache/mcs-dataplane}"
OUT="$CACHE/kube/$KUBE_VERSION"
CMDS=(kube-apiserver kube-controller-manager kubectl kube-scheduler kubelet kube-proxy)
missing=0
for c in "${CMDS[@]}"; do [[ -x "$OUT/$c" ]] || missing=1; done
if ((missing == 0)); then
  echo "kube: $KUBE_VERSION cached in $OUT"; exit 0
fi
STAGING_VERSION="v0.${KUBE_VERSION#v1.}"
WORK="$CACHE/kube/build-$KUBE_VERSION"
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
cd "$WORK"
export GOFLAGS="-mod=mod" CGO_ENABLED=0 GOTOOLCHAIN=local
start=$(date +%s)
gomod_json=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION")
gomod=$(printf '%s' "$gomod_json" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
[[ -f "$gomod" ]] || { echo "kube: cannot find go.mod of k8s.io/kubernetes@$KUBE_VERSION" >&2; exit 1; }
go_line=$(grep -m1 '^go ' "$gomod")
{
  echo "module mcs-dataplane/kubebuild"
  echo
  echo "$go_line"
  echo
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  echo
  # Every `k8s.io/foo => ./staging/src/k8s.io/foo` becomes `k8s.io/foo => k8s.io/foo v0.X.Y`.
  grep -E '^\s*k8s.io/[^ ]+ => \./staging/' "$gomod" | awk -v v="$STAGING_VERSION" '{print "replace " $1 " => " $1 " " v}'
} > go.mod
echo 'package main' > tools.go
echo "kube: resolving modules for $KUBE_VERSION (staging $STAGING_VERSION)"
# No `go mod tidy`: with no Go file importing k8s.io/kubernetes it would drop the require and
# the build would then resolve the newest k8s.io/kubernetes instead of the pinned one.
go get "k8s.io/kubernetes@$KUBE_VERSION"
echo "kube: building ${CMDS[*]} (takes minutes cold; one go build, so they share the work)"
go build -trimpath -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION" \
  -o "$OUT/" "${CMDS[@]/#/k8s.io/kubernetes/cmd/}"
echo "kube: built in $(( $(date +%s) - start ))s: $(ls "$OUT")"
rm -rf "$WORK"
