"""FSDP2 (fully_shard) with 1, 2 and 3 ranks, gloo on the CPU: parity, resuming bit for bit from a
rank-local state_dict() and through torch.distributed.checkpoint, a step skipped on every rank for
one rank's NaN, per-rank core shares (fsdp_worker.py does the work). One rank takes the gradients
before FSDP2 reduces them; more ranks take the reduced shards. With bf16 shards the session keeps
f32 master weights and writes the shards as the weights' copy."""
import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks,dtype", [(1, "f32"), (2, "f32"), (3, "f32"), (1, "bf16"), (2, "bf16")])
def test_fsdp2_ranks_gloo_dcp(tmp_path, ranks, dtype):
    out = tmp_path / "fsdp.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_port()),
           os.path.join(HERE, "fsdp_worker.py"), "--device", "cpu", "--json", str(out),
           "--batch", "12", "--dtype", dtype]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    checks = {"cores", "parity", "resume", "dcp_resume", "skip"} | ({"shard_copies"} if dtype == "bf16" else set())
    assert report["pass"] and set(report["checks"]) == checks
    assert report["world_size"] == ranks
