# hetpar: the two set-up commands are `make test` and `make demo` (see README.md).
# Every target installs what it needs first (deploy/install-deps.sh); the one thing it does not
# install is the CUDA 13 toolkit, which the build needs even without a GPU (README.md).

BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CTEST_ARGS ?=

.PHONY: all deps configure build test demo format format-check tidy clean

all: build

deps:
	./deploy/install-deps.sh

# After deps even under make -j: configuring needs the environment it installs.
$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: deps $(BUILD_DIR)/CMakeCache.txt

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Builds everything and runs the whole suite (labels: unit, integration, parity, fault, slow,
# slurm, gpu; the gpu tests skip without a GPU).
test: build
	cd $(BUILD_DIR) && ctest -j2 --output-on-failure $(CTEST_ARGS)

# Trains configs/tiny.yaml end to end on this machine: an encoder pool (dp 2) and an LLM (tp 2)
# as separate processes joined by an in-process coordinator; the synthetic data set is generated
# first when absent. Extra flags: make demo DEMO_ARGS="--steps 40".
DEMO_ARGS ?=
demo: build
	$(BUILD_DIR)/bin/hetpar run --config configs/tiny.yaml $(DEMO_ARGS)

SOURCES = $(shell git ls-files '*.cc' '*.h')

format:
	clang-format -i $(SOURCES)

format-check:
	clang-format --dry-run --Werror $(SOURCES)

tidy: configure
	cmake -S . -B $(BUILD_DIR) -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
	clang-tidy -p $(BUILD_DIR) --quiet $(filter %.cc,$(SOURCES))

clean:
	rm -rf $(BUILD_DIR)
