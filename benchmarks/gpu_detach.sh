# Sourced by the detached GPU-machine scripts (gpu_soak.sh, gpu_tests.sh): status and logs in
# $logs (status "setup", the rest of the script's output in $logs/main.log), then the tree copied
# to $1 and entered (a tool that re-syncs the checkout under the run cannot break it), the
# machine prepared (gpu_setup.sh) and PYTHONPATH pointed at the copy. On a failed setup the status
# says "failed" and the script exits 1.
tree=$1
mkdir -p "$logs"
echo setup > "$logs/status"
exec > "$logs/main.log" 2>&1
export PYTHONUNBUFFERED=1
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rm -rf "$tree" && cp -a "$src" "$tree" && cd "$tree" || { echo failed > "$logs/status"; exit 1; }
date; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source benchmarks/gpu_setup.sh || { echo failed > "$logs/status"; exit 1; }
export PYTHONPATH=$tree:${PYTHONPATH:-}
