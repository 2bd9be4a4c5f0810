# The two commands a newcomer runs: `make demo` and `make test`. Each does its own set-up:
# a cached virtualenv (keyed by the pinned requirement files) and cached control-plane binaries
# (keyed by component versions), both under $(TPUFT_CACHE), outside the repo.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
export TPUFT_CACHE ?= $(HOME)/.cache/tpuft
# The cached venv is shared by every checkout on the machine and its editable install points at the
# last one set up; this checkout's own sources come first for everything make runs.
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/trainer_image:$(CURDIR)/devtools$(if $(PYTHONPATH),:$(PYTHONPATH))
VENV_SCRIPT := scripts/venv.sh
PY = "$$($(VENV_SCRIPT) | tail -n1)/bin/python"
TPUFT = "$$($(VENV_SCRIPT) | tail -n1)/bin/tpuft"

.PHONY: help venv venv-native binaries test test-unit test-trainer test-cluster lint crd docs demo bench chaos clean-cluster

help:
	@echo "make demo    - local cluster + operator + a real FSDPv2 fine-tune of a tiny model"
	@echo "make test    - every test (unit, trainer SPMD on CPU devices, local cluster, e2e)"
	@echo "make lint    - ruff + mypy"
	@echo "make bench   - benchmarks, results in bench/results/"
	@echo "make chaos   - the fault suite, several rounds (TPUFT_CHAOS_ROUNDS)"
	@echo "make crd     - regenerate crds/ and docs/api.md from the API models"
	@echo "make clean-cluster - remove this checkout's test clusters (\`tpuft cluster test-name\`)"

venv:
	@$(VENV_SCRIPT) >/dev/null

# The native backend's venv (torch 2.15, no torch_xla): tests/trainer/test_native.py runs `tpuft train`
# with it; the demo's native run will too.
venv-native:
	@$(VENV_SCRIPT) native >/dev/null

binaries: venv
	@$(TPUFT) cluster build

lint: venv
	@$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy

# The slowest tests are listed at the end of each session: the suite must stay under ~35 minutes warm
# on 2 cores.
# Three sessions at once: the cluster tests mostly wait (on the control plane, the operator's resyncs,
# kwok's timed stages), the unit and trainer tests mostly compute; one after the other they took 44 min.
# The fault suite, on a cluster of its own, mostly waits too (PodGC's 40 s quarantine, the outages it
# plays, the settling after each): a session of its own takes its ~6 min off the cluster session, the
# longest of the three. The other sessions' output goes to files, printed when all are done.
test: venv venv-native binaries lint
	@log="$$(mktemp -t tpuft-cluster-tests.XXXXXX)"; faults_log="$$(mktemp -t tpuft-fault-tests.XXXXXX)"; \
	echo ">> tests/cluster + tests/e2e, and the fault suite, run alongside; their output follows the others' ($$log, $$faults_log)"; \
	$(PY) -m pytest tests/cluster tests/e2e --ignore=tests/e2e/test_faults.py --durations=15 >"$$log" 2>&1 & cluster=$$!; \
	$(PY) -m pytest tests/e2e/test_faults.py --durations=5 >"$$faults_log" 2>&1 & faults=$$!; \
	trap 'kill $$cluster $$faults 2>/dev/null; exit 130' INT TERM; \
	core=0; $(PY) -m pytest tests/unit tests/trainer --durations=15 || core=$$?; \
	rc=0; wait $$cluster || rc=$$?; \
	frc=0; wait $$faults || frc=$$?; \
	echo ">> tests/cluster + tests/e2e:"; cat "$$log"; rm -f "$$log"; \
	echo ">> the fault suite (tests/e2e/test_faults.py):"; cat "$$faults_log"; rm -f "$$faults_log"; \
	if [[ $$core != 0 || $$rc != 0 || $$frc != 0 ]]; then \
		echo ">> FAILED: unit+trainer exit $$core, cluster+e2e exit $$rc, fault suite exit $$frc"; exit 1; fi

test-unit: venv
	@$(PY) -m pytest tests/unit

test-trainer: venv venv-native
	@$(PY) -m pytest tests/trainer

test-cluster: venv venv-native binaries  # tests/e2e/test_native_run.py runs native pods
	@$(PY) -m pytest tests/cluster tests/e2e

crd: venv
	@$(TPUFT) crd --write

demo: venv venv-native binaries
	@$(PY) -m tpuft_dev.demo

bench: venv binaries
	@$(PY) -m bench

# The fault suite, longer than the round `make test` runs: TPUFT_CHAOS_ROUNDS rounds of every fault,
# each kind in batches of TPUFT_CHAOS_BATCH (500+ faults with the defaults; a line per round).
chaos: venv binaries
	@TPUFT_CHAOS_ROUNDS=$${TPUFT_CHAOS_ROUNDS:-5} TPUFT_CHAOS_BATCH=$${TPUFT_CHAOS_BATCH:-25} \
		$(PY) -m pytest tests/e2e/test_faults.py

# The test suite runs on a cluster named after the checkout (`tpuft cluster test-name`), so two
# checkouts' `make test` never share one; this removes this checkout's (and its fault suite's) only.
# `tpuft cluster down --all` removes every local cluster on the machine.
clean-cluster: venv
	@name="$$($(TPUFT) cluster test-name --checkout "$(CURDIR)")"; \
		$(TPUFT) cluster down --name "$$name" && $(TPUFT) cluster down --name "$$name-faults"
