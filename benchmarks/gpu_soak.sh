#!/usr/bin/env bash
# Issue 46's chaos soak on a GPU machine, detached from the shell that starts it:
#
#   setsid nohup bash benchmarks/gpu_soak.sh 1500 > /dev/null 2>&1 < /dev/null &
#   cat /tmp/soak/status        # setup, soak, done; logs and serve_load.jsonl in /tmp/soak
#
# It runs from a private copy of the tree (a tool that re-syncs the checkout under it cannot
# break it), prepares the machine (gpu_setup.sh), builds the 12-layer Qwen3-30B-A3B-shaped FP8
# checkpoint if absent, and runs serve_load.py --soak SECONDS --chaos at 8 streams on the GPU.
set -u
seconds=${1:-1500}
logs=${SOAK_LOGS:-/tmp/soak}
source "$(dirname "$0")/gpu_detach.sh" /tmp/soak-tree
ckpt=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from e2e import bench_checkpoint; print(bench_checkpoint(False, "qwen3", 12, True, None)[0])' | tail -1)
echo "checkpoint $ckpt"
echo soak > "$logs/status"
python3 benchmarks/serve_load.py --checkpoint "$ckpt" --hw this --device cuda --streams 1 --requests 1 \
  --soak "$seconds" --soak-streams 8 --chaos --out "$logs/serve_load.jsonl" > "$logs/soak.log" 2>&1
echo "soak rc $?"; date
echo done > "$logs/status"
