#!/usr/bin/env bash
# Issue 42, deliverable 5, on the GPU machine (one H100/H200, 16 cores, 128 GB RAM, 64 GB disk):
# ktflow and llama.cpp at a VRAM limit the size of a consumer GPU, greedy and sampled decoding,
# full model depth: Qwen3-30B-A3B (48 layers, FP8 checkpoint against a Q8_0 GGUF) at 24 GB, then
# DeepSeek-V2-Lite (27 layers) at 16 GB. One model's checkpoint and its GGUF do not fit the disk
# together (31 + 32 GB for Qwen3), so each model runs llama.cpp first on a GGUF written straight
# with random weights (benchmarks/gguf_synth.py), deletes it, then writes the checkpoint and runs
# ktflow. Every row is appended to $JSONL as it is measured: a run cut short keeps what it measured.
#
# Carry (ignored paths; name them in the device call's carry): .whl (wheels the machine lacks:
# ../shared/tools/device-wheels.sh pybind11), .carry (llama/ with the prebuilt llama-bench parts,
# llama-src.tgz, gguf-convert.py, tiny-tokenizer.py). Launch from the repository root:
#   setsid nohup bash benchmarks/user_configs.sh > /tmp/uc.log 2>&1 < /dev/null &
# and poll with: tail -30 /tmp/uc.log; cat /tmp/uc/status; cp /tmp/uc/* $OUT/
#
# Knobs: RUN_ID, JSONL (default /tmp/uc/user_configs.jsonl: outside the tree, which a later
# device call may copy over), MODELS ("qwen3 dsv2lite"), FIT=1 (also llama.cpp's own fitter),
# DEPTH (decode also after a prompt this long, both sides; default 32768, "" for none), DS_CKPT
# (DeepSeek-V2-Lite's checkpoint arguments, default --fp8), KTFLOW_COMMIT (the rows' commit where
# the tree has no .git), LLAMA=0 (ktflow only: no llama.cpp rows), CPU_EXPERTS=0 (no experts-on-CPU
# prefill rows), RESERVES ("1.5 1.0": the user phase again at each vram_reserve_gb, its own run id),
# DESIGNS ("reserve": the user phase again with that prefill_reserve, its own run id).
# Estimates (H100 host; disk and packing rates guessed, see the report): setup 1.5 min; per
# model: Qwen3 GGUF 2.5 + llama.cpp 4 + checkpoint 2.5 + ktflow 4 + experts-on-CPU 1.5 = ~15 min;
# DeepSeek-V2-Lite about 9 min.
set -u
cd "$(dirname "$0")/.."
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)}
export KTFLOW_CACHE_DIR=off   # no packed copy of the experts on disk: it would not fit beside the checkpoint
export KTFLOW_QUIET=1 PYTHONUNBUFFERED=1
CARRY=${CARRY:-.carry}
JSONL=${JSONL:-/tmp/uc/user_configs.jsonl}
MODELS=${MODELS:-"qwen3 dsv2lite"}
FIT=${FIT:-0}
DEPTH=${DEPTH:-32768}   # decode also after a prompt this long (an agent's), both sides (llama-bench -d)
E2E=/tmp/ktflow-e2e
mkdir -p /tmp/uc "$E2E"
status() { echo "$(date +%T) $*" | tee -a /tmp/uc/status; }
step() {  # step NAME COMMAND...: run it, note how it went and how long it took, go on either way
  local name=$1 step_started=$SECONDS; shift
  status "start $name (disk free $(df -BG --output=avail "$E2E" | tail -1 | tr -d ' '))"
  "$@"; local rc=$?
  status "end $name rc=$rc in $((SECONDS - step_started)) s"
  return $rc
}
# the carried prebuilt llama-bench is llama.cpp 0c1e5709 (../shared/ANCHORS.md) and reports "unknown"
LL=(--llama "$CARRY/llama" --llama-src "$CARRY/llama-src.tgz" --tools "$CARRY" --run-id "$RUN_ID" --out "$JSONL"
    --llama-commit "${LLAMA_COMMIT:-0c1e5709}")
