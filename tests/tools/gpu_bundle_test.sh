#!/usr/bin/env bash
# tools/gpu-bundle and tools/gpu-check --bundle, as on a GPU machine that cannot build hetpar: packs
# the build folder's binaries, then (as root, in a private mount namespace) hides the build folder,
# the venv's UCX wheel and every system copy of a library the bundle carries, and runs gpu-check
# from the bundle with --cpu-train: the gpu tests (they skip without a GPU, but for gpu_kernels_test,
# which checks itself on the CPU), three 4-step training
# runs compared with the float64 reference, two 8-step runs of the master-weights check, and
# step_bench, packing its logs (--logs); then with --deadline 1 (nothing runs, and the runs after
# the float32 run are left out, saying why). Then the refusals: a bundle built against another
# libtorch, a UCX module and a bundle missing one of their libraries; and the warning for a library
# that loads but lacks hetpar's symbols.
# Usage: gpu_bundle_test.sh BUILD_DIR REPO_ROOT
set -euo pipefail

build="$(realpath "$1")"
repo="$(realpath "$2")"
python="$repo/.venv/bin/python"
[ -x "$python" ] || { echo "gpu_bundle_test: $python is missing: run deploy/install-deps.sh" >&2; exit 1; }

work="$(mktemp -d /tmp/hetpar-gpu-bundle-test.XXXXXX)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "gpu_bundle_test: FAIL: $*" >&2
  exit 1
}

# ---- Pack ----
"$repo/tools/gpu-bundle" --no-build --build-dir "$build" --out "$work/bundle" >"$work/pack.json" ||
  fail "tools/gpu-bundle failed"
"$python" - "$work/pack.json" "$work/bundle" <<'EOF' || fail "the bundle is not what was asked for"
import json, os, sys
line = json.loads(open(sys.argv[1]).read())
bundle = sys.argv[2]
assert line["bundle"] == bundle, line
manifest = json.load(open(os.path.join(bundle, "bundle.json")))
names = {t["name"] for t in manifest["tests"]}
for name in ("gpu_kernels_test", "host_sync_test", "llm_attention_test", "boundary_device_test"):
    assert name in names, f"{name} missing from bundle.json's tests {sorted(names)}"
for t in manifest["tests"]:
    assert os.access(os.path.join(bundle, t["binary"]), os.X_OK), t
for f in ("bin/hetpar", "bin/hetpar-encoder", "bin/hetpar-llm", "bin/hetpar-reference",
          "bin/libhetpar_sentencepiece.so",
          "bench/gpu_bench", "bench/transport_bw",
          "bench/step_bench", "bench/model_bench", "site/libucx/bin/ucx_perftest",
          "site/libucx/lib/libucp.so.0", "lib/libgrpc++.so.1.51"):
    assert os.path.exists(os.path.join(bundle, f)), f"{f} missing from the bundle"
# libtorch and the C runtime come from the machine that runs it.
for f in os.listdir(os.path.join(bundle, "lib")):
    assert not f.startswith(("libtorch", "libc10", "libc.so", "libstdc++", "libcuda.so")), f
assert manifest["torch"].startswith("2."), manifest["torch"]
EOF

# ---- Run it where nothing else is left to find ----
# The UCX wheel's folders (<site>/libucx and <site>/libucx_cu13.libs), when the build linked it.
ucx_libdir="$(sed -n 's/^HETPAR_UCX_LIBDIR:[A-Z]*=//p' "$build/CMakeCache.txt")"
ucx_wheel=""
if [[ "$ucx_libdir" == */site-packages/libucx/lib ]]; then
  site="${ucx_libdir%/libucx/lib}"
  ucx_wheel="$site/libucx $site/libucx_cu13.libs"
fi
# The libraries the bundle carries, as packed (the last case below removes one).
ls "$work/bundle/lib" >"$work/libraries"
cat >"$work/hidden.sh" <<EOF
set -euo pipefail
# The libraries python3 and mount(8) load themselves stay: a GPU machine has its own of those.
mount -t tmpfs none "$build"
for d in $ucx_wheel; do
  if [ -d "\$d" ]; then mount -t tmpfs none "\$d"; fi
done
hidden=0
for name in \$(cat "$work/libraries") libucp.so.0 libucs.so.0; do
  case "\$name" in libz.so* | libssl.so* | libcrypto.so* | libpcre2-8.so*) continue ;; esac
  for dir in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu; do
    if [ -e "\$dir/\$name" ]; then
      mount --bind /dev/null "\$dir/\$name"
      hidden=\$((hidden + 1))
    fi
  done
