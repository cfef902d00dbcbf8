# zmpi: `make demo` trains a small GPT under mpiexec; `make test` runs the test suite.
# Both create .venv and install everything on first use (MPI comes from the mpich wheel).
# MPI=system uses the MPI on PATH instead (a cluster's module): mpi4py built from source
# with its mpicc, its mpiexec, no mpich wheel, in .venv-system (docs/testing.md).
MPI    ?= wheel
ifeq ($(MPI),wheel)
VENV   ?= .venv
MPIEXEC := $(VENV)/bin/mpiexec
EXTRAS := dev,mpich
else ifeq ($(MPI),system)
VENV   ?= .venv-system
MPIEXEC := mpiexec
EXTRAS := dev
else
$(error MPI=$(MPI): give MPI=wheel (the mpich wheel, the default) or MPI=system (the MPI on PATH))
endif
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NP     ?= 2
STAGE  ?= 3
PRECISION ?= fp16

# One BLAS thread per rank, or oversubscribed ranks fight for the cores.
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
export MKL_NUM_THREADS=1
export ZMPI_BACKEND ?= numpy

.PHONY: install test test-strategy test-docs test-gpu demo lint clean tables bench bench-install bench-adam bench-host-kernels \
	bench-offload bench-nvme bench-onebit bench-zeropp bench-checkpoint bench-debug bench-tensor \
	bench-pipeline bench-recompute bench-plan bench-gpu count-gpu reproduce report bench-sparse \
	bench-moe bench-llama \
	gpu-wheels gpu-check

# CuPy itself for tests/test_standin_api.py, which holds the CuPy stand-in's names and
# signatures to CuPy's: the GPU machines' cupy-cuda13x and cuda-pathfinder (all `import cupy`
# needs without a GPU; a 70 MB download, 200 MB installed), in $(REAL_CUPY), off the venv's
# sys.path (the suite and zmpi see no CuPy). Without PyPI it warns and goes on: the test then
# skips, or fails where CI=true.
REAL_CUPY_VERSION := 14.2.0
REAL_CUPY := $(VENV)/real-cupy
REAL_CUPY_STAMP := $(REAL_CUPY)/.installed-$(REAL_CUPY_VERSION)
# CUDA 13's NVRTC, runtime headers and crt/ headers (pip wheels, about 60 MB, off sys.path) for
# tests/test_kernels_compile.py, which compiles zmpi's kernels in both wheel layouts CuPy
# compiles in (CUDA 12's are the dev extra's). Without PyPI: a warning, and those tests skip,
# or fail where CI=true.
CUDA13_VERSION := 13.0.88
CUDA13_WHEELS := $(VENV)/cuda13
CUDA13_STAMP := $(CUDA13_WHEELS)/.installed-$(CUDA13_VERSION)
# transformers and torch (the hf-test extra; torch pinned to the CPU build pip finds here) for
# tests/test_hf_interop.py, which holds zmpi's GPT-2 to transformers'. Without PyPI: a
# warning, and those tests skip.
HF_TEST_STAMP := $(VENV)/.installed-hf-test
# tokenizers (the data extra) for zmpi data prepare and tests/test_data_prepare.py. Without
# PyPI: a warning, and those tests skip.
DATA_STAMP := $(VENV)/.installed-data

install: $(STAMP) $(REAL_CUPY_STAMP) $(CUDA13_STAMP) $(HF_TEST_STAMP) $(DATA_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(MPI),system)
	@command -v mpicc > /dev/null || { echo "make MPI=system: no mpicc on PATH (load the MPI module first)"; exit 2; }
	MPICC=$$(command -v mpicc) $(PY) -m pip install -q --disable-pip-version-check \
	  --no-binary=mpi4py 'mpi4py>=4.0'
endif
	$(PY) -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $(STAMP)

$(REAL_CUPY_STAMP): | $(STAMP)
	rm -rf $(REAL_CUPY)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(REAL_CUPY) \
	  cupy-cuda13x==$(REAL_CUPY_VERSION) cuda-pathfinder==1.9.1 && touch $@ || \
	  echo "warning: CuPy $(REAL_CUPY_VERSION) not installed: tests/test_standin_api.py skips"

