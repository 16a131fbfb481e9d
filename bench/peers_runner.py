"""bench/peers.py's runner: the workers in turn (a process per rank, each bench/peers.py --worker),
their rows as JSON and Markdown after every worker."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from peers_report import host_header, note_machine, write_outputs
from peers_systems import FSDP2_SYSTEMS, MODELS, RUN_ORDER, SYSTEMS, baseline_of, log

# What a worker runs: the entry point, with --worker.
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(job, args, workdir, log_file, seconds):
    """Runs one worker (a process per rank); returns its rows (one per clip), failures included."""
    system, model, cap, clips = job
    ranks = args.ranks
    result = os.path.join(workdir, "result.json")
    results = [result] + [f"{result}.rank{r}" for r in range(1, ranks)]
    outputs = [os.path.join(workdir, f"worker.rank{r}.log") for r in range(ranks)]
    for path in results + outputs:
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, PEERS, "--worker", system, "--model", model,
           "--cap-gib", str(cap or 0), "--clips", ",".join(repr(c) for c in clips), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device, "--result", result,
           *(["--batch", str(args.batch)] if args.batch else []), "--micro-batches", str(args.micro_batches),
           "--loss-chunk-tokens", str(args.loss_chunk_tokens), *(["--no-settle"] if args.no_settle else []),
           *(["--trace-dir", args.out] if args.trace else [])]
    # The ranks of one process group on this host (a group of one for DeepSpeed and FSDP2).
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    t0 = time.perf_counter()
    procs = []
    for r in range(ranks):
        with open(outputs[r], "w") as out:
            # Its own process group, so that stopping it also ends what it started (DeepSpeed's
            # CPU-optimizer process).
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
    # A rank that fails leaves the others waiting in a collective: stop them all. The first to
    # fail has the reason.
    timed_out = False
    failed_rank = None
    while any(p.poll() is None for p in procs):
        failed_rank = next((r for r, p in enumerate(procs) if p.poll()), None)
        if failed_rank is not None:
            break
        if time.perf_counter() - t0 > seconds:
            timed_out = True
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            stop_group(p)
    wall = time.perf_counter() - t0
    texts = []
    for path in outputs:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    codes = [p.returncode for p in procs]
    for r, text in enumerate(texts):
        log_file.write(f"\n===== {system} {model} cap {cap or 'none'} clips {clips}"
                       + (f" rank {r} of {ranks}" if ranks > 1 else "")
                       + f": exit {codes[r]}, {wall:.1f} s{' (timed out)' if timed_out else ''}\n{text}")
    log_file.flush()
    def rows_of(rank):
        if not os.path.exists(results[rank]):
            return {}
        with open(results[rank]) as f:
            return {row["clip"]: row for row in json.load(f)}
    # Rank 0's rows, with the errors of the first rank that failed.
    failed_rank = failed_rank if failed_rank is not None else next((r for r, c in enumerate(codes) if c), 0)
    by_clip = rows_of(0)
    by_clip.update({clip: row for clip, row in rows_of(failed_rank).items() if row["status"] not in ("ok", "not run")})
    tail = "\n".join(texts[failed_rank].strip().splitlines()[-15:])[-1500:]
    out_rows = []
    for clip in clips:
        row = by_clip.get(clip, {"clip": clip, "status": "not run"})
        if row["status"] == "not run":
            rank = f"rank {failed_rank}'s " if ranks > 1 else "its "
            if timed_out:
                why = "at the end of --budget-s" if seconds < args.timeout_s else f"after {seconds:.0f} s"
                row.update(status="timeout", error=f"worker stopped {why}; {rank}output ended:\n{tail}")
            elif codes[failed_rank] == -signal.SIGKILL:
                row.update(status="killed",
                           error=f"{rank}process was killed (SIGKILL: the kernel's out-of-memory killer, if the host "
                                 f"ran out of memory); its output ended:\n{tail}")
            else:
                row.update(status="crash",
                           error=f"worker exited with {codes[failed_rank]}; {rank}output ended:\n{tail}")
        row.update(system=system, model=model, cap_gib=cap, ranks=ranks, worker_s=round(wall, 1))
        out_rows.append(row)
    return out_rows


def stop_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def plan(systems, models, caps, clips, have_baseline, ranks):
    """(system, model, cap, clips) per worker, in RUN_ORDER, each worker running the clip settings
    in turn; the uncapped baseline of every model first, unless given."""
    jobs = [] if have_baseline else [(baseline_of(ranks), model, None, clips) for model in models]
    for system in sorted(systems, key=RUN_ORDER.index):
        for model in models:
            for cap in caps:
                if (system, model, cap, clips) not in jobs:
                    jobs.append((system, model, cap, clips))
    return jobs


def load_baseline(path, models, clips, ranks):
    """The uncapped baseline rows of an earlier run's peers.json, one per model and clip."""
    baseline = baseline_of(ranks)
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["system"] == baseline and r["cap_gib"] is None
                and r.get("ranks", 1) == ranks and r["status"] == "ok" and r["model"] in models and r["clip"] in clips]
    missing = sorted({(m, c) for m in models for c in clips} - {(r["model"], r["clip"]) for r in rows})
    if missing:
        sys.exit(f"peers.py: {path} has no {baseline} row with {ranks} rank(s) for {missing} (model, clip) uncapped")
    for r in rows:
        r["note"] = f"from {path}"
    return rows


