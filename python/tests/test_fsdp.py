"""FSDP2 (fully_shard) with 2 ranks, gloo on the CPU: parity, resuming bit for bit from a rank-local
state_dict() and through torch.distributed.checkpoint, per-rank core shares (fsdp_worker.py does
the work)."""
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


def test_fsdp2_two_ranks_gloo_dcp(tmp_path):
    out = tmp_path / "fsdp.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           os.path.join(HERE, "fsdp_worker.py"), "--device", "cpu", "--json", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["pass"] and set(report["checks"]) == {"cores", "parity", "resume", "dcp_resume"}