done
echo "gpu_bundle_test: hid \$hidden system libraries, $build, and the UCX wheel" >&2
cd "$repo"
"\$@"
EOF
hide=(unshare -m --propagation private bash "$work/hidden.sh")
if [ "$(id -u)" != 0 ] || ! unshare -m --propagation private true 2>/dev/null; then
  echo "gpu_bundle_test: no private mount namespace here (not root, or unshare refused):" \
    "running the bundle with the build folder and system libraries still in view" >&2
  hide=()
fi

status=0
# gpu_kernels_test's self-check on the CPU runs its cases, which record the attention kernel they
# saw (RecordProperty): the gpu_tests line must carry those properties.
HETPAR_GPU_TEST_ON_CPU=1 "${hide[@]}" "$repo/tools/gpu-check" --bundle "$work/bundle" --cpu-train \
  --train-steps 4 --master-weights-steps 8 --logs "$work/logs.tar.gz" >"$work/check.jsonl" 2>"$work/check.log" ||
  status=$?
if [ "$status" != 0 ]; then
  tail -n 60 "$work/check.log" >&2
  cat "$work/check.jsonl" >&2
  fail "tools/gpu-check --bundle exited $status"
fi
# --logs: one archive of the runs' logs and metrics and the gtest reports, without the data set.
tar -tzf "$work/logs.tar.gz" >"$work/logs.list" || fail "--logs wrote no readable archive"
for f in gpu-check/runs/cpu_float32.log gpu-check/runs/cpu_float32/metrics.jsonl \
  gpu-check/runs/reference_f64/log/reference.log gpu-check/gtest-main/gpu_kernels_test.xml; do
  grep -qx "$f" "$work/logs.list" || { cat "$work/logs.list" >&2; fail "--logs: no $f in the archive"; }
done
! grep -q -e '^gpu-check/runs/data/' -e '/model/' "$work/logs.list" ||
  fail "--logs: the archive holds the data set or a trained model"
"$python" - "$work/check.jsonl" <<'EOF' || { cat "$work/check.jsonl" >&2; fail "gpu-check's lines"; }
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
checks = {l["check"]: l for l in lines if "check" in l}
assert checks["bundle"]["ok"] is True, checks["bundle"]
assert checks["bundle"]["matches_checkout"] is True, checks["bundle"]
# Every symbol the binaries need is defined by the libraries they load.
assert checks["bundle"]["undefined_symbols"] == "", checks["bundle"]
parts = {l["part"]: l for l in lines if l.get("check") == "gpu_tests"}
assert sorted(parts) == ["main", "nccl"], parts
# Every gpu test but NCCL's first, NCCL's (the NCCL cases of three binaries) last.
backends = {case: p["sdp_backend"] for case, p in parts["main"]["properties"].items()
            if "sdp_backend" in p}
# gpu_kernels_test's eight attention cases, each with the kernel it saw.
assert len(backends) >= 8, parts["main"]["properties"]
assert set(backends.values()) <= {"math", "flash_attention", "efficient_attention",
                                  "cudnn_attention"}, backends
assert [l.get("part") for l in lines if l.get("check") == "gpu_tests"] == ["main", "nccl"]
main, nccl = parts["main"], parts["nccl"]
assert main["failed"] == 0 and main["passed"] + main["skipped"] > 10, main
assert nccl["failed"] == 0 and 3 <= nccl["passed"] + nccl["skipped"] < main["passed"] + main["skipped"], nccl
assert lines.index(nccl) > max(i for i, l in enumerate(lines) if l.get("bench") == "step")
runs = {l["run"]: l for l in lines if l.get("check") == "cpu_train"}
assert sorted(runs) == ["cpu_bfloat16", "cpu_float32", "cpu_float32_encoder_dp2",
                        "cpu_float32_llm_tp2", "master_weights", "reference_float64_cpu"], sorted(runs)
for name, run in runs.items():
    assert run["rc"] == 0, run
    if name not in ("reference_float64_cpu", "master_weights"):
        assert run["compare_rc"] == 0 and "compared 4 steps" in run["compare"], run
        assert run["boundary"] == "", run  # on the CPU: no device boundary to report
# 8 steps: both runs read back, the drops printed, not judged (from 20 steps).
weights = runs["master_weights"]
assert weights["steps"] == 8 and weights["judged"] is False and weights["ok"] is True, weights
assert all(isinstance(weights[k], float) for k in ("float32_drop", "bfloat16_drop")), weights
steps = [l for l in lines if l.get("bench") == "step"]
assert sorted(s["case"] for s in steps) == ["as_configured", "micro_batch_1"], steps
for s in steps:
    assert s["steps_measured"] >= 1 and s["step_time_s"] > 0 and s["llm_compute_s"] > 0, s
    assert s["split_timing"] == "device", s  # on the CPU compute is timed as it runs
summary = checks["gpu_check"]
assert summary["ok"] is True and summary["train_rc"] == 0 and summary["step_rc"] == 0, summary
assert summary["incomplete"] is False and summary["cut_by_deadline"] == [], summary
EOF

