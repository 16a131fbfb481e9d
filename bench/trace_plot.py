#!/usr/bin/env python3
"""Renders a session timeline (so_session_trace_save / Session::save_trace, Chrome trace JSON)
as a PNG: one lane per thread, one bar per event, coloured by what it is.

  python3 bench/trace_plot.py trace.json timeline.png [--from-ms A --to-ms B]
"""
import argparse
import json

COLOURS = [("speculative step", "#2a9d8f"), ("rescaled", "#e9c46a"), ("rolled back", "#e76f51"),
           ("redone", "#f4a261"), ("stepped", "#457b9d"), ("kept", "#8ab17d"), ("sum of squares", "#a8dadc"),
           ("decide", "#6d597a"), ("wait for gradient copies", "#bbbbbb"), ("gradient", "#264653"),
           ("wait", "#d62828")]


def colour(event):
    label = event["name"] + " " + event.get("args", {}).get("outcome", "")
    for key, c in COLOURS:
        if key in label:
            return key, c
    return "other", "#999999"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--from-ms", type=float)
    ap.add_argument("--to-ms", type=float)
    ap.add_argument("--title", default="superoffload session timeline")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(args.trace))
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M"}
    if not events:
        raise SystemExit("the trace has no events (was tracing on?)")
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
    print(f"wrote {args.png}: {len(events)} events, {len(lanes)} lanes")


if __name__ == "__main__":
    main()
