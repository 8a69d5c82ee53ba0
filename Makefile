# ibp_embed: `make` builds the native library and the virtual environment;
# `make demo`, `make test`, `make bench` set up what they need themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := native/build
LIB := $(BUILD)/libibp.so
CUDA_LIB := $(BUILD)/libibp_cuda.so

CC ?= gcc
# Warnings stop the build here (CI keeps -Werror). Another machine's compiler may
# warn where this one does not: `make WERROR=` (or WERROR= in the environment)
# builds there without -Werror; benchmarks/gpu_check.sh does so on the GPU machine.
WERROR ?= -Werror
# No implicit fused multiply-adds: results must not depend on the ISA or -O level
# (weighted pooling uses fmaf explicitly, as FBGEMM does).
CFLAGS_LIB := -O3 -std=gnu11 -fPIC -fopenmp -pthread -ffp-contract=off -Wall -Wextra $(WERROR) -Wno-unused-function
NVCC := $(shell command -v nvcc 2>/dev/null)
# fbgemm must match torch 2.13.0 exactly (GUIDE section 3): the CPU build unless a GPU driver is present.
FBGEMM := $(if $(shell command -v nvidia-smi 2>/dev/null),fbgemm-gpu==1.8.0,fbgemm-gpu-cpu==1.8.0)

HEADERS := $(wildcard native/*.h) native/ibp_rowcodec.inc native/ibp_spans.inc native/ibp_prefetch.inc native/ibp_lookup.inc native/ibp_dedup.inc native/ibp_pool.inc native/ibp_optim.inc native/ibp_avx512_plan.inc native/ibp_avx512_runs.inc native/ibp_avx512_fields.inc native/ibp_group_decode.inc native/ibp_units_avx2.inc

.PHONY: all lib cuda venv demo test bench sanitize clean
all: lib cuda venv

lib: $(LIB)

# The CUDA library links cudart statically, so it loads on machines without a GPU
# and reports "no CUDA device" at run time. Skipped where nvcc is absent.
CUDA_SRC := $(wildcard native/cuda/*.cu)
CUDA_HDR := $(wildcard native/cuda/*.cuh) native/ibp_bits.h native/ibp.h
NVCCFLAGS := -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static \
	-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
ifneq ($(NVCC),)
ifneq ($(CUDA_SRC),)
cuda: $(CUDA_LIB)
else
cuda:
endif
else
cuda:
	@echo "nvcc not found: skipping the CUDA library"
endif
$(CUDA_LIB): $(CUDA_SRC) $(CUDA_HDR) | $(BUILD)
	$(NVCC) $(NVCCFLAGS) -Inative $(CUDA_SRC) -o $@

$(BUILD)/ibp.o: native/ibp.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -c $< -o $@
$(BUILD)/store.o: native/ibp_store.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -c $< -o $@
$(BUILD)/store_backward.o: native/ibp_store_backward.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -c $< -o $@
$(BUILD)/isa_generic.o: native/ibp_isa_generic.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -c $< -o $@
# Only called after a run-time CPU check, so the library still loads on older CPUs.
$(BUILD)/isa_v3.o: native/ibp_isa_v3.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -march=x86-64-v3 -c $< -o $@
$(BUILD)/isa_v3_no_pdep.o: native/ibp_isa_v3.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -march=x86-64-v3 -DIBP_V3_NO_PDEP -c $< -o $@
$(BUILD)/isa_avx512.o: native/ibp_isa_avx512.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_LIB) -march=x86-64-v4 -mavx512vbmi -mavx512vbmi2 -mavx512vpopcntdq -mavx512bitalg -c $< -o $@
$(LIB): $(BUILD)/ibp.o $(BUILD)/store.o $(BUILD)/store_backward.o $(BUILD)/isa_generic.o $(BUILD)/isa_v3.o $(BUILD)/isa_v3_no_pdep.o $(BUILD)/isa_avx512.o
	$(CC) -shared -fopenmp -pthread $(LDFLAGS_LIB) $^ -o $@ -lm
$(BUILD):
	mkdir -p $@

venv: $(VENV)/.stamp
$(VENV)/.stamp: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt $(FBGEMM)
	# torchrec pins the CUDA fbgemm-gpu, which breaks CPU-only torch: install it alone.
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: all
	$(PY) -m ibp_embed.demo
	$(PY) -m dlrm_example.demo

test: all
	$(PY) -m pytest -q tests
	# TorchRec's own tests with the IBP module substituted (tests/torchrec_suite/conftest.py)
	PYTHONPATH=tests/torchrec_suite/shim $(PY) -m pytest -q -c tests/torchrec_suite/pytest.ini \
		--rootdir tests/torchrec_suite tests/torchrec_suite

# The lookups judge issue 11's targets on the median of three runs (a single run moved a
# line by up to 0.16x); --quick, or a --runs of ARGS, keeps its own count. LOOKUP_ARGS overrides.
LOOKUP_ARGS ?= $(if $(filter --quick --runs%,$(ARGS)),,--runs 3)
bench: all
	$(PY) -m benchmarks.lookup $(ARGS) $(LOOKUP_ARGS)
	$(PY) -m benchmarks.codec $(ARGS)
	$(PY) -m benchmarks.training $(ARGS)

# libibp built with AddressSanitizer and UBSan (any finding aborts), and the tests of
# the native codec, lookups, stores and the file checks run against it. Python is not
# instrumented, so the sanitizer runtimes are preloaded.
SAN_BUILD := native/build-sanitize
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
sanitize: venv
	$(MAKE) --no-print-directory lib BUILD=$(SAN_BUILD) LDFLAGS_LIB="$(SAN_FLAGS)" \
		CFLAGS_LIB="$(subst -O3,$(SAN_FLAGS),$(CFLAGS_LIB))"
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 IBP_LIBRARY=$(SAN_BUILD)/libibp.so \
		$(PY) -m pytest -q --capture=sys -p no:cacheprovider tests/test_codec.py tests/test_decode_plans.py tests/test_lookup.py \
		tests/test_moved_words.py tests/test_rows_from_memory.py tests/test_raw_tables.py tests/test_reference.py \
		tests/test_hardening.py tests/test_store.py tests/test_thread_buffers.py tests/test_packed_jobs.py \
		tests/test_batched.py

clean:
	rm -rf $(BUILD) $(SAN_BUILD) $(VENV) .pytest_cache .hypothesis