$(CUDA13_STAMP): | $(STAMP)
	rm -rf $(CUDA13_WHEELS)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(CUDA13_WHEELS) \
	  nvidia-cuda-nvrtc==$(CUDA13_VERSION) nvidia-cuda-runtime==$(CUDA13_VERSION) \
	  nvidia-cuda-crt==$(CUDA13_VERSION) && touch $@ || \
	  echo "warning: CUDA $(CUDA13_VERSION) wheels not installed: the CUDA 13 compile tests skip"

$(HF_TEST_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[hf-test]' && touch $@ || \
	  echo "warning: transformers and torch not installed: tests/test_hf_interop.py skips"

$(DATA_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[data]' && touch $@ || \
	  echo "warning: tokenizers not installed: tests/test_data_prepare.py skips"

test: $(STAMP) $(REAL_CUPY_STAMP) $(CUDA13_STAMP) $(HF_TEST_STAMP) $(DATA_STAMP)
	$(PY) -m pytest -q --durations=15

# The shared strategy suite (tests/test_zero.py at 1-4 ranks) on one strategy: STRATEGY=name;
# STRATEGY_MODULE=file.py imports a strategy file first, no package needed (docs/strategies.md).
test-strategy: $(STAMP)
	@test -n "$(STRATEGY)" || { echo "make test-strategy: give STRATEGY=name (and STRATEGY_MODULE=file.py for a file)"; exit 2; }
	$(PY) -m pytest -q tests/test_zero.py --strategy $(STRATEGY) \
	  $(if $(STRATEGY_MODULE),--strategy-module $(STRATEGY_MODULE))

# Every example of README.md and docs/ run as written, its shown output compared (docs/testing.md)
test-docs: $(STAMP)
	$(PY) tests/docs_examples.py
	$(PY) -m pytest -q -m docs tests/test_docs_examples.py

# On a machine with an NVIDIA GPU: the GPU-marked tests and the multi-rank suites on CuPy,
# offline, installing nothing: on GPU_PYTHON's own CuPy (a GPU image's cupy-cuda13x; elsewhere
# `pip install -e '.[gpu,dev]'` first), with zmpi and mpi4py importable there (`make gpu-check`
# sets both up from carried wheels). The Python's own pytest plugins stay out
# (PYTEST_DISABLE_PLUGIN_AUTOLOAD), the one the suite needs is named (-p pytest_timeout).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_PYTEST := ZMPI_BACKEND=cupy PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(GPU_PYTHON) -m pytest -q \
	-p pytest_timeout
test-gpu:
	@$(GPU_PYTHON) -c 'import cupy' 2> /dev/null || { echo "make test-gpu: no CuPy in \
	$(GPU_PYTHON): give GPU_PYTHON=, or pip install -e '.[gpu,dev]' where there is network"; exit 2; }
	@$(GPU_PYTHON) -c 'import zmpi.models, mpi4py, pytest_timeout' 2> /dev/null || { echo \
	"make test-gpu: $(GPU_PYTHON) cannot import zmpi.models, mpi4py and pytest_timeout: pip \
	install -e '.[dev]', or run make gpu-check, which sets them up from carried wheels"; exit 2; }
	$(GPU_PYTEST) -m gpu
	$(GPU_PYTEST) tests/test_zero.py tests/test_comm.py tests/test_offload.py

demo: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) -m zmpi.cli train --stage $(STAGE) --precision $(PRECISION)

# Benchmarks (not tests: timings never decide pass/fail). torch and matplotlib: the bench extra.
bench-install: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[bench]'

bench-adam: bench-install
	$(PY) experiments/bench_adam.py --out results/bench_adam

bench-host-kernels: bench-install
	$(PY) experiments/bench_host_kernels.py --out results/host_kernels

bench-offload: bench-install
	$(MPIEXEC) -n $(NP) $(PY) experiments/bench_offload.py --out results/offload_n$(NP)

bench-nvme: $(STAMP)
	$(PY) experiments/bench_nvme.py --out results/nvme
	$(PY) experiments/bench_nvme_param.py --out results/nvme_param

# 1-bit Adam against Adam on 4 ranks (about 4 minutes on 2 cores): docs/onebit.md
bench-onebit: bench-install
	$(MPIEXEC) -n 4 $(PY) experiments/bench_onebit.py --out results/onebit

# ZeRO++ (qwZ, qgZ, hpZ) against stage 3 on 4 ranks (about 4 minutes on 2 cores): docs/zeropp.md
bench-zeropp: bench-install
	$(MPIEXEC) -n 4 $(PY) experiments/bench_zeropp.py --out results/zeropp

# Every strategy's memory and traffic: the shipped ones, installed plugins (entry points) and
# STRATEGY_MODULE=file.py's, then into results/zero_tables_n$(NP)_<file> (the committed
# tables, which make test compares, stay the shipped strategies'): docs/experiments.md.
tables: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) experiments/zero_tables.py \
	  --out results/zero_tables_n$(NP)$(if $(STRATEGY_MODULE),_$(basename $(notdir $(STRATEGY_MODULE)))) \
	  $(if $(STRATEGY_MODULE),--strategy-module $(STRATEGY_MODULE))

