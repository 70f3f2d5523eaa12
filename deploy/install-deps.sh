#!/usr/bin/env bash
# Installs the Debian packages that hetpar's build, tests and benchmarks need.
# Idempotent: packages already present are left alone and apt-get is not touched.
# A package that cannot be installed stops the script with a message naming it.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake make pkg-config ccache git clang clang-format clang-tidy
  # control plane
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libabsl-dev libssl-dev openssl
  # data plane
  libucx-dev ucx-utils
  # models and collectives
  libtorch-dev libgloo-dev
  # parameter export checksums (crc32)
  zlib1g-dev
  # configuration, CLI, formats
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev
  # data pipeline
  libpng-dev libjpeg62-turbo-dev libsentencepiece-dev sentencepiece
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # process tools the tests use (pgrep, ps, lsof-free fd counting via /proc)
  procps
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
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
echo "install-deps: done"
