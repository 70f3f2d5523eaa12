#!/usr/bin/env bash
# Renders the Kubernetes manifests of the example configs with `hetpar deploy k8s` and validates
# every object against the OpenAPI schemas of Kubernetes releases (kubernetes-validate, from the
# project's .venv that deploy/install-deps.sh installs), strictly: an unknown field fails, and so
# does a warning (kubernetes-validate only warns about a kind it has no schema for).
# Usage: k8s_schema_test.sh HETPAR_BIN REPO_ROOT
set -euo pipefail

hetpar="$1"
repo="$2"
validate="$repo/.venv/bin/kubernetes-validate"
# The oldest release the manifests need (the pod-index label, gRPC probes) and the newest the
# validator knows.
versions=(1.30 1.37)

if [ ! -x "$validate" ]; then
  echo "k8s_schema_test: $validate is missing: run deploy/install-deps.sh" >&2
  exit 1
fi

work="$(mktemp -d /tmp/hetpar-k8s-schema.XXXXXX)"
trap 'rm -rf "$work"' EXIT

failed=0
render() {  # NAME ARGS...
  local name=$1
  shift
  "$hetpar" deploy k8s --image registry.example/hetpar:test --out "$work/$name" "$@" >/dev/null
}
render tiny --config "$repo/configs/tiny.yaml"
render tiny-colocated --config "$repo/configs/tiny-colocated.yaml" --namespace training
render large --config "$repo/configs/large-example.yaml" --set run.device=cuda --gpus-per-node 8 \
  --storage-class shared-fs --set coordinator.metrics_listen=0.0.0.0:9464

for dir in "$work"/*/; do
  files=("$dir"manifests/*.yaml)
  for version in "${versions[@]}"; do
    if ! output="$("$validate" -k "$version" --strict "${files[@]}" 2>&1)"; then
      echo "k8s_schema_test: FAIL: $(basename "$dir") against Kubernetes $version:" >&2
      echo "$output" >&2
      failed=1
    elif grep -q 'WARN' <<<"$output"; then
      echo "k8s_schema_test: FAIL: $(basename "$dir") against Kubernetes $version warned:" >&2
      echo "$output" >&2
      failed=1
    else
      echo "k8s_schema_test: $(basename "$dir"): ${#files[@]} files valid for Kubernetes $version"
    fi
  done
done
exit "$failed"
