"""SuperOffloadAdamW in host mode on the CPU (f32 parameters; the GPU checks are gpu_checks.py):
parity with torch.optim.AdamW, speculation on/off bit for bit, resume bit for bit through
state_dict(), migration torch AdamW -> ours -> torch AdamW, accumulation, bf16 moments, errors,
logging and metrics."""
import io
import logging

import pytest

torch = pytest.importorskip("torch")

from _models import (MasterAdamW, backward_batch, loss_fn, lr_lambda, make_data, make_model, param_groups,  # noqa: E402
                     rel_diffs)

from superoffload.torch import SuperOffloadAdamW, SuperOffloadError  # noqa: E402

LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.3
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def data():
    return make_data(30, 8, 32, 64)


def ours(model, **kw):
    kw.setdefault("max_grad_norm", CLIP)
    kw.setdefault("sub_group_numel", 20000)
    return SuperOffloadAdamW(param_groups(list(model.named_parameters()), WD), lr=LR, betas=BETAS, eps=EPS,
                             model=model, **kw)


def train(model, opt, sched, batches, accumulation=1):
    losses, results = [], []
    for x, y in batches:
        total = backward_batch(model, x, y, accumulation)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
        results.append(opt.last_step_result() if isinstance(opt, SuperOffloadAdamW) else None)
    return losses, results


def train_ref(model, ref, sched, batches, accumulation=1):
    losses, norms = [], []
    for x, y in batches:
        total = backward_batch(model, x, y, accumulation)
        ref.step()
        sched.step()
        losses.append(total)
        norms.append(ref.last_norm)
    return losses, norms


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_parity_with_torch_adamw(data):
    m, r = make_model(0, "cpu", torch.float32), make_model(0, "cpu", torch.float32)
    opt = ours(m, speculation=True)
    ref = MasterAdamW(r, LR, BETAS, EPS, WD, CLIP)
    la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data)
    lb, nb = train_ref(r, ref, torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda), data)
    d = rel_diffs(la, lb)
    assert sum(d) / len(d) <= 1e-3, d
    assert sum(1 for x in res if x["clip_coef"] < 1) > 0  # clipping was active
    assert all(abs(x["global_norm"] - n) <= 1e-4 * n for x, n in zip(res, nb))
    assert la[-1] < la[0]
    assert opt.last_step_result()["speculative"] == len(opt.subgroups())
    opt.close()


def test_speculation_bit_identical(data):
    out = []
    for spec in (True, False):
        m = make_model(0, "cpu", torch.float32)
        opt = ours(m, speculation=spec, max_grad_norm=1e6)
        losses, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:12])
        n = len(opt.subgroups())
        if spec:  # kept, or (not started at step(): ABI 2) cancelled and stepped exactly
            assert all(r["kept"] + r["stepped"] == n and r["redone"] == 0 and r["rescaled"] == 0 for r in res)
            assert sum(r["kept"] for r in res) > 0
        else:
            assert all(r["stepped"] == n for r in res)
        out.append((losses, weights(m)))
        opt.close()
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


# Resuming is bit for bit with any settings: with clipping and speculation too, a speculative step
# writes the same bits whether its pass ran or was cancelled at step().
@pytest.mark.parametrize("kw", [dict(max_grad_norm=0.0), dict(speculation=False), dict()],
                         ids=["no_clip", "clip_no_spec", "clip_defaults"])
def test_state_dict_is_torch_shaped_and_resumes_bit_for_bit(data, kw):
    half = 8
    m = make_model(0, "cpu", torch.float32)
    opt = ours(m, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    train(m, opt, sched, data[:half])
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape and st["master"].shape == p.shape
        assert st["exp_avg"].dtype == torch.float32 and float(st["step"]) == half
        assert torch.equal(st["master"], p.detach())  # host mode: the parameters are the masters
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": sd, "sched": sched.state_dict()}, buf)
    la, _ = train(m, opt, sched, data[half:16])
    wa = weights(m)
    opt.close()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)  # loadable the way Trainer loads optimizer.pt
    m2 = make_model(7, "cpu", torch.float32)
    opt2 = ours(m2, **kw)
    s2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda)
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    s2.load_state_dict(ck["sched"])
    lb, _ = train(m2, opt2, s2, data[half:16])
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(wa, weights(m2)))
    sd2 = opt2.state_dict()
    params2 = [p for g in opt2.param_groups for p in g["params"]]
    assert len(opt2.state) == len(params2)
    for i, p in enumerate(params2):  # optimizer.state views the state that the state dict holds
        assert set(opt2.state[p]) == {"exp_avg", "exp_avg_sq", "master"}
        assert all(torch.equal(t, sd2["state"][i][k]) for k, t in opt2.state[p].items())
    opt2.close()