# ---- The deadline ----
# With --deadline 1 nothing after the bundle's checks has time to run: every step is refused
# (status 124) and the summary is still printed.
status=0
"$repo/tools/gpu-check" --bundle "$work/bundle" --cpu-train --train-steps 4 --deadline 1 \
  >"$work/deadline.jsonl" 2>"$work/deadline.log" || status=$?
[ "$status" = 1 ] || { tail -n 20 "$work/deadline.log" >&2; fail "--deadline 1: exit status $status, expected 1"; }
grep -q "not run: under 45 s of the --deadline (1 s) left" "$work/deadline.log" ||
  fail "--deadline 1: no step was refused for the deadline"
"$python" - "$work/deadline.jsonl" <<'EOF' || { cat "$work/deadline.jsonl" >&2; fail "--deadline 1's lines"; }
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
summary = lines[-1]
assert summary["check"] == "gpu_check" and summary["ok"] is False, summary
# It reads as cut short, each step the deadline left out named: not as a failure of the GPU path.
cut = summary["cut_by_deadline"]
assert summary["incomplete"] is True, summary
assert "gpu_kernels_test: not run" in cut and "hetpar: not run" in cut, cut
assert "cpu_float32_encoder_dp2: not run" not in cut, cut  # left out for the failed float32 run
assert summary["ctest_rc"] != 0 and summary["nccl_rc"] != 0 and summary["step_rc"] == 124, summary
runs = {l["run"]: l for l in lines if l.get("check") == "cpu_train"}
assert runs["reference_float64_cpu"]["rc"] == 124 and runs["cpu_float32"]["rc"] == 124, runs
# The float32 run did not run: the later runs are left out, saying why, without trying.
for name in ("cpu_bfloat16", "master_weights", "cpu_float32_llm_tp2", "cpu_float32_encoder_dp2"):
    assert "rc" not in runs[name] and "cpu_float32 run failed" in runs[name]["not_run"], runs
step = [l for l in lines if l.get("check") == "step_bench"]
assert len(step) == 1 and "cpu_float32 run failed" in step[0]["not_run"], lines
main = [l for l in lines if l.get("part") == "main"][0]
assert main["not_run"] and main["failed"] == 0 and main["failures"] == [], main
EOF

# ---- An archive is never unpacked over a build folder ----
# (A stand-in folder: a regression must not delete the real build.)
mkdir -p "$work/a-build"
touch "$work/a-build/CMakeCache.txt" "$work/a-build/kept" "$work/not-unpacked.tar.xz"
status=0
"$repo/tools/gpu-check" --bundle "$work/not-unpacked.tar.xz" --build-dir "$work/a-build" --no-train \
  >"$work/over-build.jsonl" 2>"$work/over-build.log" || status=$?
[ "$status" = 1 ] || { cat "$work/over-build.log" >&2; fail "a bundle over a build folder: exit $status"; }
grep -q "a-build is a CMake build folder: not unpacking the bundle over it" "$work/over-build.log" ||
  { cat "$work/over-build.log" >&2; fail "a bundle over a build folder: no refusal naming it"; }
[ -e "$work/a-build/kept" ] || fail "the build folder was deleted"
grep -q '"failed_step":"bundle"' "$work/over-build.jsonl" || fail "a bundle over a build folder: no summary"

# ---- A GPU that libtorch does not see ----
# nvidia-smi lists a GPU (here a stand-in on PATH for the host's) that torch cannot use (a driver
# too old for its CUDA, say): the check fails at once, naming the driver, where it used to carry on
# as on a CPU machine and end ok.
# (Only where torch sees no GPU, as the first check's gpu_present line says.)
if grep -q '"check":"gpu_present",.*"torch_gpus":0}' "$work/check.jsonl"; then
mkdir -p "$work/smi"
cat >"$work/smi/nvidia-smi" <<'EOF'
#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *compute_mode*) echo Default ;;
  *driver_version*) echo 550.54.15 ;;
  *) exit 1 ;;
esac
EOF
chmod +x "$work/smi/nvidia-smi"
status=0
PATH="$work/smi:$PATH" "$repo/tools/gpu-check" --bundle "$work/bundle" --no-train --deadline 1 \
  >"$work/unseen.jsonl" 2>"$work/unseen.log" || status=$?
[ "$status" = 1 ] || fail "a listed GPU that torch cannot see: exit status $status, expected 1"
grep -q "FAILED: NVIDIA driver 550.54.15 is older than 580, the oldest that runs CUDA 13" "$work/unseen.log" ||
  { tail -n 20 "$work/unseen.log" >&2; fail "a listed GPU that torch cannot see: not named as the failure"; }
