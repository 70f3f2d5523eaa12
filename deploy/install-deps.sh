#!/usr/bin/env bash
# Installs the Debian packages that hetpar's build, tests and benchmarks need, checks
# for the CUDA toolkit, then creates the project-local Python environment <repo>/.venv
# (system /usr/bin/python3, packages pinned in deploy/requirements.txt: libtorch, as
# the torch wheel; UCX with CUDA support, as the libucx-cu13 wheel; and the
# deployment-file checks).
# Idempotent: packages already present are left alone and apt-get is not touched;
# the venv is created only if absent and pip runs only when an installed version
# differs from its pin.
# A package that cannot be installed stops the script with a message naming it.
#
# HETPAR_NO_VENV=1 skips the Python environment: for a build against a libtorch of
# your own (cmake -DTorch_DIR=<libtorch>/share/cmake/Torch), without the tests that
# use Python; UCX is then Debian's (no CUDA) unless cmake -DHETPAR_UCX_PREFIX names one.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(
  # toolchain
  build-essential cmake make pkg-config ccache git clang clang-format clang-tidy
  # control plane
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libabsl-dev libssl-dev openssl
  # data plane: hetpar links the libucx-cu13 wheel in .venv (deploy/requirements.txt); Debian's
  # UCX 1.13 (no CUDA) is what a HETPAR_NO_VENV=1 build links, and ucx-utils' ucx_perftest is
  # the transport benchmark's baseline
  libucx-dev ucx-utils
  # collectives: the Gloo headers that libtorch's c10d ProcessGroupGloo.hpp includes (libtorch
  # itself is the pinned PyPI torch wheel in .venv, deploy/requirements.txt)
  libgloo-dev
  # parameter export checksums (crc32)
  zlib1g-dev
  # configuration, CLI, formats
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev
  # data pipeline
  libpng-dev libjpeg62-turbo-dev libsentencepiece-dev sentencepiece libpcre2-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # process tools the tests use (pgrep, ps, lsof-free fd counting via /proc)
  procps
  # project-local Python environment (.venv) for the deployment-file checks
  python3 python3-venv
  # a local Slurm cluster for the rendered batch scripts' test (tests/deploy/slurm)
  slurmctld slurmd slurm-client munge
  # the metrics endpoint's tests: promtool and a Prometheus server that scrapes a run; curl
  prometheus curl
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

install_debian_packages() {
  if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all ${#packages[@]} packages present"
    return 0
  fi

  local SUDO=
  if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
  fi

  echo "install-deps: installing ${#missing[@]} packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  if ! $SUDO apt-get install -y -q "${missing[@]}"; then
    # Name the package that fails, one by one, so the user knows what to fix.
    for p in "${missing[@]}"; do
      if ! $SUDO apt-get install -y -q "$p" >/dev/null 2>&1; then
        echo "install-deps: ERROR: cannot install Debian package '$p' (apt-get install $p failed)" >&2
        exit 1
      fi
    done
  fi
  echo "install-deps: Debian packages done"
}

# Prints the pins of requirements.txt that the venv does not satisfy (name==version
# per line; nothing when all match). Reads installed versions from package
# metadata: about 0.1 s, so a second run of this script stays fast.
venv_unmet_pins() {
  "$venv/bin/python" - "$requirements" <<'EOF'
import importlib.metadata as md
import sys

for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = md.version(name.strip())
    except md.PackageNotFoundError:
        have = None
    if have != want.strip():
        print(line)
EOF
}

install_python_venv() {
  local python=/usr/bin/python3
  venv="$repo/.venv"
  requirements="$repo/deploy/requirements.txt"

  if [ ! -f "$requirements" ]; then
    echo "install-deps: ERROR: missing $requirements" >&2
    exit 1
  fi
  if [ ! -x "$python" ]; then
    echo "install-deps: ERROR: $python not found (Debian package python3)" >&2
    exit 1
  fi

  # A venv whose interpreter no longer runs (system Python replaced, folder
  # copied from another machine) is rebuilt in place.
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c '' >/dev/null 2>&1; then
    echo "install-deps: creating Python venv $venv with $python ($("$python" --version 2>&1))"
    if ! "$python" -m venv --clear "$venv"; then
      echo "install-deps: ERROR: cannot create Python venv $venv ($python -m venv failed; Debian package python3-venv)" >&2
      exit 1
    fi
  fi

  local unmet
  if ! unmet="$(venv_unmet_pins)"; then
    echo "install-deps: ERROR: cannot read installed Python packages in $venv" >&2
    exit 1
  fi
  if [ -z "$unmet" ]; then
    echo "install-deps: Python venv $venv matches deploy/requirements.txt"
    return 0
  fi

  echo "install-deps: installing Python packages into $venv: ${unmet//$'\n'/ }"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
  if ! "${pip[@]}" install -q -r "$requirements"; then
    # Name the pin that fails, one by one, so the user knows what to fix.
    local req
    for req in $unmet; do
      if ! "${pip[@]}" install -q --no-deps "$req" >/dev/null 2>&1; then
        echo "install-deps: ERROR: cannot install Python package '$req' into $venv (pip install $req failed)" >&2
        exit 1
      fi
    done
    echo "install-deps: ERROR: pip install -r $requirements failed (each pin installs alone: conflicting pins?)" >&2
    exit 1
  fi
  if ! "${pip[@]}" check >/dev/null; then
    echo "install-deps: ERROR: Python packages in $venv have broken requirements (run: $venv/bin/pip check)" >&2
    exit 1
  fi
  unmet="$(venv_unmet_pins)"
  if [ -n "$unmet" ]; then
    echo "install-deps: ERROR: after pip install, $venv still lacks: ${unmet//$'\n'/ }" >&2
    exit 1
  fi
  echo "install-deps: Python venv done"
}

# The torch wheel is built for CUDA 13; its CMake config needs the CUDA toolkit (nvcc) to
# configure, though nothing of hetpar needs a GPU to build or to run on CPU. The toolkit is not
# a Debian package: it comes with the machine image (or NVIDIA's installer).
check_cuda_toolkit() {
  local nvcc="${CUDAToolkit_ROOT:-/usr/local/cuda}/bin/nvcc"
  if [ -x "$nvcc" ] || command -v nvcc >/dev/null 2>&1; then
    echo "install-deps: CUDA toolkit: $( { [ -x "$nvcc" ] && "$nvcc" --version || nvcc --version; } | tail -1)"
    return 0
  fi
  echo "install-deps: ERROR: no CUDA toolkit: $nvcc not found and no nvcc on PATH. The pinned torch" >&2
  echo "  wheel (CUDA 13.0) needs it to configure; install the CUDA 13 toolkit, or set" >&2
  echo "  CUDAToolkit_ROOT to where it is" >&2
  exit 1
}

install_debian_packages
check_cuda_toolkit
if [ "${HETPAR_NO_VENV:-0}" = 1 ]; then
  echo "install-deps: HETPAR_NO_VENV=1: skipping the Python venv"
else
  install_python_venv
fi
echo "install-deps: done"
