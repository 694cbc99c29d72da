#!/usr/bin/env bash
# Prepare a bare GPU machine (no internet) to run ktflow's GPU tests and benchmarks from this
# checkout: the Python packages it lacks, from wheels carried in .whl/ (made on a machine with
# internet by ../shared/tools/device-wheels.sh pybind11 hypothesis sortedcontainers pytest-xdist
# execnet starlette uvicorn click h11 prometheus_client openai anthropic httpx httpx2 httpcore anyio
# sniffio distro jiter idna certifi docstring-parser; that script's platform tags find llguidance
# 1.6 only, which refuses a list of eos ids: fetch llguidance>=1.9 with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64`),
# then ktflow installed editable, which compiles native/ into ktflow._native (about a minute on 16 cores).
#
#   source benchmarks/gpu_setup.sh      # sets PYTHONPATH for the shell that sources it
#
# Idempotent: a second source in the same lease only re-exports PYTHONPATH and rebuilds what changed.
set -e
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.ktflow-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.ktflow-wheels
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v '^WARNING' || true
python3 -c 'import ktflow, ktflow._native' || { echo "gpu_setup: ktflow did not install" >&2; return 1 2>/dev/null || exit 1; }
echo "gpu_setup: ktflow installed in $(( $(date +%s) - t0 )) s; torch $(python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))')"
set +e
