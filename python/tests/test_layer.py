"""The ctypes layer without torch: header mirrors, version, a host session driven through raw
buffers and checked against the kernel, errors, checkpoints, core shares."""
import ctypes as C
import math
import os
import re

import pytest

import superoffload as so
from superoffload import _abi, _cores, _header

from conftest import ROOT

REPO_HEADER = os.path.join(ROOT, "include", "superoffload.h")


def _header_path():
    return REPO_HEADER if os.path.isfile(REPO_HEADER) else _header.default_header()


def test_header_mirrors_match():
    problems = _header.check(_header_path())
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("edit,expect", [
    (lambda h: h.replace("  double clip_coef;", "  float clip_coef;"), "so_step_result.clip_coef"),
    (lambda h: h.replace("  uint32_t rescaled;\n", "").replace("  uint32_t kept;\n", "  uint32_t kept;\n  uint32_t rescaled;\n  uint32_t extra;\n"),
     "struct so_step_result"),
    (lambda h: h.replace("SO_DTYPE_F16 = 3,", "SO_DTYPE_F16 = 3,\n  SO_DTYPE_F8 = 4,"), "enum so_dtype"),
    (lambda h: h.replace("const char *so_version_string(void);",
                         "const char *so_version_string(void);\nuint32_t so_new_call(const struct so_session *s);"),
     "function so_new_call"),
    (lambda h: h.replace("so_status so_session_step_count(const struct so_session *session,\n"
                         "                                uint32_t subgroup,",
                         "so_status so_session_step_count(const struct so_session *session,\n"
                         "                                uint64_t subgroup,"), "so_session_step_count"),
    (lambda h: re.sub(r"#define SO_ABI_VERSION \d+", "#define SO_ABI_VERSION 99", h), "SO_ABI_VERSION"),
    (lambda h: h.replace("#define SO_GPU_BUDGET_AUTO UINT64_MAX", "#define SO_GPU_BUDGET_AUTO 0"),
     "SO_GPU_BUDGET_AUTO"),
])
def test_mirror_check_catches_drift(tmp_path, edit, expect):
    text = open(_header_path()).read()
    changed = edit(text)
    assert changed != text, "the edit did not apply: update this test"
    p = tmp_path / "superoffload.h"
    p.write_text(changed)
    problems = _header.check(str(p))
    assert any(expect in x for x in problems), problems


def test_version():
    assert so.__version__ == so.version()
    assert so.abi_version() == _abi.ABI_VERSION
    cargo = os.path.join(ROOT, "Cargo.toml")
    if os.path.isfile(cargo):
        m = re.search(r'^version\s*=\s*"([^"]+)"', open(cargo).read(), re.M)
        assert so.__version__ == m.group(1)
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        dist = distribution("superoffload")
    except PackageNotFoundError:
        return
    if os.path.realpath(str(dist.locate_file("superoffload/__init__.py"))) == os.path.realpath(so.__file__):
        assert dist.version == so.__version__  # the installed package's metadata


def _floats(values):
    return (C.c_float * len(values))(*values)


def test_host_session_matches_the_kernel():
    n = 1000
    init = [math.sin(i) for i in range(n)]
    grads = [[math.cos(i * (s + 1)) * 0.3 for i in range(n)] for s in range(3)]
    master = _floats(init)
    s = so.Session(speculation=True)
    g = s.add_group(1e-2, 0.9, 0.99, 1e-8, 0.1)
    sg, ids = s.add_subgroup(g, C.addressof(master), n, [("w", 0, 600), ("b", 600, 400)], keep=master)
    # reference: the kernel on copies, with the session's clip factor
    p, m, v = _floats(init), _floats([0.0] * n), _floats([0.0] * n)
    for step, gr in enumerate(grads, 1):
        buf = _floats(gr)
        s.begin_step()
        s.grad_copy(ids[1], C.addressof(buf) + 600 * 4, 400)
        t1 = s.grad_copy(ids[0], C.addressof(buf), 600)
        assert t1 != 0  # the second slice completed the sub-group: a speculative step
        ticket = s.step(max_norm=2.0)
        r = s.step_result(ticket)
        norm = math.sqrt(sum(float(x) * float(x) for x in buf))  # the f32 gradient, summed in double
        assert r["global_norm"] == pytest.approx(norm, rel=1e-12)
        assert r["clip_coef"] == pytest.approx(min(1.0, 2.0 / (norm + 1e-6)), rel=1e-12)
        # Kept or rescaled, whether its pass ran or was cancelled at step() and done by the final pass
        assert r["speculative"] == 1 and r["kept"] + r["rescaled"] == 1 and not r["skipped"]
        so.adam_update(C.addressof(p), C.addressof(buf), C.addressof(m), C.addressof(v), n, lr=1e-2, beta1=0.9,
                       beta2=0.99, eps=1e-8, weight_decay=0.1, step=step, grad_scale=r["grad_factor"])
        assert s.step_count(sg) == step
    diff = max(abs(a - b) for a, b in zip(master, p))
    assert diff <= 1e-6, diff  # rescaled steps: within rounding of the rescale
    s.close()


