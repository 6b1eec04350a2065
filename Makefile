# kvmesh: `make test` installs what it needs into .venv and runs the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install models up eval test typecheck bench-engine gpu-check clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# The cpu module's C++ kernels, built once here (~30 s) rather than by the first engine to start; rebuilt when
# their source changes. Without a compiler this only warns: the engines then take the plain path.
$(VENV)/.kernels: $(wildcard libs/devices/csrc/*) libs/devices/cpu_kernels.py | $(BIN)/.installed
	$(BIN)/python -c 'from devices.cpu_kernels import main; main()'
	touch $@

install: $(BIN)/.installed $(VENV)/.kernels

models: install  ## fetch smollm2-135m and write deepseek-tiny (once)
	$(BIN)/kvmesh models pull

up: models  ## the whole mesh on this machine: http://127.0.0.1:8080 (prints an API key)
	$(BIN)/kvmesh up $(UP_ARGS)

.PHONY: netns-up
netns-up: models  ## the mesh with every role a host of its own (network namespaces on a bridge; root, iproute2)
	$(BIN)/kvmesh up --netns $(UP_ARGS)

EVAL_DATA := libs/kvmesh/eval/data
eval: install  ## the default workload against `make up`'s mesh ($$KVMESH_API_KEY): eval-result.json, eval-report/
	$(BIN)/kvmesh eval run --workload $(EVAL_DATA)/conversation_trace_first32.jsonl \
		--workload $(EVAL_DATA)/requests.jsonl --model smollm2-135m --limit 16 --max-input-tokens 1024 \
		--max-output-tokens 16 --concurrency 4 --output eval-result.json --report eval-report $(EVAL_ARGS)

typecheck: install
	$(BIN)/mypy

# Prometheus's rule checker for tests/deploy, from Debian's prometheus package (unpacked, never installed as a
# service); where apt-get is missing or fails, that one test skips and says why.
$(BIN)/promtool: | $(BIN)/.installed
	-@command -v apt-get >/dev/null && tmp=$$(mktemp -d) && (cd $$tmp && apt-get download -qq -o APT::Sandbox::User=root prometheus \
	  && dpkg-deb -x prometheus_*.deb root) && cp $$tmp/root/usr/bin/promtool $@; rm -rf "$$tmp"

# The type check runs beside the tests (a core of its own for a minute), its report printed after theirs.
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep between parallel regions instead of spinning. The suite
# runs more processes than cores (two workers, their meshes, concurrent benches), and spinning threads take the
# cores from the others: a grammar test took 80 s beside two 2-thread loads with spinning, 37 s without (21 s idle).
test: export OMP_WAIT_POLICY = PASSIVE
test: install $(BIN)/promtool  ## the whole suite (type check, generated-code check, lint, format, unit, parity, kernels, mesh)
	$(BIN)/python -m mesh.protogen --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30; tests=$$?; \
	wait $$typecheck; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0

bench-engine: install models
	$(BIN)/kvmesh bench engine --model smollm2-135m --json

gpu-check:  ## on a CUDA machine: kernels against the reference, and their speed
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