def runner_main(args):
    # Above one rank, "all" is the FSDP2 systems.
    known = SYSTEMS if args.ranks == 1 else {n: v for n, v in SYSTEMS.items() if n in FSDP2_SYSTEMS}
    systems = parse_list(args.systems, known, "system" if args.ranks == 1 else f"system with --ranks {args.ranks}")
    models = parse_list(args.models, MODELS, "model")
    caps = [None if c in ("none", "0") else float(c) for c in args.mem_cap_gib.split(",")]
    clips = {"none": [0.0], "every": [args.clip_max_norm], "both": [0.0, args.clip_max_norm]}[args.clip]
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"peers.py: --ranks {args.ranks} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    # --no-baseline: capacity runs of a model no baseline can train (its rows have no ratio).
    rows = load_baseline(args.baseline, models, clips, args.ranks) if args.baseline else []
    jobs = plan(systems, models, caps, clips, bool(rows) or args.no_baseline, args.ranks)
    header = host_header(args)
    for r in rows:
        note_machine(header, r)
    failed = {}
    start = time.perf_counter()
    log(f"peers: {len(jobs)} workers, timeout {args.timeout_s} s each"
        + (f", {args.budget_s} s in all" if args.budget_s else "") + f"; output in {args.out}")
    with tempfile.TemporaryDirectory(prefix="peers-") as workdir, \
            open(os.path.join(args.out, "peers.log"), "w") as log_file:
        for n, job in enumerate(jobs, 1):
            system, model, cap, job_clips = job
            where = f"{model}, cap {cap:g} GiB" if cap else f"{model}, no cap"
            left = args.budget_s - (time.perf_counter() - start) if args.budget_s else args.timeout_s
            reason = None
            if system in failed and not args.retry_failed:
                reason = f"it failed at {failed[system]}"
            elif args.budget_s and left < args.min_worker_s:
                reason = f"--budget-s {args.budget_s:g} spent"
            if reason:
                new = [dict(system=system, model=model, cap_gib=cap, clip=c, status="skipped", error=reason)
                       for c in job_clips]
            else:
                log(f"[{n}/{len(jobs)}] {system} ({where}) ...")
                new = run_worker(job, args, workdir, log_file, min(args.timeout_s, left))
                if any(r["status"] in ("error", "timeout", "crash", "killed") for r in new):
                    failed.setdefault(system, where)
            for r in new:
                note_machine(header, r)
                log(f"    {system} {where} clip {r['clip']:g}: {r['status']}"
                    + (f" {r['s_per_step']:.4f} s/step, GPU {r['gpu_gib']:.2f} GiB, loss {r['loss']:.4f}"
                       if r["status"] == "ok" else f" ({' '.join(r.get('error', '').split())[:200]})"))
            rows += new
            header["elapsed_s"] = round(time.perf_counter() - start, 1)
            text = write_outputs(args, header, rows)
    log("\n" + text)
    return 0


def parse_list(value, known, what):
    """The names of a comma list (or all), in the order of `known`."""
    names = set(known) if value == "all" else {v.strip() for v in value.split(",") if v.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        sys.exit(f"peers.py: unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    return [n for n in known if n in names]