bench: bench-install
	$(MPIEXEC) -n $(NP) $(PY) experiments/bench_vs_torch.py --profile --out results/vs_torch_n$(NP)

# zmpi plan's model against the published runs and against this machine (48 layouts in 3
# rounds, about 5 minutes; its timings need a quiet machine): docs/plan.md
bench-plan: $(STAMP)
	$(PY) experiments/plan_published.py --out results/plan_published
	$(PY) experiments/validate_plan.py --out results/plan_validation

# Every paper table at this machine's scale (about 30 minutes on 2 cores), then
# experiments/RESULTS.md with its figures (results/figures/).
reproduce: bench-install
	for n in 1 2 3 4; do \
	  $(MPIEXEC) -n $$n $(PY) experiments/zero_tables.py --out results/zero_tables_n$$n || exit 1; \
	done
	$(MPIEXEC) -n 2 $(PY) experiments/bandwidth.py --out results/bandwidth_n2
	$(MPIEXEC) -n 2 $(PY) experiments/largest_model.py --budget-mib 64 --d-model 256 \
	  --out results/largest_n2
	for n in 1 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) experiments/bench_vs_torch.py --out results/vs_torch_n$$n || exit 1; \
	done
	$(MAKE) bench-tensor
	$(MAKE) bench-pipeline
	$(MAKE) bench-recompute
	$(MAKE) bench-plan
	$(MAKE) bench-nvme
	$(MAKE) bench-onebit
	$(MAKE) bench-zeropp
	$(MAKE) bench-sparse
	$(MAKE) bench-moe
	$(MAKE) bench-llama
	$(MAKE) report
	$(PY) experiments/freshness.py  # which results are still older than their code (GPU ones)

report: $(STAMP)
	$(PY) experiments/report.py

bench-debug: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) experiments/bench_debug.py --out results/debug_n$(NP)

# Tensor against data parallelism: every dp x tp layout of 4 ranks (and sequence parallelism),
# the same GPT (101M parameters) and batch.
bench-tensor: $(STAMP)
	$(MPIEXEC) -n 4 $(PY) experiments/bench_tensor.py --n-layer 8 --d-model 1024 --n-head 16 \
	  --seq-len 128 --batch 8 --steps 5 --out results/tensor_n4

# Pipeline bubble against (p - 1) / (m + p - 1), and every dp x pp x tp layout of 4 ranks.
bench-pipeline: $(STAMP)
	$(MPIEXEC) -n 4 $(PY) experiments/bench_pipeline.py --out results/pipeline_n4