def test_migration_torch_ours_torch_keeps_every_moment(data):
    r = make_model(0, "cpu", torch.float32)
    tor = torch.optim.AdamW(param_groups(list(r.named_parameters()), WD), lr=LR, betas=BETAS, eps=EPS)
    train(r, tor, None, data[:5])
    before = tor.state_dict()
    m = make_model(3, "cpu", torch.float32)
    m.load_state_dict(r.state_dict())
    opt = ours(m, sub_group_numel=0, max_grad_norm=0.0)  # torch's run does not clip
    opt.load_state_dict(before)  # migrating in: moments and steps; masters from the parameters
    mid = opt.state_dict()
    tor2 = torch.optim.AdamW(param_groups(list(make_model(0, "cpu", torch.float32).named_parameters()), WD), lr=LR)
    tor2.load_state_dict(mid)  # migrating out
    after = tor2.state_dict()
    assert sorted(after["state"]) == sorted(before["state"])
    for i, st in before["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(after["state"][i][k], st[k]), (i, k)
        assert float(after["state"][i]["step"]) == float(st["step"])
    assert [g["lr"] for g in after["param_groups"]] == [g["lr"] for g in before["param_groups"]]
    # and training goes on like torch's from there
    la, _ = train(m, opt, None, data[5:10])
    lb, _ = train(r, tor, None, data[5:10])
    assert sum(rel_diffs(la, lb)) / 5 <= 1e-5
    opt.close()


def test_accumulation(data):
    m, r = make_model(0, "cpu", torch.float32), make_model(0, "cpu", torch.float32)
    opt = ours(m, accumulation_steps=2)
    la, _ = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:10], accumulation=2)
    ref = MasterAdamW(r, LR, BETAS, EPS, WD, CLIP)
    lb, _ = train_ref(r, ref, torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda), data[:10], accumulation=2)
    d = rel_diffs(la, lb)
    assert sum(d) / len(d) <= 1e-3
    opt.close()


def test_bf16_moments(data):
    m, r = make_model(0, "cpu", torch.float32), make_model(0, "cpu", torch.float32)
    opt = ours(m, moment_dtype="bf16")
    f32 = ours(make_model(0, "cpu", torch.float32))
    assert opt.memory()["host_bytes_per_param"] < f32.memory()["host_bytes_per_param"] - 3.5
    f32.close()
    la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:15])
    n = len(opt.subgroups())
    assert all(x["speculative"] == 0 and x["stepped"] == n for x in res)  # no copy to write ahead in host mode
    ref = MasterAdamW(r, LR, BETAS, EPS, WD, CLIP)
    lb, _ = train_ref(r, ref, torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda), data[:15])
    d = rel_diffs(la, lb)
    assert sum(d) / len(d) <= 1e-2
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    opt.close()


def test_errors_and_nothing_changed(data):
    m = make_model(0, "cpu", torch.float32)
    opt = ours(m)
    x, y = data[0]
    loss_fn(m, x, y).backward()
    with pytest.raises(RuntimeError, match="between backward and step"):
        opt.state_dict()
    opt.step()
    sd = opt.state_dict()
    before = weights(m)
    bad = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
    bad["state"][0] = dict(sd["state"][0], exp_avg=torch.zeros(3))
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})
    assert all(torch.equal(a, b) for a, b in zip(before, weights(m)))
    with pytest.raises(SuperOffloadError) as e:
        opt.session.grad_copy(0, 0, 1)
    assert e.value.status_name == "SO_STATUS_NULL_ARGUMENT" and "grad" in e.value.message
    with pytest.raises(ValueError, match="moment_dtype"):
        ours(make_model(0, "cpu", torch.float32), moment_dtype="f16")
    with pytest.raises(ValueError, match="CUDA"):
        ours(make_model(0, "cpu", torch.float32), gpu_fraction=0.3)
    opt.close()


def test_logging_and_metrics(data, caplog, capfd):
    m = make_model(0, "cpu", torch.float32)
    with caplog.at_level(logging.INFO, logger="superoffload"):
        opt = ours(m)
    assert any("host mode" in r.message for r in caplog.records if r.name == "superoffload")
    assert opt.metrics() == {}
    train(m, opt, None, data[:2])
    mt = opt.metrics()
    for k in ("global_norm", "clip_coef", "kept", "rescaled", "rolled_back", "redone", "cancelled", "exposed_s",
              "forward_wait_s", "pinned_bytes", "host_bytes", "device_bytes"):
        assert k in mt, k
    assert mt["global_norm"] > 0 and mt["host_bytes"] > 0
    result = opt.last_step_result()
    assert {k: mt[k] for k in result} == result  # the library's fields under the library's names
    opt.close()
    assert opt.closed
    assert capfd.readouterr().err == ""  # nothing printed to stderr


def test_gpu_budget_argument(data):
    m = make_model(0, "cpu", torch.float32)
    # "auto", the default, means 0 with CPU parameters: nothing to place.
    for budget in ("auto", 0):
        opt = ours(m, gpu_budget_bytes=budget)
        assert opt.session.gpu_budget() == 0
        train(m, opt, None, data[:1])
        assert "gpu_budget_bytes" not in opt.metrics() and opt.metrics()["device_bytes"] == 0
        opt.close()
    with pytest.raises(ValueError, match="needs CUDA"):
        ours(m, gpu_budget_bytes=1 << 30)
    for bad in ("max", -1, 1.5, None):
        with pytest.raises(ValueError, match="gpu_budget_bytes"):
            ours(m, gpu_budget_bytes=bad)


def test_direct_reads_after_synchronize(data):
    m = make_model(0, "cpu", torch.float32)
    opt = ours(m)
    x, y = data[0]
    loss_fn(m, x, y).backward()
    opt.step()
    opt.synchronize()
    snap = weights(m)
    assert opt.last_step_result()["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(snap, weights(m)))  # final: nothing changes any more
    opt.close()
