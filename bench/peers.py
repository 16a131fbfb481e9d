#!/usr/bin/env python3
"""GPU: ours against torch AdamW, torchao, DeepSpeed (ZeRO-3 offload, SuperOffload) and FSDP2 offload, one process each

Every system trains the same transformers Llama (built from a config, no download; bf16,
activation checkpointing) on the same random tokens (fixed seed) with the same hyperparameters
(AdamW, lr 1e-5, betas 0.9/0.95, eps 1e-8, weight decay 0.1), in a process of its own (this
script with --worker), without clipping and with clipping on every step (max_grad_norm tiny):

  torch-gpu-adamw      torch.optim.AdamW(fused=True) on the GPU, bf16 parameters and moments
                       (the baseline "d": every ratio is to its uncapped row)
  ours                 SuperOffloadAdamW(model.parameters(), model=model, max_grad_norm=...),
                       the package's defaults
  ours-offload-all     ours, gpu_budget_bytes=0: everything offloaded
  ours-spec-off        ours, speculation="off", everything offloaded
  ours-defaults-spec-off  ours, the defaults but speculation="off" (GPU-resident sub-groups
                       stepped after the decision rather than during backward)
  ours-bf16-moments    ours, moment_dtype="bf16", everything offloaded
  ours-offload-all-bounded-copy  ours-offload-all with host_copy="bounded": no host copy of the
                       weights (each piece written into a bounded buffer as it is published)
  ours-bf16-moments-bounded-copy  ours-bf16-moments with host_copy="bounded"
  ours-lean            ours, gradient_home="device", host_copy="bounded": the host holds the Adam
                       state alone (gradients read back from the GPU in pieces, weights
                       published through bounded buffers)
  ours-bf16-moments-lean  ours-bf16-moments with gradient_home="device", host_copy="bounded"
  ours-budget-auto     ours, gpu_budget="auto" (under --mem-cap-gib: gpu_budget_bytes = the cap
                       less one step's peak and 1 GiB, as the automatic budget reads the GPU's
                       free memory, which torch's per-process cap does not lower)
  torchao-offload      torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW): bf16
                       parameters and moments on the CPU, fused CPU AdamW after backward; it does
                       not clip, so the clipped run scales the host gradients in a step pre-hook
                       of each per-parameter optimizer by the norm of the GPU gradients
  torchao-offload-grads  the same with offload_gradients=True (its memory mode: no gradient
                       stays on the GPU, so nothing clips; its clipped rows say so)
  ds-zero3-offload     DeepSpeed ZeRO-3, offload_optimizer {device: cpu, pin_memory: true}, AdamW
                       (DeepSpeedCPUAdam), top-level gradient_clipping
  torch-fsdp2-offload  FSDP2 fully_shard per decoder layer and at the root, with
                       CPUOffloadPolicy and MixedPrecisionPolicy(bf16 params): fused CPU AdamW on
                       f32 masters after backward, clip_grad_norm_ on the CPU
  torch-fsdp2-gpu-adamw  FSDP2 as above on bf16 parameters, no offload: torch AdamW(fused) on the
                       GPU shards (the baseline of --ranks above 1)
  ours-fsdp2           FSDP2 as above on bf16 parameters, SuperOffloadAdamW's defaults stepping
                       each rank's shards on that rank's share of the cores
  ours-fsdp2-offload   FSDP2 with CPUOffloadPolicy and MixedPrecisionPolicy(bf16 params, no
                       reduce dtype) as torch-fsdp2-offload: SuperOffloadAdamW steps the f32 host
                       shards in place during backward; on one rank the bf16 gradients are taken
                       before FSDP2 reduces them, and each layer's gather waits for its final pass
  ours-fsdp2-offload-bf16-moments  ours-fsdp2-offload with moment_dtype="bf16"
  ours-fsdp2-bf16-offload  the same on bf16 shards (the model built in bf16): the session keeps
                       f32 master weights and writes the shards FSDP2 gathers as the weights'
                       copy, ahead of the rest of the step
  ours-fsdp2-bf16-offload-bf16-moments  ours-fsdp2-bf16-offload with moment_dtype="bf16"
  ds-superoffload      DeepSpeed ZeRO-3 + offload_optimizer.super_offload, as DeepSpeed's
                       SuperOffload examples configure it (ratio 0.9, cpuadam_cores_perc 0.9,
                       sub_group_size = reduce_bucket_size = 4e8, overlap_comm off)

Models: 1.1b (TinyLlama's shape: 22 x 2048, intermediate 5632, 32 heads, 4 KV heads, batch 16 x
seq 2048 = 32K tokens a step), 2.8b (26 x 3072, intermediate 8192, 24 heads, 8 KV heads, batch 8
x 2048 = 16K tokens), and for capacity 7b (Llama-2-7B's shape: 32 x 4096, intermediate 11008),
8b (Llama-3-8B's: 32 x 4096, intermediate 14336, 8 KV heads, a 128K vocabulary), 10b (48 x
4096) and 13b (Llama-2-13B's: 40 x 5120, intermediate 13824), each batch 8 x 2048 (--batch
overrides it); tiny (2 x 64, for --device cpu: the harness, no numbers). Models are built in
bf16 on the GPU directly (no f32 copy at init).

--ranks N (N > 1; the three FSDP2 systems only) starts every worker as N processes, one per GPU
(NCCL; gloo with --device cpu), each on its own data: the tables then hold N times the tokens a
step, and their baseline is torch-fsdp2-gpu-adamw with as many ranks.

Per row: the median s/step of --steps timed steps after --warmup, its ratio to the uncapped
baseline row of the same model, clipping and ranks, model TFLOPS ((6 N + 12 layers hidden seq)
tokens / s, recomputation not counted), GPU memory as torch's peak (allocated) plus the device
bytes our session holds outside torch's allocator (metrics()["device_bytes"]; 0 for the others,
whose GPU memory is all torch's; the largest of the ranks), the worker's peak host RSS (and per
parameter), rank 0's loss after the last step, and the error of a failed run (a worker the
kernel kills for host memory is a row too). With --mem-cap-gib each worker first calls
torch.cuda.set_per_process_memory_fraction, and ours, once its session has provisioned, lowers
that fraction by the session's device bytes, so that torch's allocations and the session's
share the cap; an out-of-memory error is a result (status oom), not a crash. With several
models, peers.md ends with the capacity table: per system and cap, the largest model that ran.
A system that errs or times out is not run again for the later models and caps
(--retry-failed runs it anyway).

The clipped run follows the unclipped one in the same process (DeepSpeed: its ZeRO optimizer's
clip_grad, which gradient_clipping sets, is switched between the runs). Before the timed steps:
ours with an automatic split steps until the split has settled, and ours with speculation auto
takes the steps after which it stops speculating on clipped steps (bench_e2e.py's constants);
--no-settle times the steps right after --warmup instead (how soon the defaults settle).

Workers run in the order the targets need them: the baselines, ours everything offloaded, ours
with the automatic budget, torchao, ours with speculation off, ours' defaults, bf16 moments,
the lean placements, DeepSpeed ZeRO-3, FSDP2, SuperOffload; each system for every model and cap in turn. --budget-s
(default 480 s) starts no worker after that and leaves 'skipped' rows: a second command with
--systems for the rest and --baseline (the first run's peers.json, for its torch-gpu-adamw rows)
completes the tables.

  python3 bench/peers.py                                   # both models, every system (see --budget-s)
  python3 bench/peers.py --systems ds-zero3-offload,torch-fsdp2-offload --baseline first/peers.json
  python3 bench/peers.py --models 2.8b --mem-cap-gib 24,48 \\
      --systems torch-gpu-adamw,ours-offload-all,ours-budget-auto,torchao-offload,ds-zero3-offload
  python3 bench/peers.py --models 2.8b --ranks 2 --systems torch-fsdp2-gpu-adamw,ours-fsdp2
  python3 bench/peers.py --device cpu --models tiny --systems torch-gpu-adamw,ours   # CPU dry run
  python3 bench/peers.py --device cpu --models tiny --ranks 2 --systems torch-fsdp2-gpu-adamw,ours-fsdp2

Writes peers.json, peers.md (one table per model and cap) and peers.log (every worker's output)
to --out (default $OUT/peers, else bench-out/peers), after every worker, and prints the tables.
Needs torch, transformers and the superoffload package; torchao and DeepSpeed for their rows
(bench/peers_setup.sh installs them from carried wheels on the GPU machine).
"""
import argparse
import os
import sys

