#!/usr/bin/env python3
"""Prints the overlap results of bench/cuda_bench.py (--json files) as a Markdown table:
step time (with --rounds, the median and each round's),
ratio to max(GPU forward+backward, CPU Adam), optimizer passes after backward and the
exposed wait of the next forward, per mode.

  python3 bench/overlap_table.py out/cuda_balanced.json [more.json ...]
"""
import argparse
import json

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("json", nargs="+", help="a --json file of bench/cuda_bench.py")
for path in ap.parse_args().json:
    d = json.load(open(path))["overlap"]
    print(f"\n{path}: GPU forward+backward {d['gpu_fwd_bwd_ms']} ms, CPU Adam {d['cpu_adam_ms']} ms\n")
    print("| mode | step (ms) | x max(GPU, CPU Adam) | elements after step() | forward wait (ms) | "
          "kept / rescaled / stepped / cancelled / on GPU | GPU bytes |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, v in d.items():
        if not isinstance(v, dict):
            continue
        counts = f"{v['kept']} / {v['rescaled']} / {v['stepped']} / {v['cancelled']} / {v['device_stepped']}"
        rounds = v.get("step_ms_rounds", [])
        step = f"{v['step_ms']} ({', '.join(map(str, rounds))})" if len(rounds) > 1 else v["step_ms"]
        print(f"| {name} | {step} | {v['vs_max_gpu_adam']} | {v['final_pass_elements']:,} | "
              f"{v['forward_wait_ms_mean']} | {counts} | {v['device_bytes']:,} |")
    for k, v in d.items():
        if "_over_" in k:
            print(f"- {k}: {v}")
