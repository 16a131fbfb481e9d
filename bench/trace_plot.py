#!/usr/bin/env python3
"""Renders a session timeline (so_session_trace_save / Session::save_trace, Chrome trace JSON)
as a PNG: one lane per thread, one bar per event, coloured by what it is, and prints a summary:
per kind of CPU-Adam pass its count and mean duration, when the decision ran, when the last
sub-group was final, and the caller's ticket waits (ms from the first event). With --steps,
also one line per step, from its decision to the next: the period, the CPU-Adam thread's busy
time, when the last final pass ended after the decision, and each kind of pass's count and
milliseconds (where the CPU-Adam thread is busy nearly all the period, it is the bottleneck).

  python3 bench/trace_plot.py trace.json timeline.png [--from-ms A --to-ms B]
  python3 bench/trace_plot.py trace.json --steps             # the summaries alone
"""
import argparse
import json
import re

COLOURS = [("speculative step", "#2a9d8f"), ("rescaled", "#e9c46a"), ("rolled back", "#e76f51"),
           ("redone", "#f4a261"), ("stepped", "#457b9d"), ("state, sub-group", "#b5838d"), ("kept", "#8ab17d"), ("sum of squares", "#a8dadc"),
           ("decide", "#6d597a"), ("wait for gradient copies", "#bbbbbb"), ("gradient", "#264653"),
           ("wait", "#d62828")]


def colour(event):
    label = event["name"] + " " + event.get("args", {}).get("outcome", "")
    for key, c in COLOURS:
        if key in label:
            return key, c
    return "other", "#999999"


def cpu_jobs(events):
    """The CPU-Adam thread's jobs (lane 2), its waits left out, in time order."""
    return sorted((e for e in events if e["tid"] == 2 and not e["name"].startswith("wait")), key=lambda e: e["ts"])


def summary(events):
    """One line: what the CPU-Adam thread did and what the caller waited for, in ms."""
    t0 = min(e["ts"] for e in events)
    kinds = {}
    for e in cpu_jobs(events):
        kind, _ = colour(e)
        kinds.setdefault(kind, []).append(e["dur"] / 1e3)
    passes = ", ".join(f"{k} {len(d)} x {sum(d) / len(d):.2f}" for k, d in sorted(kinds.items()))
    decide = [e for e in events if e["name"].startswith("decide")]
    finals = [e for e in events if e["name"].startswith("finalize")]
    waits = [e["dur"] / 1e3 for e in events if e["tid"] == 1 and e["name"].startswith("wait for ticket")]
    end = lambda e: (e["ts"] + e["dur"] - t0) / 1e3  # noqa: E731
    parts = [f"passes (count x mean ms): {passes}"]
    if decide:
        parts.append(f"decided at {(decide[0]['ts'] - t0) / 1e3:.1f}")
    if finals:
        parts.append(f"last final at {max(end(e) for e in finals):.1f}")
    if waits:
        parts.append(f"caller ticket waits {len(waits)}, {sum(waits):.1f} ms in all, longest {max(waits):.1f}")
    return "; ".join(parts)


def steps(events):
    """One line per step between two decisions: period, CPU-Adam busy time, the last final
    pass's end after the decision, and per kind of pass (sub-group numbers dropped) the count
    and the milliseconds in all."""
    cpu = cpu_jobs(events)
    decisions = [e["ts"] for e in cpu if e["name"].startswith("decide")]
    lines = []
    for i, (start, stop) in enumerate(zip(decisions, decisions[1:])):
        window = [e for e in cpu if start <= e["ts"] < stop]
        kinds = {}
        for e in window:
            kind = re.sub(r"\s*\d+", "", e["name"].split(",")[0])
            outcome = e.get("args", {}).get("outcome")
            kind = f"{kind} ({outcome})" if outcome else kind
            count, ms = kinds.get(kind, (0, 0.0))
            kinds[kind] = (count + 1, ms + e["dur"] / 1e3)
        finals = [e["ts"] + e["dur"] for e in window if e["name"].startswith("finalize")]
        last = (max(finals) - start) / 1e3 if finals else 0.0
        busy = sum(e["dur"] for e in window) / 1e3
        passes = ", ".join(f"{k} {c} / {ms:.0f}" for k, (c, ms) in sorted(kinds.items()))
        lines.append(f"step {i}: period {(stop - start) / 1e3:.0f} ms, CPU-Adam busy {busy:.0f} ms, last final "
                     f"+{last:.0f} ms; passes (count / ms): {passes}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="the trace, Chrome trace JSON (so_session_trace_save)")
    ap.add_argument("png", nargs="?",
                    help="the image to write (needs matplotlib; without it, or without matplotlib, only the summaries "
                         "are printed)")
    ap.add_argument("--from-ms", type=float, help="draw from this time, ms after the first event")
    ap.add_argument("--to-ms", type=float, help="draw up to this time, ms after the first event")
    ap.add_argument("--title", default="superoffload session timeline", help="the image's title")
    ap.add_argument("--steps", action="store_true", help="also print one line per step (between two decisions)")
    args = ap.parse_args()
    data = json.load(open(args.trace))
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M"}
    if not events:
        raise SystemExit("the trace has no events (was tracing on?)")
    if args.steps:
        print("\n".join(steps(events)))
    if args.png is None:
        print(summary(events))
        return
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib: no {args.png}; {summary(events)}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = min(e["ts"] for e in events)
    lo = args.from_ms if args.from_ms is not None else 0.0
    hi = args.to_ms if args.to_ms is not None else max(e["ts"] + e["dur"] - t0 for e in events) / 1e3
    fig, ax = plt.subplots(figsize=(14, 1.2 + 1.1 * len(lanes)))
    seen = {}
    for e in events:
        start, dur = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        if start + dur < lo or start > hi:
            continue
        key, c = colour(e)
        ax.barh(e["tid"], max(dur, (hi - lo) / 2000), left=start, height=0.6, color=c, edgecolor="none",
                label=None if key in seen else key)
        seen[key] = True
    ax.set_yticks(sorted(lanes), [lanes[t] for t in sorted(lanes)])
    ax.set_xlim(lo, hi)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(args.title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=130)
    print(f"wrote {args.png}: {len(events)} events, {len(lanes)} lanes; {summary(events)}")


if __name__ == "__main__":
    main()
