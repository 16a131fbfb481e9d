"""bench/peers.py's results: the ratios to the baseline, peers.json, and peers.md (a table per model,
cap and ranks, then the capacity table), with the header that describes the machine and the run."""
import datetime
import json
import os
import shutil

from peers_systems import GIB, MODELS, SYSTEMS, baseline_of


def baseline_rows(rows):
    return {(r["model"], r["clip"], r.get("ranks", 1)): r for r in rows
            if r["system"] == baseline_of(r.get("ranks", 1)) and r["cap_gib"] is None and r["status"] == "ok"}


def write_outputs(args, header, rows):
    base = baseline_rows(rows)
    for row in rows:
        ref = base.get((row["model"], row["clip"], row.get("ranks", 1)))
        row["ratio_to_gpu_adamw"] = row["s_per_step"] / ref["s_per_step"] if ref and row["status"] == "ok" else None
    with open(os.path.join(args.out, "peers.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    text = markdown(header, rows)
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write(text)
    return text


def fmt(x, digits):
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(header, rows):
    machine = [header["device_name"], f"{header['cpus']} CPUs", f"/dev/shm {header['dev_shm_gib']} GiB",
               ", ".join(f"{k} {v}" for k, v in header["versions"].items()),
               f"{header['warmup']} warm-up + {header['steps']} timed steps, median"
               + ("" if header.get("settle", True) else ", no settling"),
               f"clip every step: max_grad_norm {header['clip_max_norm']:g}"]
    out = [f"# Peers: {header['started']}", "", "; ".join(m for m in machine if m) + ".", ""]
    order = list(SYSTEMS)
    groups = []
    for row in rows:
        key = (row["model"], row["cap_gib"], row.get("ranks", 1))
        if key not in groups:
            groups.append(key)
    for model, cap, ranks in sorted(groups, key=lambda k: (list(MODELS).index(k[0]), k[2], k[1] or 0)):
        group = sorted((r for r in rows if (r["model"], r["cap_gib"], r.get("ranks", 1)) == (model, cap, ranks)),
                       key=lambda r: (order.index(r["system"]), r["clip"]))
        spec = MODELS[model]
        params = next((r["params"] for r in group if r.get("params")), None)
        tokens = next((r["tokens_per_step"] for r in group if r.get("tokens_per_step")), None)
        size = (f"{params / 1e9:.2f} B parameters, " if params >= 1e9 else f"{params / 1e6:.2f} M parameters, "
                ) if params else ""
        on_ranks = f"{ranks} ranks of FSDP2, " if ranks > 1 else ""
        out += [f"## {model}: {spec['layers']} x {spec['hidden']}, {size}{on_ranks}"
                + (f"{tokens} tokens a step; " if tokens else "")
                + (f"memory cap {cap:g} GiB" if cap else "no memory cap"), "",
                "| system | clip | s/step | × GPU AdamW | TFLOPS | GPU GiB (torch peak + session) "
                "| host RSS GiB (B/param) | loss (steps) | status, note |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in group:
            out.append(row_markdown(r, cap))
        out.append("")
    out += capacity_markdown(rows)
    return "\n".join(out)


def row_markdown(r, cap):
    ok = r["status"] == "ok"
    note = r["status"] if not ok else ""
    if r.get("error"):
        note += ": " + " ".join(r["error"].split())[:300].replace("|", "\\|")
    if r.get("note"):
        note = r["note"]
    if ok and cap and r["gpu_gib"] > cap:
        note = "above the cap"
    gpu = (f"{r['gpu_gib']:.2f}" + (f" ({r['torch_peak_gib']:.2f} + {r['session_device_gib']:.2f})"
                                      if r["session_device_gib"] else "")) if ok else "—"
    host = (f"{r['host_rss_peak_gib']:.1f} ({r['host_bytes_per_param']:.1f})"
            if ok and "host_rss_peak_gib" in r else "—")
    loss = f"{r['loss']:.4f} ({r['steps_taken']})" if ok else "—"
    return (f"| {SYSTEMS[r['system']][0]} | {'every step' if r['clip'] else 'none'} | "
            f"{fmt(r.get('s_per_step'), 3)} | {fmt(r.get('ratio_to_gpu_adamw'), 3)} | {fmt(r.get('tflops'), 0)} | "
            f"{gpu} | {host} | {loss} | {note} |")


def capacity_markdown(rows):
    """Per system, cap and clip setting: the largest model that ran (within the cap), with its
    figures; nothing with fewer than two models."""
    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    if len(models) < 2:
        return []
    out = ["## Capacity: the largest model each system trained", "",
           "| system | cap | clip | largest model | s/step | TFLOPS | GPU GiB | host RSS GiB (B/param) "
           "| larger: why not |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    keys = sorted({(r["system"], r["cap_gib"] or 0, r["clip"]) for r in rows},
                  key=lambda k: (list(SYSTEMS).index(k[0]), k[1], k[2]))
    for system, cap, clip in keys:
        mine = {r["model"]: r for r in rows if (r["system"], r["cap_gib"] or 0, r["clip"]) == (system, cap, clip)}
        fits = [m for m in models if m in mine and mine[m]["status"] == "ok"
                and not (cap and mine[m]["gpu_gib"] > cap)]
        best = mine[fits[-1]] if fits else None
        larger = [m for m in models if m in mine and (not fits or models.index(m) > models.index(fits[-1]))]
        why = "; ".join(f"{m}: {mine[m]['status']}" for m in larger) or "—"
        figures = (f"{fmt(best['s_per_step'], 3)} | {fmt(best['tflops'], 0)} | {best['gpu_gib']:.2f} | "
                   f"{best['host_rss_peak_gib']:.1f} ({best['host_bytes_per_param']:.1f})"
                   ) if best else "— | — | — | —"
        out.append(f"| {SYSTEMS[system][0]} | {f'{cap:g} GiB' if cap else 'none'} | "
                   f"{'every step' if clip else 'none'} | {fits[-1] if fits else 'none'} | {figures} | {why} |")
    out.append("")
    return out


def host_header(args):
    def gib(path):
        try:
            return round(shutil.disk_usage(path).total / GIB, 1)
        except OSError:
            return None
    return {"started": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "dev_shm_gib": gib("/dev/shm"), "models": args.models, "systems": args.systems,
            "caps_gib": args.mem_cap_gib, "ranks": args.ranks, "clip": args.clip, "clip_max_norm": args.clip_max_norm,
            "steps": args.steps, "warmup": args.warmup, "settle": not args.no_settle, "device": args.device,
            "timeout_s": args.timeout_s, "device_name": "?", "versions": {}}


def note_machine(header, row):
    if row.get("device_name"):
        header["device_name"] = row["device_name"]
        header["versions"].update(row["versions"])

