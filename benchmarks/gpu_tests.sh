#!/usr/bin/env bash
# GPU test files on the GPU machine, detached from the shell that starts it (a device call's time
# limit and its re-sync of the checkout cannot cut the run short):
#
#   setsid nohup bash benchmarks/gpu_tests.sh tests/test_vram_gpu.py tests/test_lending.py > /dev/null 2>&1 < /dev/null &
#   cat /tmp/gt/status           # setup, tests, done; the pytest log in /tmp/gt/tests.log
#
# Runs from a private copy of the tree, prepares the machine (gpu_setup.sh), then pytest over the
# files given (default: every test file), six workers, one file a worker. The summary line and the
# exit status end /tmp/gt/main.log.
set -u
logs=${GT_LOGS:-/tmp/gt}
source "$(dirname "$0")/gpu_detach.sh" /tmp/gt-tree
echo tests > "$logs/status"
files=("$@"); [ ${#files[@]} -eq 0 ] && files=(tests)
t=$(date +%s)
python3 -m pytest -q -n 6 --dist loadfile -p no:cacheprovider "${files[@]}" > "$logs/tests.log" 2>&1
rc=$?
tail -3 "$logs/tests.log"
echo "tests rc $rc in $(( $(date +%s) - t )) s"; date
echo done > "$logs/status"
