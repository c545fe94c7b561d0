# Two commands on a fresh machine with only Python 3 and pip:  make train  then  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mmtrain-installed
TRAIN_STAMP := $(VENV)/.mmtrain-train-installed
DATA   ?= data/shapes
CONFIG ?= configs/tiny.yaml
RUN    ?= runs/tiny
TORCH_CPU := torch==2.13.0

.PHONY: install data data-video train test test-slow lint bench clean

# A venv with mmtrain installed editable. A torch already present (e.g. a CUDA build) is kept;
# otherwise the CPU wheel is installed first, so pip never pulls a multi-GB CUDA build.
# `make train` needs only the package itself; `make test` adds the [dev,hf,eval] extras (pytest and
# ruff, transformers and lm-evaluation-harness for the `export --hf` tests: their tree is ~50 s more
# of a fresh install, which a first training run should not wait for).
$(TRAIN_STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e .
	@touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(BIN)/python -m pip install -q -e ".[dev,hf,eval]"
	@touch $(STAMP)

install: $(STAMP)

$(DATA)/manifest.json: | $(TRAIN_STAMP)
	$(BIN)/mmtrain data synth --out $(DATA)

data: $(DATA)/manifest.json

# configs/video_heavy.yaml's corpus (the vision balance's benchmarks): small images, 16-frame clips
data/shapes_video/manifest.json: | $(TRAIN_STAMP)
	$(BIN)/mmtrain data synth --out data/shapes_video --image-size 32 --video-size 64 --frames 16 \
		--n-image 3000 --n-video 3000 --n-interleaved 1000 --n-text 2000

data-video: data/shapes_video/manifest.json

train: $(TRAIN_STAMP) $(DATA)/manifest.json
	$(BIN)/mmtrain train $(CONFIG) --run-dir $(RUN)

lint: $(STAMP)
	$(BIN)/ruff check .

# the fast tier (docs/CONVENTIONS.md, "Tests"): every case over 2 s is listed with its time, and a case
# over its time budget fails the run
test: lint
	$(BIN)/python -m pytest --durations=0 --durations-min=2

# + the cases behind MMTRAIN_SLOW_TESTS=1 (every schedule and mesh, the plan tables against the docs):
# many more multi-rank runs than make test; run it after changing the parallel code, the plan or a shipped config
test-slow: lint
	MMTRAIN_SLOW_TESTS=1 $(BIN)/python -m pytest --durations=0 --durations-min=2

bench: $(STAMP) $(DATA)/manifest.json
	$(BIN)/python -m tools.bench.bench_loader --data $(DATA)

clean:
	rm -rf runs .pytest_cache .ruff_cache
