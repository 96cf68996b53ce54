# Two commands do all set-up on a fresh machine (Python 3.11, pip, gcc):
#   make demo   - DLRM on synthetic Criteo-shaped data, torchrec's EBC vs ours, side by side
#   make test   - the test suite (Triton kernels under TRITON_INTERPRET=1), minutes-long checks left out
#   make test-slow - those long checks: the sm_90 compile of every kernel variant, the nvcc builds, ...
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-v1
BUILT   := $(VENV)/.built
PYTEST_ARGS ?=

.PHONY: demo test test-slow install redis clean

$(STAMP): requirements-cpu.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip "setuptools>=70.1"
	# The CPU build of torch lies on disk; install it first so nothing pulls a CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q fbgemm-gpu-cpu==1.8.0
	# torchrec requires `fbgemm-gpu` (a CUDA build): install it without deps, then its other deps.
	$(VPY) -m pip install -q --no-deps torchrec==1.8.0
	$(VPY) -m pip install -q -r requirements-cpu.txt
	touch $(STAMP)

# Our package, editable, with its native code built now (setup.py): the parameter-server library
# here; the CUDA kernels only where torch has CUDA (this CPU torch skips them, saying so).
# --no-build-isolation: the build uses the torch installed above. Rebuilt when csrc/ changes.
$(BUILT): $(STAMP) setup.py recom_rec/native_build.py $(wildcard csrc/*/*.c csrc/*/*.h csrc/*/*.cu)
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(BUILT)

install: $(BUILT)

# A real redis-server for the parameter-server tests (Debian's package, built with TLS) when it is
# missing, and the openssl command the rediss:// test makes its certificates with.
redis:
	@{ command -v redis-server && command -v openssl; } >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q redis-server openssl; }

test: $(BUILT) redis
	TRITON_INTERPRET=1 $(VPY) -m pytest -q tests $(PYTEST_ARGS)

# The checks marked `slow` (pytest.ini): `-m slow` here overrides the `-m "not slow"` there.
test-slow: $(BUILT) redis
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -m slow tests $(PYTEST_ARGS)

demo: $(BUILT)
	$(VPY) examples/dlrm_demo.py
	@echo
	@echo "Again, with our module's large tables in the parameter-server tier (in-process store):"
	$(VPY) examples/dlrm_demo.py --ps memory://demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
	find recom_rec -name '*.so' -delete