! grep -q '"check":"gpu_tests"' "$work/unseen.jsonl" ||
  { cat "$work/unseen.jsonl" >&2; fail "a listed GPU that torch cannot see: the tests still ran"; }
grep -q '"check":"gpu_present","nvidia_smi":true,"gpus":1,.*"driver":"550.54.15",.*"torch_gpus":0' \
  "$work/unseen.jsonl" || { cat "$work/unseen.jsonl" >&2; fail "gpu_present without the GPU, driver or torch's count"; }
grep -q '"check":"gpu_check","ok":false,"failed_step":"gpu_present","gpu":false,"gpu_listed":true,"driver":"550.54.15"' "$work/unseen.jsonl" ||
  { cat "$work/unseen.jsonl" >&2; fail "the summary does not say a listed GPU went unused"; }
fi

# ---- Refusals ----
# expect_refusal NAME BUNDLE PATTERN WHAT [PREFIX...]: gpu-check (after PREFIX) on BUNDLE exits 1
# with a line matching PATTERN, and runs no gpu test; WHAT names the case in failures.
expect_refusal() {
  local name="$1" bundle="$2" pattern="$3" what="$4" status=0
  shift 4
  "$@" "$repo/tools/gpu-check" --bundle "$bundle" --no-train >"$work/$name.jsonl" \
    2>"$work/$name.log" || status=$?
  [ "$status" = 1 ] || fail "$what gave status $status, not 1"
  grep -q "$pattern" "$work/$name.jsonl" || { cat "$work/$name.jsonl" >&2; fail "$what: no refusal matching $pattern"; }
  if grep -q '"check":"gpu_tests"' "$work/$name.jsonl"; then
    fail "$what: the gpu tests ran from a refused bundle"
  fi
}

# Another libtorch's bundle: refused before anything runs, naming both versions.
cp -a "$work/bundle" "$work/other-torch"
sed -i 's/"torch": "[^"]*"/"torch": "1.13.1"/' "$work/other-torch/bundle.json"
expect_refusal other "$work/other-torch" \
  '"check":"bundle","ok":false,"error":"the bundle was built against libtorch 1.13.1' \
  "a bundle for libtorch 1.13.1"

# A UCX transport module that cannot load its libraries: UCX itself would leave it out silently,
# so gpu-check refuses the bundle, naming the module and the library. (The driver's libcuda, which
# this machine lacks, is not counted where there is no GPU: the bundle above passed.)
cp -a "$work/bundle" "$work/no-gomp"
rm "$work"/no-gomp/site/libucx_cu13.libs/libgomp-*
expect_refusal no-gomp "$work/no-gomp" \
  '"error":"binaries that cannot load their libraries: .*UCX module libucx_perftest_cuda.so.0: libgomp-' \
  "a bundle without UCX's libgomp"
rm -rf "$work/no-gomp"

# A library of the right name that lacks the symbols hetpar needs (another build): it loads, so the
# bundle is not refused, but its line and the log name the binary and a missing symbol. (With
# --deadline 1 nothing runs after the bundle's checks.)
if [ "${#hide[@]}" != 0 ]; then
  cp -a "$work/bundle" "$work/other-yaml"
  cp "$(ls "$work"/other-yaml/lib/libabsl_*.so* | head -n 1)" "$work/other-yaml/lib/libyaml-cpp.so.0.7"
  status=0
  "${hide[@]}" "$repo/tools/gpu-check" --bundle "$work/other-yaml" --no-train --deadline 1 \
    >"$work/other-yaml.jsonl" 2>"$work/other-yaml.log" || status=$?
  [ "$status" = 1 ] || fail "a bundle with another libyaml-cpp: exit status $status, expected 1"
  grep -q '"check":"bundle","ok":true,"undefined_symbols":"hetpar: undefined symbol: .*YAML' \
    "$work/other-yaml.jsonl" || { cat "$work/other-yaml.jsonl" >&2; fail "a bundle with another libyaml-cpp: no undefined symbol of YAML listed for hetpar"; }
  grep -q "WARNING: undefined symbols" "$work/other-yaml.log" ||
    fail "a bundle with another libyaml-cpp: no warning in the log"
  rm -rf "$work/other-yaml"
fi

# A bundle without one of its libraries: gpu-check names the binary and the library. (Here the
# hidden system copy is an empty file, so ldd says it cannot load it; where the library is absent
# it says "not found".)
if [ "${#hide[@]}" != 0 ]; then
  rm "$work/bundle/lib/libyaml-cpp.so.0.7"
  expect_refusal missing "$work/bundle" \
    '"error":"binaries that cannot load their libraries: .*hetpar: .*libyaml-cpp.so.0.7' \
    "a bundle without libyaml-cpp" "${hide[@]}"
fi
echo "gpu_bundle_test: passed"
