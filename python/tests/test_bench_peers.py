"""bench/peers.py's harness on the CPU (--device cpu --models tiny, gloo; no numbers): the workers
of one rank and of two FSDP2 ranks run, and every ratio is to the baseline of its ranks."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402

PEERS = os.path.join(ROOT, "bench", "peers.py")


def peers(tmp_path, *args):
    out = tmp_path / "peers"
    cmd = [sys.executable, PEERS, "--device", "cpu", "--models", "tiny", "--steps", "2", "--warmup", "1",
           "--budget-s", "0", "--timeout-s", "180", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900), out


@pytest.mark.parametrize("ranks, baseline", [(1, "torch-gpu-adamw"), (2, "torch-fsdp2-gpu-adamw")])
def test_every_worker_runs_and_is_compared_with_its_baseline(tmp_path, ranks, baseline):
    systems = (baseline, "ours-fsdp2", "ours-fsdp2-offload")
    proc, out = peers(tmp_path, "--ranks", str(ranks), "--systems", ",".join(systems))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "peers.json") as f:
        rows = json.load(f)["rows"]
    assert sorted((r["system"], r["clip"]) for r in rows) == sorted((s, c) for s in systems for c in (0.0, 1e-3))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ranks"] == ranks
        assert r["tokens_per_step"] == 4 * 64 * ranks
        assert r["ratio_to_gpu_adamw"] == (1.0 if r["system"] == baseline else pytest.approx(
            r["s_per_step"] / next(b["s_per_step"] for b in rows if b["system"] == baseline and b["clip"] == r["clip"])))
    assert (f"{ranks} ranks of FSDP2" in (out / "peers.md").read_text()) == (ranks > 1)


def test_more_than_one_rank_runs_the_fsdp2_systems_only(tmp_path):
    proc, _ = peers(tmp_path, "--ranks", "2", "--systems", "ours,ours-fsdp2")
    assert proc.returncode != 0
    assert "unknown system with --ranks 2 ours" in proc.stderr


def test_without_settling_the_timed_steps_follow_the_warm_up(tmp_path):
    proc, out = peers(tmp_path, "--systems", "ours", "--clip", "both", "--no-settle", "--trace")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "peers.json") as f:
        rows = sorted((r for r in json.load(f)["rows"] if r["system"] == "ours"), key=lambda r: r["clip"])
    # One phase per clip setting, each its 1 warm-up and 2 timed steps and nothing between.
    assert [r["steps_taken"] for r in rows] == [3, 6], rows
    assert all("split_settled_after_steps" not in r["config"] for r in rows)
    assert "no settling" in (out / "peers.md").read_text()
    # --trace: each phase's timeline, and the metrics of its timed steps.
    for r in rows:
        assert [m["step"] for m in r["step_metrics"]] == [r["steps_taken"] - 1, r["steps_taken"]], r
        assert r["step_metrics"][-1]["clip_coef"] < 1.0 if r["clip"] else r["step_metrics"][-1]["clip_coef"] == 1.0
        trace = out / f"trace_ours_tiny_0_{r['clip']:g}.json"
        plot = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_plot.py"), str(trace), "--steps"],
                              capture_output=True, text=True, timeout=60)
        assert plot.returncode == 0, plot.stdout + plot.stderr
        # The warm-up step and the two timed steps: three decisions, two whole steps between them.
        lines = plot.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[:-1]] == ["step 0", "step 1"], plot.stdout
        assert "finalize sub-group" in lines[0] and lines[-1].startswith("passes"), plot.stdout


def test_the_profile_of_a_system_is_written_and_summarised(tmp_path):
    out = tmp_path / "profile"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "peers_profile.py"), "--device", "cpu", "--model", "tiny",
           "--system", "ours", "--clip", "1e-3", "--warmup", "1", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "summary_ours_0.001.json") as f:
        summary = json.load(f)
    assert summary["system"] == "ours" and summary["steps"] == 2 and len(summary["wall_s"]) == 2
    assert all(w > 0 for w in summary["wall_s"])
    assert summary["device_events"] == 0  # no GPU: the host's view only
    assert (out / "profile_ours_0.001.json.gz").stat().st_size > 0


def test_the_chunked_loss_is_transformers_loss(tmp_path):
    """--loss-chunk-tokens: the same loss and gradients as transformers' loss over the whole
    logits, in pieces that do not divide the batch's tokens; and a run with it."""
    import argparse
    import sys

    import torch
    sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "examples", "torch_optimizer")]
    import bench_e2e
    from peers_systems import MODELS, chunk_the_loss
    shape = argparse.Namespace(**MODELS["tiny"], dtype=torch.float64, activation_checkpointing=True)
    batch = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1))
    results = []
    for chunk in (0, 100):
        model = bench_e2e.build_model(shape, torch.device("cpu"))
        if chunk:
            chunk_the_loss(model, chunk)
        loss = bench_e2e.forward_backward(model, batch)
        results.append((loss, {n.replace("vocab_head", "lm_head"): p.grad for n, p in model.named_parameters()}))
    (whole, whole_grads), (pieces, piece_grads) = results
    assert pieces.item() == pytest.approx(whole.item(), rel=1e-12)
    assert whole_grads.keys() == piece_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(piece_grads[name], grad, rtol=1e-10, atol=1e-14, msg=name)
    proc, out = peers(tmp_path, "--systems", "torch-gpu-adamw,ours-fsdp2-offload", "--clip", "every",
                      "--loss-chunk-tokens", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "peers.json") as f:
        rows = json.load(f)["rows"]
    assert [(r["status"], r["loss_chunk_tokens"]) for r in rows] == [("ok", 100)] * 2, rows
