#!/usr/bin/env bash
# Decode and prefill speed of two ktflow trees in one run, alternating A B B A so that the
# machine's drift falls on both alike (issue 43's check that the re-housing changed no speed).
# GPU machine; each tree builds its own native module in place and runs its own benchmarks/e2e.py
# with the same arguments: by default the Qwen3-30B-A3B shape cut to 12 layers, bf16, every routed
# expert on the CPU, the graph decode variant (greedy, 128 tokens) and the auto prefill of 8192
# tokens. Rows go to $JSONL with each tree's commit tagged with this run (COMMIT@ab-<time>); the
# table of this run's means and the B/A ratios last.
#
#   git archive 3fdf57a | (mkdir -p .carry/before && tar -x -C .carry/before)   # here, before the lease
#   bash benchmarks/ab_commits.sh .carry/before 3fdf57a . "$KTFLOW_COMMIT"        # there, after gpu_setup.sh
#
# Knobs: JSONL (default /tmp/uc/ab_commits.jsonl), E2E_ARGS (the e2e.py arguments), ROUNDS (2: A B B A).
set -u
[ $# -eq 4 ] && [ -n "$2" ] && [ -n "$4" ] || { echo "usage: $0 TREE_A COMMIT_A TREE_B COMMIT_B (commits non-empty)" >&2; exit 2; }
A=$(cd "$1" && pwd); CA=$2; B=$(cd "$3" && pwd); CB=$4
JSONL=${JSONL:-/tmp/uc/ab_commits.jsonl}
case $JSONL in /*) ;; *) JSONL=$PWD/$JSONL ;; esac  # each run works in its own tree
RUN=ab-$(date +%Y%m%d-%H%M%S)  # this run's rows only, however full the file
ROUNDS=${ROUNDS:-2}
E2E_ARGS=${E2E_ARGS:-"--model qwen3 --layers 12 --variants graph --prompts 32 --prefill 8192 --prefill-variants auto --reps 3 --prefill-reps 3 --decode 128"}
mkdir -p "$(dirname "$JSONL")"
# pyproject maps the package ktflow.models to the top-level models/ folder: an editable install of
# another tree would answer that import for a tree run from its folder, so each tree gets a link to
# its own (removed at the end)
links=()
trap 'for l in "${links[@]}"; do rm -f "$l"; done' EXIT
for t in "$A" "$B"; do
  if [ -d "$t/models" ] && [ ! -e "$t/ktflow/models" ]; then ln -s ../models "$t/ktflow/models"; links+=("$t/ktflow/models"); fi
done
for t in "$A" "$B"; do  # each tree's own native module (a minute or so on 16 cores)
  (cd "$t" && python3 setup.py -q build_ext --inplace > /tmp/ab-build.log 2>&1) \
    || { echo "native build failed in $t: see /tmp/ab-build.log" >&2; exit 1; }
done
run() {  # run TREE COMMIT: one e2e.py of that tree, its rows tagged with the commit
  echo "$(date +%T) e2e.py of $2 ($1)"
  (cd "$1" && KTFLOW_COMMIT=$2@$RUN PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" \
     python3 benchmarks/e2e.py $E2E_ARGS --out "$JSONL") || echo "e2e.py of $2 failed ($?)"
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then run "$A" "$CA"; run "$B" "$CB"; else run "$B" "$CB"; run "$A" "$CA"; fi
done
python3 - "$JSONL" "$CA@$RUN" "$CB@$RUN" <<'EOF'
import json, statistics, sys
path, ca, cb = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if line.strip()]
def key(r):  # a measured quantity: decode tok/s of a variant, or prefill tok/s of a mode and length
    if "decode_tok_s" in r and r.get("variant"):
        return f"decode {r['variant']}", r["decode_tok_s"]
    if "tok_s" in r and r.get("prompt") and r.get("table") == "prefill":
        return f"prefill {r.get('system', '')} {r['prompt']}", r["tok_s"]
    return None, None
got = {}
for r in rows:
    k, v = key(r)
    if k and r.get("commit") in (ca, cb):
        got.setdefault(k, {}).setdefault(r["commit"], []).append(v)
print(f"\n| measure | {ca} (A) | {cb} (B) | B / A |\n|---|---|---|---|")
for k, by in sorted(got.items()):
    a, b = by.get(ca, []), by.get(cb, [])
    ma, mb = (statistics.mean(x) if x else None for x in (a, b))
    ratio = f"{mb / ma:.3f}" if ma and mb else "—"
    fmt = lambda m, x: "—" if m is None else f"{m:.2f} (n={len(x)})"  # noqa: E731
    print(f"| {k} | {fmt(ma, a)} | {fmt(mb, b)} | {ratio} |")
EOF