import torch

from peers_runner import runner_main
from peers_systems import MODELS, SYSTEMS
from peers_worker import worker_main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--systems", default="all", help="comma list of the systems above, or all (default)")
    ap.add_argument("--models", default="1.1b,2.8b",
                    help="comma list of 1.1b, 2.8b, 7b, 8b, 10b, 13b, tiny (default 1.1b,2.8b)")
    ap.add_argument("--batch", type=int, default=0, help="sequences a step, for every model (default: the model's)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="backward passes a step, each over an equal part of the batch, for every system that "
                         "accumulates (default 1; under a memory cap the same for every system)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0,
                    help="every system: the vocabulary projection and the cross-entropy taken this many tokens "
                         "at a time, each piece recomputed in backward (default 0: transformers' loss over the "
                         "whole batch's logits; 8 B's 128K vocabulary under a 16 GiB cap needs pieces)")
    ap.add_argument("--clip", choices=("none", "every", "both"), default="both",
                    help="runs without clipping, clipping every step, or both (default)")
    ap.add_argument("--clip-max-norm", type=float, default=1e-3,
                    help="max_grad_norm of the clipped runs: tiny, so that every step clips (default 1e-3)")
    ap.add_argument("--mem-cap-gib", default="none",
                    help="comma list of GPU memory caps in GiB, none for uncapped (default none), e.g. none,24,48")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    ap.add_argument("--no-settle", action="store_true",
                    help="time the steps right after --warmup: no settling of ours' automatic split or speculation "
                         "first (how fast the defaults settle: compare --warmup 3 with --warmup 10)")
    ap.add_argument("--timeout-s", type=float, default=240, help="one worker's limit (default 240)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="stop starting workers when this many seconds have passed (default 480, so that "
                         "the run and bench/peers_setup.sh fit in one 10-minute command; 0: no limit); the "
                         "ones left become 'not run' rows")
    ap.add_argument("--min-worker-s", type=float, default=45,
                    help="with --budget-s: start no worker with less than this left (default 45)")
    ap.add_argument("--baseline", metavar="PEERS_JSON",
                    help="take the uncapped torch-gpu-adamw rows from an earlier run's peers.json instead of "
                         "running them")
    ap.add_argument("--no-baseline", action="store_true",
                    help="run no baseline (capacity runs of models it cannot train; the rows have no ratio)")
    ap.add_argument("--retry-failed", action="store_true",
                    help="run a system again for the later models and caps after it failed")
    ap.add_argument("--ranks", type=int, default=1,
                    help="processes (GPUs) per worker, FSDP2 systems only above 1 (default 1)")
    ap.add_argument("--trace", action="store_true",
                    help="ours' systems: save the session's timeline of the timed steps "
                         "(trace_<system>_<model>_<cap>_<clip>.json beside peers.json; bench/trace_plot.py "
                         "renders it) and add each timed step's metrics() to the row (step_metrics)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the harness (with --models tiny), no numbers")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "bench-out", "peers"),
                    help="output directory (default $OUT/peers, else bench-out/peers)")
    worker = ap.add_argument_group("worker mode (the runner starts these)")
    worker.add_argument("--worker", choices=list(SYSTEMS), help="run this system")
    worker.add_argument("--model", choices=list(MODELS))
    worker.add_argument("--cap-gib", type=float, default=0)
    worker.add_argument("--clips", type=lambda s: [float(c) for c in s.split(",")])
    worker.add_argument("--result", help="where the worker writes its rows (JSON)")
    worker.add_argument("--trace-dir", help="with --trace: where the worker writes its timelines")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.ranks < 1 or args.loss_chunk_tokens < 0:
        ap.error("--steps and --ranks must be >= 1, --warmup and --loss-chunk-tokens >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --device cpu --models tiny for a dry run")
    if args.worker:
        if not (args.model and args.clips and args.result):
            ap.error("--worker needs --model, --clips and --result")
        return worker_main(args)
    return runner_main(args)


if __name__ == "__main__":
    sys.exit(main())
