# Two commands on a fresh machine with only Python 3 and pip:  make train  then  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mmtrain-installed
DATA   ?= data/shapes
CONFIG ?= configs/tiny.yaml
RUN    ?= runs/tiny
TORCH_CPU := torch==2.13.0

.PHONY: install data data-video train test lint bench clean

# A venv with mmtrain installed editable, with the [hf] and [eval] extras (transformers and
# lm-evaluation-harness: the `export --hf` tests; ~50 s more on a fresh machine). A torch already
# present (e.g. a CUDA build) is kept; otherwise the CPU wheel is installed first, so pip never
# pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e ".[dev,hf,eval]"
	@touch $(STAMP)

install: $(STAMP)

$(DATA)/manifest.json: | $(STAMP)
	$(BIN)/mmtrain data synth --out $(DATA)

data: $(DATA)/manifest.json

# configs/video_heavy.yaml's corpus (the vision balance's benchmarks): small images, 16-frame clips
data/shapes_video/manifest.json: | $(STAMP)
	$(BIN)/mmtrain data synth --out data/shapes_video --image-size 32 --video-size 64 --frames 16 \
		--n-image 3000 --n-video 3000 --n-interleaved 1000 --n-text 2000

data-video: data/shapes_video/manifest.json

train: $(STAMP) $(DATA)/manifest.json
	$(BIN)/mmtrain train $(CONFIG) --run-dir $(RUN)

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest

bench: $(STAMP) $(DATA)/manifest.json
	$(BIN)/python -m tools.bench.bench_loader --data $(DATA)

clean:
	rm -rf runs .pytest_cache .ruff_cache
