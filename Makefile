# Two commands on a fresh machine (Python 3.11+):
#   make demo   create .venv if needed, install ktflow, run the demo
#   make test   same install, run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ktflow-installed

.PHONY: install demo test native-test clean

install: $(STAMP)

# The venv also sees the packages of the Python that made it (listed in a .pth file, after its own;
# this works when that Python is itself a venv), so an installed torch (a CUDA build, say) is reused. Without
# one, torch 2.13.0 (a local CPU wheel where the machine has one), else any release >= 2.5. Then
# ktflow itself, editable, with the test extra; offline (no build isolation, no index) as a fallback,
# taking missing wheels from PIP_FIND_LINKS.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ktflow needs Python 3.11+, $(PYTHON) is " + sys.version.split()[0])'
	@test -x $(PY) || { $(PYTHON) -m venv $(VENV) && $(PYTHON) -c 'import site; print("\n".join(site.getsitepackages()))' \
	    > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_ktflow_parent_site.pth"; }
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q 'torch==2.13.0' || $(PY) -m pip install -q 'torch>=2.5'
	$(PY) -m pip install -q -e '.[test,serve]' || $(PY) -m pip install -q --no-build-isolation --no-index -e '.[test,serve]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ktflow demo

# The suite in TEST_WORKERS processes (pytest-xdist), each test file on one of them (its module
# fixtures made once); conftest.py gives each worker one OpenMP thread.
TEST_WORKERS ?= 2
test: $(STAMP) native-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The native tests (no Python) built with AddressSanitizer + UndefinedBehaviorSanitizer, each
# file with the baseline flags (the ISA kernels name their instructions in a pragma), then run.
CXX       ?= g++
ASAN      := build/asan
ASANFLAGS := -std=c++17 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
             -Inative/include -pthread
NATIVE_SRC := $(filter-out native/src/bindings.cpp,$(wildcard native/src/*.cpp)) native/tests/test_native.cpp
NATIVE_OBJ := $(patsubst %.cpp,$(ASAN)/%.o,$(notdir $(NATIVE_SRC)))

$(ASAN)/%.o: native/src/%.cpp $(wildcard native/include/ktf/*.h)
	@mkdir -p $(ASAN)
	$(CXX) $(ASANFLAGS) -c $< -o $@

$(ASAN)/test_native.o: native/tests/test_native.cpp $(wildcard native/include/ktf/*.h)
	@mkdir -p $(ASAN)
	$(CXX) $(ASANFLAGS) -c $< -o $@

$(ASAN)/test_native: $(NATIVE_OBJ)
	$(CXX) $(ASANFLAGS) $^ -ldl -o $@

native-test: $(ASAN)/test_native
	ASAN_OPTIONS=detect_leaks=1 $(ASAN)/test_native

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# benchmarks/RESULTS.md from the benchmarks' JSONL rows and benchmarks/SUMMARY.md.
.PHONY: results
results: $(STAMP)
	$(PY) benchmarks/results.py