def test_speculation_bit_identical_without_clipping():
    n = 512
    out = []
    for spec in (True, False):
        master = _floats([0.01 * i for i in range(n)])
        s = so.Session(speculation=spec)
        s.add_group(1e-3, 0.9, 0.999, 1e-8, 0.01)
        _, ids = s.add_subgroup(0, C.addressof(master), n, [("x", 0, n)], keep=master)
        for k in range(4):
            buf = _floats([math.sin(i + k) for i in range(n)])
            s.begin_step()
            s.grad_copy(ids[0], C.addressof(buf), n)
            r = s.step_result(s.step(0.0))
            assert r["kept"] + r["stepped"] == 1 and (spec or r["stepped"] == 1)
        out.append(bytes(master))
        s.close()
    assert out[0] == out[1]


def test_errors_carry_status_and_message():
    s = so.Session()
    s.add_group(1e-3, 0.9, 0.999, 1e-8, 0.0)
    buf = _floats([0.0])
    with pytest.raises(so.SuperOffloadError) as e:
        s.grad_copy(0, C.addressof(buf), 1)
    assert e.value.status == so.Status.INVALID_STATE and e.value.status_name == "SO_STATUS_INVALID_STATE"
    assert "begin" in str(e.value)
    with pytest.raises(so.SuperOffloadError) as e:
        s.add_group(-1.0, 0.9, 0.999, 1e-8, 0.0)
    assert e.value.status == so.Status.INVALID_ARGUMENT
    with pytest.raises(so.SuperOffloadError) as e:
        so.Session(moment_dtype="f16")
    assert e.value.status in (so.Status.UNSUPPORTED, so.Status.INVALID_ARGUMENT)
    with pytest.raises(ValueError):
        so.Session(grad_dtype="f64")
    s.close()
    with pytest.raises(so.SuperOffloadError):
        s.add_group(1e-3, 0.9, 0.999, 1e-8, 0.0)


def test_gpu_budget_auto_needs_a_device():
    # The automatic budget measures the GPU's free memory: a host session refuses it, as any
    # budget other than 0 (everything offloaded).
    with pytest.raises(so.SuperOffloadError) as e:
        so.Session(gpu_budget_bytes=_abi.GPU_BUDGET_AUTO)
    assert e.value.status == so.Status.UNSUPPORTED and "gpu_budget_bytes" in str(e.value)
    s = so.Session(gpu_budget_bytes=0)
    assert s.gpu_budget() == 0
    # A limit on the free device memory the budget counts on: accepted, no effect on the host.
    s.limit_device_memory(1 << 30)
    s.limit_device_memory(None)
    assert s.gpu_budget() == 0
    s.close()


def test_checkpoint_round_trip(tmp_path):
    n = 256
    master = _floats([1.0] * n)
    s = so.Session()
    s.add_group(1e-2, 0.9, 0.999, 1e-8, 0.0)
    _, ids = s.add_subgroup(0, C.addressof(master), n, [("x", 0, n)], keep=master)
    g = _floats([0.5] * n)
    s.begin_step()
    s.grad_copy(ids[0], C.addressof(g), n)
    s.wait_all(s.step())
    path = str(tmp_path / "ck.safetensors")
    s.save(path)
    saved = bytes(master)
    s.begin_step()
    s.grad_copy(ids[0], C.addressof(g), n)
    s.wait_all(s.step())
    assert bytes(master) != saved
    s.load(path)
    assert bytes(master) == saved and s.step_count(0) == 1
    with open(path, "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    with pytest.raises(so.SuperOffloadError) as e:
        s.load(path)
    assert e.value.status == so.Status.BAD_CHECKPOINT
    s.close()


def test_pool_info():
    p = so.Pool(2)
    info = p.info()
    assert info["threads"] == 2 and info["isa"] in ("portable", "avx2", "avx512")
    p.close()


def test_core_shares():
    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    allowed = list(range(16))
    shares = _cores.plan_shares(allowed, 4, nodes, [1, 1, 0, 0])
    assert [len(s) for s in shares] == [4, 4, 4, 4]
    assert sorted(c for s in shares for c in s) == allowed  # disjoint, complete
    assert all(c >= 8 for c in shares[0] + shares[1]) and all(c < 8 for c in shares[2] + shares[3])
    assert _cores.plan_shares(allowed, 4, nodes, [1, 1, 0, 0]) == shares  # every rank computes the same
    assert _cores.plan_shares(list(range(5)), 2, {0: list(range(5))}, []) == [[0, 1], [2, 3]]
    assert _cores.rank_cores() is None  # no torch.distributed here
    assert _cores._fmt([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