# Activation recompute: step-time overhead and activations saved per option (none, selective,
# full, ...), and the longest sequence / largest micro batch that fits a device budget; then
# the cost alone at T / d_model = 1 (GPT-2 small's is 1.33). One rank (the search also runs
# data parallel: mpiexec -n 2 ... --out results/recompute_n2).
# The GPU path: kernel launches and syncs per step counted on the CuPy stand-in (any machine),
# and on a GPU GPT-2 small's tokens/s and MFU beside PyTorch eager (the gpu and bench extras).
count-gpu: $(STAMP)
	$(PY) experiments/bench_gpu.py --count --seq-len 1024 --out results/gpu_counts

bench-gpu: bench-install
	$(PY) -m pip install -q --disable-pip-version-check -e '.[gpu]'
	ZMPI_BACKEND=cupy $(MPIEXEC) -n 1 $(PY) experiments/bench_gpu.py --batch 8 16 \
	  --peers eager compile --out results/gpu_n1

# The device check on a GPU machine without network (docs/gpu.md): `make gpu-wheels` where
# there is network downloads what it installs (about 16 MB, for GPU_PYTHON_VERSION) into
# GPU_WHEELS, git-ignored: carry that folder; there, `make gpu-check` (experiments/gpu_check.sh)
# installs them, runs the GPU tests, bench_gpu.py beside PyTorch, the kernel trace and the
# counts within 540 s, and writes summary.txt, targets.md and results.tar.gz into
# results/gpu_check (or $OUT).
GPU_WHEELS ?= experiments/gpu_wheels
GPU_PYTHON_VERSION ?= 3.12
# nvidia-cuda-crt: crt/mma.h for the tensor-core flash kernels (CuPy's cudart headers lack it);
# gpu_check.sh's DEPS is on sys.path, where zmpi.kernels.source.crt_include_dir looks.
GPU_WHEEL_PACKAGES := mpi4py==4.1.2 mpich==5.0.2 ml_dtypes==0.6.0 tqdm==4.70.1 pytest==9.2.0 \
	pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pytest-timeout==2.4.0 \
	nvidia-cuda-crt==$(CUDA13_VERSION)

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
	  --python-version $(GPU_PYTHON_VERSION) --implementation cp \
	  --abi cp$(subst .,,$(GPU_PYTHON_VERSION)) --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  -d $(GPU_WHEELS) $(GPU_WHEEL_PACKAGES)

gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) bash experiments/gpu_check.sh

bench-recompute: $(STAMP)
	$(MPIEXEC) -n 1 $(PY) experiments/bench_recompute.py --budget-mib 128 --out results/recompute_n1
	$(MPIEXEC) -n 1 $(PY) experiments/bench_recompute.py --no-search --d-model 512 --seq-len 512 \
	  --out results/recompute_t512_n1

# Block-sparse attention: the longest sequence under a device budget, step time against T and
# the loss after the same steps, dense against each DeepSpeed layout (about 15 minutes on 2
# cores): docs/sparse-attention.md
bench-sparse: $(STAMP)
	$(PY) experiments/bench_sparse_gpt.py --out results/sparse_gpt

# Mixture of experts on Tiny Shakespeare: an MoE GPT against a dense GPT of equal active
# parameters, the experts' load and drops with and without the aux loss, then step time and
# traffic against ep at 2, 4 and 8 ranks (about 3 minutes on 2 cores): docs/moe.md
bench-moe: $(STAMP)
	for n in 2 4 8; do \
	  $(MPIEXEC) -n $$n $(PY) experiments/moe_train.py --scaling --out results/moe_train || exit 1; \
	done
	$(PY) experiments/moe_train.py --out results/moe_train

# A small Llama against a GPT-2 of equal parameters on Tiny Shakespeare (about 1.5 minutes on
# 2 cores): docs/models.md
bench-llama: $(STAMP)
	$(PY) experiments/llama_vs_gpt.py --out results/llama_vs_gpt

bench-checkpoint: $(STAMP)
	$(MPIEXEC) -n $(NP) $(PY) experiments/bench_checkpoint.py --out results/checkpoint_n$(NP)

lint: $(STAMP)
	$(VENV)/bin/ruff check zmpi models experiments tests

clean:
	rm -rf $(VENV) .pytest_cache runs
