#!/usr/bin/env bash
# The libtorch Llama benchmark, four processes: superoffload::torch::AdamW ("ours") and torch's
# fused AdamW on the GPU ("fused"), each clipping every step (max_norm 1.0) and not; every
# step's time on the terminal, a JSON file per run and a summary table at the end.
#
#   scripts/bench.sh libtorch [--bin PATH] [--out DIR] [--systems ours,fused] [--max-loss-diff X]
#                             [so_llama_bench flags...]
#
# --bin: the so_llama_bench program (default: $SO_LLAMA_BENCH, else build-gpu/bench/libtorch/so_llama_bench,
# else build/bench/libtorch/so_llama_bench), built by the top-level CMake project where it finds
# Torch; --out: where the JSON files go (default out/libtorch_bench). Other flags go to every
# run (e.g. --steps 30 --batch 4; so_llama_bench --help lists them). The table gives, per
# clipping, the largest relative difference between ours' and fused's loss at any step (the same
# model, data and hyperparameters); --max-loss-diff fails the run above it (scripts/test.sh runs
# the program this way on the CPU: --device cpu on small shapes).
set -euo pipefail
bin="${SO_LLAMA_BENCH:-}"
out="out/libtorch_bench"
systems="ours,fused"
max_loss_diff=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --systems) systems="$2"; shift 2 ;;
        --max-loss-diff) max_loss_diff="$2"; shift 2 ;;
        -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -z "$bin" ]; then
    for cand in build-gpu/bench/libtorch/so_llama_bench build/bench/libtorch/so_llama_bench; do
        if [ -x "$cand" ]; then bin="$cand"; break; fi
    done
fi
[ -n "$bin" ] && [ -x "$bin" ] || { echo "bench/libtorch/run.sh: no so_llama_bench (build it, or pass --bin)" >&2; exit 2; }
mkdir -p "$out"
jsons=()
for clip in 1.0 0; do
    for system in ${systems//,/ }; do
        name="${system}_clip${clip}"
        echo "==== $system, clip $clip"
        "$bin" --system "$system" --clip "$clip" --json "$out/$name.json" ${args[@]+"${args[@]}"}
        jsons+=("$out/$name.json")
        echo
    done
done
python3 - "$max_loss_diff" "${jsons[@]}" <<'PY'
import json, math, sys
bound = float(sys.argv[1]) if sys.argv[1] else None
runs = [json.load(open(p)) for p in sys.argv[2:]]
print("| system | clipping | median s/step | mean s/step | vs fused (median) | loss vs fused (largest relative difference) |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
worst = 0.0
for r in runs:
    ref = next((x for x in runs if x["system"] == "fused" and x["clip"] == r["clip"]), None)
    ratio = f"{r['median_s'] / ref['median_s']:.3f}x" if ref else "-"
    diff = "-"
    if ref and ref is not r:
        d = max(abs(a - b) / abs(b) if math.isfinite(a - b) else math.inf for a, b in zip(r["loss"], ref["loss"]))
        worst, diff = max(worst, d), f"{d:.2e}"
    print(f"| {r['system']} | {'every step' if r['clip'] > 0 else 'none'} | {r['median_s']:.4f} | {r['mean_s']:.4f} | {ratio} | {diff} |")
if bound is not None and worst > bound:
    sys.exit(f"losses differ from fused AdamW's by {worst:.3g} relative, more than {bound:g}")
PY
echo "JSON results in $out/"
