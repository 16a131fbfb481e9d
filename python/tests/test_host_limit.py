"""SuperOffloadAdamW's host_memory_limit in host mode: it bounds every host byte the optimizer
holds (master weights and moments it lends the session, and the session's own buffers), a limit
too small is refused before anything is allocated or re-pointed, the advice names only options a
host session has, and bad limits and parameters outside `model` are refused by name."""
import re

import pytest

torch = pytest.importorskip("torch")

from _models import loss_fn, make_data, make_model  # noqa: E402

import superoffload  # noqa: E402
from superoffload.torch import SuperOffloadAdamW, SuperOffloadError  # noqa: E402

torch.set_num_threads(2)
CUDA_ONLY = ("gradient_home", "host_copy")


def more_bytes_needed(message):
    found = re.search(r"([\d,]+) more bytes needed", message)
    assert found, message
    return int(found.group(1).replace(",", ""))


def test_a_limit_below_the_state_is_refused_before_anything_changes():
    torch.manual_seed(0)
    m = torch.nn.Linear(4096, 4096)
    before = [(p.data_ptr(), p.detach().clone()) for p in m.parameters()]
    limit = 100 << 20
    with pytest.raises(SuperOffloadError) as e:
        SuperOffloadAdamW(m.parameters(), model=m, host_memory_limit=limit)
    assert e.value.status == superoffload.Status.OUT_OF_RESOURCES
    # f32 masters, two f32 moments and the session's f32 gradient buffer: 16 bytes a parameter,
    # and the master arena's page alignment.
    numel = 4096 * 4096 + 4096
    assert 16 * numel - limit <= more_bytes_needed(e.value.message) <= 16 * numel - limit + (64 << 10)
    assert f"{limit:,}" in e.value.message and 'moment_dtype="bf16"' in e.value.message
    for p, (ptr, value) in zip(m.parameters(), before):  # not re-pointed, not changed, no hooks
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value) and not p._post_accumulate_grad_hooks


def test_a_limit_that_fits_is_kept_to_the_byte():
    data = make_data(4, 8, 32, 64)
    m = make_model(0, "cpu", torch.float32)
    opt = SuperOffloadAdamW(m.parameters(), model=m, sub_group_numel=20000)
    need = opt.memory()["host_bytes"]
    mem = opt.memory()
    assert need == mem["session_host_bytes"] + mem["master_bytes"] + mem["moment_bytes"]
    opt.close()
    with pytest.raises(SuperOffloadError) as e:
        SuperOffloadAdamW(m.parameters(), model=m, sub_group_numel=20000, host_memory_limit=need - 1)
    assert more_bytes_needed(e.value.message) == 1  # the check counts what is then allocated
    opt = SuperOffloadAdamW(m.parameters(), model=m, sub_group_numel=20000, host_memory_limit=need)
    for x, y in data:
        loss_fn(m, x, y).backward()
        opt.step()
        assert opt.metrics()["host_bytes"] <= need
    assert opt.metrics()["host_bytes"] == need
    opt.close()


def test_the_advice_names_only_options_of_a_host_session():
    m = make_model(0, "cpu", torch.float32)
    for moment_dtype in ("f32", "bf16"):
        with pytest.raises(SuperOffloadError) as e:
            SuperOffloadAdamW(m.parameters(), model=m, host_memory_limit=1 << 20, moment_dtype=moment_dtype)
        msg = e.value.message
        assert "host_memory_limit" in msg and not any(o in msg for o in CUDA_ONLY), msg
        assert ('moment_dtype="bf16"' in msg) == (moment_dtype == "f32"), msg


def test_the_sessions_own_refusal_in_host_mode_advises_no_cuda_option():
    numel = 1 << 16
    master, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    s = superoffload.Session(cuda=False, host_memory_limit=1 << 10)
    s.add_group(1e-3, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(SuperOffloadError) as e:  # the moments are lent: the gradient buffer is refused
        s.add_subgroup(0, master.data_ptr(), numel, [("w", 0, numel)], keep=[master, m, v], exp_avg=m.data_ptr(),
                       exp_avg_sq=v.data_ptr())
    msg = e.value.message
    assert e.value.status == superoffload.Status.OUT_OF_RESOURCES
    assert "bf16 moments" in msg and not any(o in msg for o in CUDA_ONLY), msg
    s.close()


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1e9 + 0.5, ValueError), (float("inf"), ValueError),
                                        (float("nan"), ValueError), (1 << 64, ValueError), (True, TypeError),
                                        ("1G", TypeError), (None, TypeError)])
def test_bad_limits_are_refused(bad, error):
    m = make_model(0, "cpu", torch.float32)
    with pytest.raises(error, match="host_memory_limit"):
        SuperOffloadAdamW(m.parameters(), model=m, host_memory_limit=bad)


def test_whole_float_limits_are_bytes():
    m = make_model(0, "cpu", torch.float32)
    SuperOffloadAdamW(m.parameters(), model=m, host_memory_limit=1e9).close()


def test_parameters_outside_the_model_are_refused_by_name():
    m = make_model(0, "cpu", torch.float32)
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    named = list(m.named_parameters()) + [("stray.weight", stray)]
    with pytest.raises(ValueError, match=r"'stray.weight' \(shape \(3, 5\)\) is not a parameter of `model`"):
        SuperOffloadAdamW(named, model=m)
    groups = [{"params": list(m.parameters())}, {"params": [stray]}]
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 \(shape \(3, 5\)\)"):
        SuperOffloadAdamW(groups, model=m)
    SuperOffloadAdamW([stray], lr=1e-3).close()  # without a model it has no forward order to miss


def test_the_staging_of_later_micro_steps_counts_against_the_limit():
    """Under FSDP2's offload on a GPU, later micro-steps' gradients pass through pinned staging
    buffers: the limit counts them beside the gradient buffers they are added into."""
    from types import SimpleNamespace

    from superoffload.torch import _buffers, _fsdp

    infos = [SimpleNamespace(numel=n) for n in (1000, 3000, 2000)]
    staging = _fsdp.staging_bytes(infos, torch.bfloat16)
    assert staging == _fsdp.STAGING_BUFFERS * 3000 * 2
    subgroups = [SimpleNamespace(numel=i.numel) for i in infos]
    common = dict(masters=False, moment_dtype="bf16", session_bytes=0, session_lower=[], grad_dtype="bf16")
    state = 6000 * (2 * 2 + 2)  # two bf16 moments and a bf16 gradient a parameter
    assert _buffers.check_host_memory(subgroups, limit=state, **common) == state
    assert _buffers.check_host_memory(subgroups, limit=state + staging, staging_bytes=staging, **common) == state + staging
    with pytest.raises(SuperOffloadError) as e:
        _buffers.check_host_memory(subgroups, limit=state + staging - 1, staging_bytes=staging, **common)
    assert more_bytes_needed(e.value.message) == 1 and "staging" in e.value.message
