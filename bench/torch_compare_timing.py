"""bench/torch_compare.py's timing and reporting, shared by the torch run and the self-test:
interleaved repetitions, their medians and minima, the table, the machine's CPU."""
import platform
import statistics
import time


def run_interleaved(ops, warmup, iters, gap_s):
    """ops: list of (name, fn). Each repetition runs every fn once, in order, each timed on its
    own after a short pause (so that one side's spinning worker threads have gone to sleep
    before the other side starts). Returns {name: [ms, ...]} of the timed repetitions."""
    samples = {name: [] for name, _ in ops}
    for rep in range(warmup + iters):
        for name, fn in ops:
            if fn is None:
                continue
            if gap_s > 0:
                time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            fn()
            ms = (time.perf_counter_ns() - t0) / 1e6
            if rep >= warmup:
                samples[name].append(ms)
    return samples


def summarize(samples):
    return {name: {"ms_median": statistics.median(s), "ms_min": min(s), "samples_ms": s}
            for name, s in samples.items() if s}


def print_table(rows, n):
    print(f"{'op':<44} {'ms(med)':>9} {'ms(min)':>9} {'Gparam/s':>9} {'ratio':>22}")
    for label, st, ratio in rows:
        r = "" if ratio is None else f"{ratio[0]:.3f} {ratio[1]}"
        print(f"{label:<44} {st['ms_median']:>9.3f} {st['ms_min']:>9.3f} {n / st['ms_median'] / 1e6:>9.3f} {r:>22}")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
