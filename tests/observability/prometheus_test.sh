#!/usr/bin/env bash
# The coordinator's /metrics endpoint, checked by Prometheus's own tools: a real `hetpar run`
# serves it (coordinator.metrics_listen on loopback); `promtool check metrics` must accept a
# scrape; then a real Prometheus server (Debian's package, in a temporary directory, ended by
# pid) scrapes the run every second, and its HTTP query API must return the step-time, token
# and per-module TFLOPS series with positive values.
# Usage: prometheus_test.sh HETPAR_BIN REPO_ROOT
set -euo pipefail

bin="$1"
repo="$2"
for tool in prometheus promtool curl python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "prometheus_test: FAIL: $tool is not installed (deploy/install-deps.sh installs it)" >&2
    exit 1
  fi
done

work="$(mktemp -d /tmp/hetpar-prometheus-test.XXXXXX)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "prometheus_test: FAIL: $*" >&2
  for f in "$work/run.log" "$work/prometheus.log"; do
    [ -f "$f" ] && { echo "== $f" >&2; tail -n 20 "$f" >&2; }
  done
  exit 1
}
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# Polls COMMAND until it succeeds or TIMEOUT_S pass (what it waits for is observable, the short
# pause only paces the polling).
await() {  # TIMEOUT_S WHAT COMMAND...
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || fail "timed out waiting for $what"
    sleep 0.2
  done
}

# The endpoint listens on a port the kernel picks, which the run prints: a port picked here and
# released could be taken by another process (a parallel test's listener) before the run binds it.
# A run long enough to be scraped; it is interrupted once Prometheus has its series.
"$bin" run --config "$repo/configs/tiny.yaml" --steps 3000 --out "$work/run" --threads 1 \
  --set coordinator.metrics_listen=127.0.0.1:0 \
  --set data.manifest="$work/data/train.jsonl" --set data.val_manifest="$work/data/val.jsonl" \
  --set data.tokenizer="$work/data/tokenizer.model" \
  --set data.synth.samples=64 --set data.synth.val_samples=4 >"$work/run.log" 2>&1 &
run_pid=$!
pids+=("$run_pid")

metrics_port=
printed_its_port() {
  kill -0 "$run_pid" 2>/dev/null || fail "hetpar run exited early"
  metrics_port=$(sed -n 's|^hetpar run: Prometheus metrics at http://127\.0\.0\.1:\([0-9]*\)/metrics$|\1|p' \
    "$work/run.log" | head -n 1)
  [ -n "$metrics_port" ]
}
await 240 "the metrics endpoint's address in the run's output" printed_its_port

scraped_a_step() {
  kill -0 "$run_pid" 2>/dev/null || fail "hetpar run exited early"
  curl -fsS "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics.txt" 2>/dev/null &&
    grep -q '^hetpar_step_time_seconds{' "$work/metrics.txt"
}
await 240 "a committed step on the metrics endpoint" scraped_a_step
promtool check metrics <"$work/metrics.txt" >"$work/promtool.txt" 2>&1 ||
  fail "promtool check metrics: $(cat "$work/promtool.txt")"
echo "prometheus_test: promtool accepts the endpoint ($(grep -c '^hetpar_' "$work/metrics.txt") samples)"

cat >"$work/prometheus.yml" <<CONFIG
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: hetpar
    static_configs:
      - targets: ["127.0.0.1:$metrics_port"]
CONFIG
# Picked just before Prometheus binds it (Prometheus cannot take port 0 and say which it got).
prometheus_port=$(free_port)
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prometheus_port" >"$work/prometheus.log" 2>&1 &
pids+=("$!")

# True when the instant query $1 returns at least one series whose value is > 0.
positive_series() {
  curl -fsS "http://127.0.0.1:$prometheus_port/api/v1/query" --data-urlencode "query=$1" \
    >"$work/query.json" 2>/dev/null || return 1
  python3 - "$work/query.json" <<'PY'
import json, sys
answer = json.load(open(sys.argv[1]))
results = answer.get("data", {}).get("result", [])
sys.exit(0 if answer.get("status") == "success" and results and
         all(float(r["value"][1]) > 0 for r in results) else 1)
PY
}
for query in 'hetpar_step_time_seconds{job="hetpar",run="tiny"}' \
             'hetpar_tokens_per_second{run="tiny"}' \
             'hetpar_tokens_total{run="tiny"}' \
             'hetpar_module_tflops{run="tiny",module="llm"}' \
             'hetpar_module_tflops{run="tiny",module="encoder"}'; do
  await 120 "Prometheus to return $query" positive_series "$query"
  echo "prometheus_test: Prometheus has $query: $(cat "$work/query.json")"
done

kill -INT "$run_pid"
code=0
wait "$run_pid" || code=$?
[ "$code" -eq 130 ] || fail "hetpar run exited with $code after SIGINT (expected 130)"
echo "prometheus_test: passed"