UC=(--run-id "$RUN_ID" --out "$JSONL")

status "run $RUN_ID on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
step setup source benchmarks/gpu_setup.sh                                          # ~1-1.5 min
step llama-unpack python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import llama_cpp, pathlib; print(llama_cpp.llama_bench(pathlib.Path('$CARRY/llama')))"

for m in $MODELS; do
  case $m in
    qwen3) V=24; FP8=--fp8 ;;
    dsv2lite) V=16; FP8=${DS_CKPT:---fp8} ;;   # DS_CKPT="--expert-format int8": bf16 checkpoint, int8 experts
    *) status "unknown model $m"; continue ;;
  esac
  fit=(); [ "$FIT" = 1 ] && fit=(--fit)
  # llama.cpp: the GGUF (template converted, then synthesized: Qwen3 ~2.5 min, DeepSeek ~1.5), then
  # prompt processing at 8192 / 32768 tokens at -ub 512 (8192 only) / 2048 / 4096 and tg128 at 14-16
  # threads, each test's -ncmoe chosen for the limit (Qwen3 ~4 min, DeepSeek ~3); then the tests again at
  # one server configuration's -ncmoe (the longest prompt's at the largest -ub: ~2 min)
  [ "${LLAMA:-1}" = 1 ] && step "$m llama.cpp" python3 benchmarks/llama_user.py --model "$m" --vram-gb $V --decode-depth "$DEPTH" \
      "${LL[@]}" "${fit[@]}"
  rm -f "$E2E/$m.q8_0-random.gguf"; sync
  # ktflow: the FP8 checkpoint (Qwen3 31 GB ~2.5 min, DeepSeek 16 GB ~1.5), then at the limit:
  # prefill (and one traced prompt a length: /tmp/uc/<model>-prefill<n>.trace.json), greedy / one-step /
  # sampled decode, VRAM; the decode-only placement beside it (~4 min)
  step "$m ktflow at $V GB" python3 benchmarks/user_configs.py --model "$m" $FP8 --vram-gb $V \
      --decode-depth "$DEPTH" --phases user,decode-only --trace-dir /tmp/uc "${UC[@]}"
  # the user phase again with one option changed, its own run id <run>-<tag> and report (~2.5 min each):
  # each of $RESERVES (vram_reserve_gb, e.g. "1.5 1.0": what a smaller reserve gives decode and whether
  # the run still keeps to the limit), each of $DESIGNS (prefill_reserve forced, e.g. "reserve" beside
  # the time-share design the VRAM plan now chooses)
  again() {  # again TAG OPTIONS_JSON
    step "$m ktflow at $V GB, $1" python3 benchmarks/user_configs.py --model "$m" $FP8 --vram-gb $V \
        --decode-depth "$DEPTH" --phases user --options "$2" --run-id "$RUN_ID-$1" --out "$JSONL"
    python3 benchmarks/user_report.py --run-id "$RUN_ID-$1" --jsonl "$JSONL" > "/tmp/uc/report-$1.md"
  }
  for r in ${RESERVES:-}; do again "reserve$r" "{\"vram_reserve_gb\": $r}"; done
  for d in ${DESIGNS:-}; do again "$d" "{\"prefill_reserve\": \"$d\"}"; done
  # the same prefill with every expert in CPU memory and VRAM free, its own process (~1.5 min)
  [ "${CPU_EXPERTS:-1}" = 1 ] && step "$m ktflow experts on CPU" python3 benchmarks/user_configs.py --model "$m" $FP8 --vram-gb $V \
      --phases cpu-experts "${UC[@]}"
  rm -rf "$E2E/$m-fp8" "${E2E:?}/$m"; sync
done
python3 benchmarks/user_report.py --run-id "$RUN_ID" --jsonl "$JSONL" | tee /tmp/uc/report.md
status "done $RUN_ID"
