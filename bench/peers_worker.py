"""bench/peers.py's worker (--worker): one system, one model, one cap; the clip settings in turn,
its rows written as JSON for the runner."""
import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback

import torch

from peers_systems import E2E_DIR, GIB, SYSTEMS, Context, Unsupported, log


def model_flops_per_token(spec, params):
    """Model FLOPs per token of a training step: 6 N plus the attention's 12 layers hidden seq
    (recomputation not counted)."""
    return 6 * params + 12 * spec["layers"] * spec["hidden"] * spec["seq"]


def is_oom(exc):
    text = str(exc).lower()
    # torch's allocator, CUDA's runtime ("out of memory") and driver (CUDA_ERROR_OUT_OF_MEMORY).
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "out_of_memory" in text


def error_text(exc):
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def package_versions():
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "superoffload", "torchao", "deepspeed"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    return versions


def worker_main(args):
    sys.path.insert(0, E2E_DIR)
    ctx = Context(args.model, batch=args.batch, device=args.device, cap_gib=args.cap_gib, clips=args.clips,
                  settle=not args.no_settle, micro_batches=args.micro_batches,
                  loss_chunk_tokens=args.loss_chunk_tokens)
    if ctx.cuda and ctx.cap_bytes:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, ctx.cap_bytes / total), ctx.device)
    timer = ctx.e2e.Timer(ctx.cuda)
    spec = ctx.spec
    rows = [{"clip": clip, "status": "not run"} for clip in ctx.clips]

    # Rank 0's rows are the result; another rank's tell the runner why it failed.
    result = args.result if ctx.rank == 0 else f"{args.result}.rank{ctx.rank}"

    def save():
        tmp = result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, result)

    def fail(first_index, exc):
        status = "oom" if is_oom(exc) else "error"
        for row in rows[first_index:]:
            row.update(status=status, error=error_text(exc))
        log(traceback.format_exc())
        save()

    t0 = time.perf_counter()
    try:
        trainer = SYSTEMS[args.worker][1](ctx)
    except Exception as exc:
        fail(0, exc)
        return 1
    setup_s = time.perf_counter() - t0
    n_params = trainer.parameter_count()
    log(f"[{args.worker}] set up in {setup_s:.1f} s: {n_params / 1e9:.3f} B parameters, {trainer.config}")
    steps = argparse.Namespace(steps=args.steps, warmup=args.warmup)
    failed = False
    first = True
    for i, clip in enumerate(ctx.clips):
        try:
            trainer.set_clip(clip)
        except Unsupported as exc:
            rows[i].update(status="unsupported", error=str(exc))
            continue
        try:
            trainer.before_phase(first=first)
            first = False
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
            traced = args.trace_dir and trainer.start_trace()
            times, _, losses = ctx.e2e.run_steps(args.worker, trainer.step, steps, timer)
            if traced:
                path = os.path.join(args.trace_dir, f"trace_{args.worker}_{args.model}_{args.cap_gib:g}_{clip:g}.json")
                rows[i]["step_metrics"] = trainer.save_trace(path)[-args.steps:]
            session_bytes = ctx.largest_of_ranks(trainer.device_bytes())
            torch_peak = ctx.largest_of_ranks(torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else 0)
        except Exception as exc:
            fail(i, exc)
            failed = True
            break
        median = statistics.median(times)
        tokens = spec["batch"] * spec["seq"] * ctx.world
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        rows[i].update(
            status="ok", s_per_step=median, s_per_step_all=times, loss=losses[-1],
            tflops=model_flops_per_token(spec, n_params) * tokens / median / 1e12,
            torch_peak_gib=torch_peak / GIB, session_device_gib=session_bytes / GIB,
            gpu_gib=(torch_peak + session_bytes) / GIB, host_rss_peak_gib=rss / GIB,
            host_bytes_per_param=rss / n_params, steps_taken=trainer.steps_taken, setup_s=setup_s,
            config=dict(trainer.config))
        log(f"[{args.worker}] clip {clip:g}: {rows[i]['s_per_step']:.4f} s/step (steps "
            f"{', '.join(f'{t:.3f}' for t in times)}), loss {losses[-1]:.4f}, GPU {rows[i]['gpu_gib']:.2f} GiB, "
            f"{rows[i]['tflops']:.0f} TFLOPS, host RSS peak {rows[i]['host_rss_peak_gib']:.1f} GiB")
        save()
    for row in rows:
        row.update(params=n_params, tokens_per_step=spec["batch"] * spec["seq"] * ctx.world, ranks=ctx.world,
                   batch=spec["batch"], micro_batches=ctx.micro_batches, loss_chunk_tokens=ctx.loss_chunk_tokens,
                   versions=package_versions(),
                   device_name=torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu")
    save()
    if failed and ctx.world > 1:
        # At once and non-zero: the runner then stops the other ranks, which may wait in a
        # collective (as would this rank's own clean-up).
        return 1
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0
