#!/usr/bin/env python3
"""The package's checks that need a GPU (the GPU machine: torch with CUDA, transformers,
accelerate; no Rust, no network). Install the wheel built elsewhere, then:

    pip install --no-deps superoffload-*.whl      # or: --target DIR and PYTHONPATH=DIR
    python3 python/tests/gpu_checks.py [--json out.json] [--only torch,trainer]

CUDA mode, SuperOffloadAdamW on a tiny GPT (python/tests/_models.py), deterministic algorithms:
  cuda_parity          bf16 parameters vs torch.optim.AdamW on f32 masters, clipping active:
                       mean relative loss difference <= 1e-3 over 40 steps
  cuda_speculation     clipping off: speculative and non-speculative sessions bit-identical
  cuda_resume          defaults (speculation auto), clipping on some steps: state_dict() through torch.save
                       half-way, the rest resumes bit for bit
  cuda_rerun           defaults, clipping on some steps: two runs (one beside a busy thread) bit-identical
  cuda_accumulation    accumulation_steps=2 vs the reference
  cuda_gpu_fraction    gpu_fraction=0.3: parity with clipping, resume bit for bit
  cuda_bf16_moments    moment_dtype="bf16": parity within 1e-2, 12 B/param less 4
  cuda_direct_read     after step() + synchronize() the parameters equal the masters bit for bit
  cuda_state_dict_read model.state_dict() read right after each step (no other host wait)
  cuda_budget_fraction gpu_budget_bytes="auto" under torch's per-process memory fraction: the budget
                       is what the cap leaves, not the device's free memory
  cuda_lean_memory     gradient_home="device" and host_copy="bounded" (the gradient kept on the GPU, the
                       copy written piece by piece as it is published): the bits of the full host buffers
                       with clipping on some steps, resume bit for bit, and no host bytes beyond the state
  cuda_fsdp2_offload   FSDP2 with CPUOffloadPolicy (f32 host shards, and bf16 host shards the session
                       writes as the weights' copy; bf16 compute, one rank): the same losses and master
                       weights bit for bit as the CUDA mode on bf16 parameters with the same
                       sub-groups, clipping every step (speculation off), unclipped (speculation on)
                       and with accumulation_steps=2; 2 bytes a parameter of lent bf16 gradient
                       buffers; bf16 shards equal to the master weights rounded; shards read ahead
                       onto the GPU (ShardPrefetcher) in every run
Hugging Face Trainer on a LlamaConfig-built model (f32 parameters, bf16 autocast, full_determinism):
  trainer_parity       SuperOffloadTrainer vs Trainer's AdamW, max_grad_norm active, >= 30 steps:
                       mean relative loss difference <= 1e-3
  trainer_grad_norm    at every step, the logged grad_norm is the library's global norm of that step, which
                       equals the norm of the gradients backward handed over (summed by hooks that run
                       before the optimizer's), and the logged clip_coef is torch's for that norm
  trainer_resume       checkpoint at step 15 + resume_from_checkpoint == the uninterrupted run
  trainer_final        weights read right after trainer.train() equal the optimizer's masters
  trainer_accumulation gradient_accumulation_steps=2 vs Trainer's AdamW
Prints one PASS/FAIL line per check and a summary; exit status 1 if any fails.
"""
import argparse
import io
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

RESULTS = []
ONLY = set()


def check(name, ok, **detail):
    RESULTS.append({"check": name, "pass": bool(ok), **detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: " + ", ".join(f"{k}={v}" for k, v in detail.items()), flush=True)
    return ok


def rel(a, b):
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


# ---- torch ------------------------------------------------------------------------------------

def torch_checks(dev):
    from _models import MasterAdamW, backward_batch, loss_fn, lr_lambda, make_data, make_model, param_groups
    from superoffload.torch import SuperOffloadAdamW

    LR, BETAS, EPS, WD, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.3
    data = make_data(40, 16, 32, 64)
    dt = torch.bfloat16

    def ours(m, **kw):
        kw.setdefault("max_grad_norm", CLIP)
        kw.setdefault("sub_group_numel", 20000)
        # The offloaded path unless a check says otherwise: the automatic budget (the default)
        # would place this small model on the GPU after the warm-up steps.
        kw.setdefault("gpu_budget_bytes", 0)
        return SuperOffloadAdamW(param_groups(list(m.named_parameters()), WD), lr=LR, betas=BETAS, eps=EPS, model=m,
                                 **kw)

    def train(m, opt, sched, batches, acc=1):
        losses, res = [], []
        for x, y in batches:
            x, y = x.to(dev), y.to(dev)
            tot = backward_batch(m, x, y, acc)
            opt.step()
            sched.step()
            losses.append(tot)
            res.append(opt.last_step_result() if isinstance(opt, SuperOffloadAdamW) else None)
        return losses, res

    def ref_run(batches, acc=1):
        m = make_model(0, dev, dt)
        ref = MasterAdamW(m, LR, BETAS, EPS, WD, CLIP)
        s = torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda)
        losses = []
        for x, y in batches:
            x, y = x.to(dev), y.to(dev)
            tot = backward_batch(m, x, y, acc)
            ref.step()
            s.step()
            losses.append(tot)
        return losses

    def snap(m):
        return [p.detach().clone() for p in m.parameters()]

    def guarded(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            check(name, False, exception=repr(e)[:300])
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)

    ref_losses = ref_run(data)

    def parity():
        m = make_model(0, dev, dt)
        opt = ours(m, speculation=True)
        la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data)
        d = rel(la, ref_losses)
        clipped = sum(r["clip_coef"] < 1 for r in res)
        spec = res[-1]["speculative"]
        check("cuda_parity", sum(d) / len(d) <= 1e-3 and clipped > 0 and la[-1] < la[0] and spec > 0,
              steps=len(d), mean_rel_loss_diff=f"{sum(d) / len(d):.3e}", clipped_steps=clipped,
              speculative_last=spec, pinned_bytes=opt.memory()["pinned_bytes"], metrics_exposed_s=
              f"{opt.metrics()['exposed_s']:.4f}")
        opt.close()

    def speculation():
        runs = []
        for spec in (True, False):
            m = make_model(0, dev, dt)
            opt = ours(m, speculation=spec, max_grad_norm=1e6)
            la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:16])
            runs.append((la, snap(m), res, len(opt.subgroups())))
            opt.close()
        (la, wa, ra, n), (lb, wb, rb, _) = runs
        same = la == lb and all(torch.equal(p, q) for p, q in zip(wa, wb))
        kept = all(r["kept"] + r["stepped"] == n and r["rescaled"] == 0 for r in ra) and sum(r["kept"] for r in ra) > 0
        check("cuda_speculation", same and kept, losses_and_weights_equal=same, all_kept=kept)

    def resume(**kw):  # clipping active on some steps, the defaults (speculation auto) unless given
        half = 12
        m = make_model(0, dev, dt)
        opt = ours(m, **kw)
        s = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        train(m, opt, s, data[:half])
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": s.state_dict()}, buf)
        la, _ = train(m, opt, s, data[half:24])
        wa = snap(m)
        opt.close()
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        m2 = make_model(7, dev, dt)
        opt2 = ours(m2, **kw)
        s2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda)
        m2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
        s2.load_state_dict(ck["sched"])
        lb, _ = train(m2, opt2, s2, data[half:24])
        same = la == lb and all(torch.equal(p, q) for p, q in zip(wa, snap(m2)))
        opt2.close()
        return same

    def resume_check():
        ok = resume(gpu_budget_bytes="auto")
        check("cuda_resume", ok, losses_and_weights_equal=ok)

    def rerun():
        # Two identical runs with the defaults and clipping on some steps: the same bits,
        # whatever the timing of the speculative passes (one run is slowed by a busy thread).
        runs = []
        for busy in (False, True):
            stop = threading.Event()

            def spin():
                while not stop.is_set():
                    pass

            spinner = threading.Thread(target=spin, daemon=True)
            if busy:
                spinner.start()
            m = make_model(0, dev, dt)
            opt = ours(m, gpu_budget_bytes="auto")
            la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:24])
            stop.set()
            runs.append((la, snap(m), sum(r["clip_coef"] < 1 for r in res), sum(r["speculative"] for r in res)))
            opt.close()
        (la, wa, clipped, spec), (lb, wb, _, _) = runs
        same = la == lb and all(torch.equal(p, q) for p, q in zip(wa, wb))
        check("cuda_rerun", same and clipped > 0 and spec > 0, losses_and_weights_equal=same, clipped_steps=clipped,
              speculative_steps=spec)

    def lean_memory():
        lean = dict(gradient_home="device", host_copy="bounded")
        runs = []
        for kw in (dict(gradient_home="host", host_copy="full"), lean):
            m = make_model(0, dev, dt)
            opt = ours(m, **kw)
            la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:24])
            params = sum(p.numel() for p in m.parameters())
            runs.append((la, snap(m), sum(r["clip_coef"] < 1 for r in res), opt.metrics()["host_bytes"] / params,
                         opt.session.device_bytes() / params))
            opt.close()
        (la, wa, clipped, full_host, _), (lb, wb, _, lean_host, lean_device) = runs
        same = la == lb and all(torch.equal(p, q) for p, q in zip(wa, wb))
        resumed = resume(**lean)
        # The Adam state alone (f32 master weights and moments, 12 bytes a parameter with padding)
        # and nothing of the session's; the full buffers add a bf16 gradient and a bf16 copy.
        check("cuda_lean_memory", same and resumed and clipped > 0 and lean_host < 12.5 and full_host > 15.5,
              losses_and_weights_equal=same, resumed=resumed, clipped_steps=clipped,
              host_bytes_per_param=f"{full_host:.2f} -> {lean_host:.2f}", device_bytes_per_param=f"{lean_device:.2f}")

    def accumulation():
        m = make_model(0, dev, dt)
        opt = ours(m, accumulation_steps=2)
        la, _ = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:16], acc=2)
        lb = ref_run(data[:16], acc=2)
        d = rel(la, lb)
        check("cuda_accumulation", sum(d) / len(d) <= 1e-3, mean_rel_loss_diff=f"{sum(d) / len(d):.3e}")
        opt.close()

    def gpu_fraction():
        m = make_model(0, dev, dt)
        opt = ours(m, gpu_fraction=0.3)
        n_gpu = len(opt.gpu_resident())
        la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data)
        d = rel(la, ref_losses)
        opt.close()
        ok_resume = resume(gpu_fraction=0.3)
        check("cuda_gpu_fraction", sum(d) / len(d) <= 1e-3 and n_gpu > 0 and ok_resume,
              gpu_resident=n_gpu, mean_rel_loss_diff=f"{sum(d) / len(d):.3e}", resume_bit_identical=ok_resume,
              device_stepped=res[-1]["device_stepped"])

    def bf16_moments():
        # Speculation on (the copy steps ahead, clipping on some steps) and off: the same bits.
        runs = []
        for spec in (True, False):
            m = make_model(0, dev, dt)
            opt = ours(m, moment_dtype="bf16", speculation=spec)
            # Before the first step: the state alone (the gradients and copies are provisioned
            # at the first step, from the memory measured then).
            host_bytes = opt.memory()["host_bytes_per_param"]
            la, res = train(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data[:20])
            runs.append((la, snap(m), res, host_bytes))
            opt.close()
        (la, wa, res, host_bytes), (lb, wb, _, _) = runs
        f32 = ours(make_model(0, dev, dt))
        saved = f32.memory()["host_bytes_per_param"] - host_bytes
        f32.close()
        d = rel(la, ref_losses[:20])
        same = la == lb and all(torch.equal(p, q) for p, q in zip(wa, wb))
        kept = sum(r["kept"] for r in res)
        clipped = sum(r["clip_coef"] < 1 for r in res)
        check("cuda_bf16_moments", sum(d) / len(d) <= 1e-2 and saved >= 3.9 and same and kept > 0 and clipped > 0,
              mean_rel_loss_diff=f"{sum(d) / len(d):.3e}", host_bytes_saved_per_param=f"{saved:.2f}",
              same_bits_as_speculation_off=same, kept=kept, clipped_steps=clipped)

    def direct_read():
        m = make_model(0, dev, dt)
        opt = ours(m, copy_dtype=os.environ.get("SO_GPU_CHECKS_COPY_DTYPE", "auto"))
        x, y = data[0][0].to(dev), data[0][1].to(dev)
        loss_fn(m, x, y).backward()
        opt.step()
        opt.synchronize()
        ws = {n: p.detach().float().cpu() for n, p in m.named_parameters()}  # on the current stream, after the wait
        sd = opt.state_dict()
        masters = {sd["superoffload"]["names"][i]: st["master"] for i, st in sd["state"].items()}
        same = all(torch.equal(ws[n], masters[n].to(torch.bfloat16).float()) for n in masters)
        check("cuda_direct_read", same, params_equal_published_masters=same)
        opt.close()

    def state_dict_read():
        # model.state_dict() (its hook synchronizes) and a read right after every step, no other
        # host wait: the pattern of a checkpoint save or an EMA between steps
        m = make_model(0, dev, dt)
        opt = ours(m)
        sums = []
        for x, y in data[:8]:
            loss_fn(m, x.to(dev), y.to(dev)).backward()
            opt.step()
            sd = m.state_dict()
            sums.append(float(sd["head.weight"].float().cpu().sum()))
        n = opt.last_step_result()["step"]
        check("cuda_state_dict_read", n == 8 and all(math.isfinite(v) for v in sums), steps=n)
        opt.close()

    def budget_under_fraction():
        # torch's per-process cap, which the device's free memory does not show: the automatic
        # budget takes what the cap leaves (64 MiB beyond the headroom's 1 GiB), not the device.
        m = make_model(0, dev, dt)
        opt = ours(m, gpu_budget_bytes="auto")
        x, y = data[0][0].to(dev), data[0][1].to(dev)
        loss_fn(m, x, y).backward()
        opt.step()
        opt.synchronize()
        room = 64 << 20
        total = torch.cuda.get_device_properties(dev).total_memory
        cap = torch.cuda.memory_reserved(dev) + opt.session.device_bytes() + (1 << 30) + room
        torch.cuda.set_per_process_memory_fraction(cap / total, dev)
        try:
            for x, y in data[1:6]:
                loss_fn(m, x.to(dev), y.to(dev)).backward()
                opt.step()
            budget = opt.session.gpu_budget()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        check("cuda_budget_fraction", budget is not None and 0 < budget <= room, budget_bytes=budget,
              cap_bytes=cap)
        opt.close()

    def one_rank_process_group():
        """The NCCL process group of one rank the FSDP2 checks shard over (made once)."""
        import socket
        import torch.distributed as dist
        if not dist.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)

    def fsdp2_offload():
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from superoffload.torch import _fsdp
        one_rank_process_group()
        policies = dict(mp_policy=MixedPrecisionPolicy(param_dtype=dt), offload_policy=CPUOffloadPolicy())
        hp = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        outcomes = {}
        runs = [(f"{shards} {label}", shards, clip, spec, acc) for shards in ("f32", "bf16")
                for label, clip, spec, acc in (("clipped", CLIP, False, 1), ("unclipped", 0.0, True, 1),
                                               ("accumulated", CLIP, False, 2))]
        for label, shards, clip, spec, acc in runs:
            sharded = make_model(0, dev, dt)  # bf16 values: both start from the same masters
            if shards == "f32":
                sharded = sharded.float()
            for blk in sharded.blocks:
                fully_shard(blk, **policies)
            fully_shard(sharded, **policies)
            oa = SuperOffloadAdamW(sharded.named_parameters(), model=sharded, max_grad_norm=clip, speculation=spec,
                                   accumulation_steps=acc, **hp)
            order = [names[0] for _, _, _, names in oa.subgroups()]  # the order FSDP2 gathers them in
            plain = make_model(0, dev, dt)
            named = dict(plain.named_parameters())
            ob = SuperOffloadAdamW([(n, named[n]) for n in order], max_grad_norm=clip, speculation=spec,
                                   accumulation_steps=acc, sub_group_numel=0, gpu_budget_bytes=0, wait="step", **hp)
            la, _ = train(sharded, oa, torch.optim.lr_scheduler.LambdaLR(oa, lr_lambda), data[:12], acc)
            lb, _ = train(plain, ob, torch.optim.lr_scheduler.LambdaLR(ob, lr_lambda), data[:12], acc)
            oa.synchronize(host=True)
            ob.synchronize(host=True)
            local = {n: p.to_local().reshape(-1) for n, p in sharded.named_parameters()}
            masters = {sg.params[0].name: sg.master for sg in ob._subgroups}
            ours = {sg.params[0].name: sg.master for sg in oa._subgroups} if shards == "bf16" else local
            same = all(torch.equal(ours[n], masters[n]) for n in order)
            rounded = all(torch.equal(local[n], masters[n].to(local[n].dtype)) for n in order)
            mem = oa.memory()
            # The lent bf16 gradient buffers (2 bytes a parameter), and with accumulation the
            # bounded pinned staging of the later micro-steps, the size the refusal counts.
            staging = _fsdp.staging_bytes(oa._by_param.values(), dt) if acc > 1 else 0
            outcomes[label] = dict(losses_equal=la == lb, masters_equal=same, shards_rounded=rounded,
                                   falls=la[-1] < la[0], grad_bytes_per_param=mem["grad_bytes"] / mem["params"],
                                   grad_bytes_expected=mem["grad_bytes"] == 2 * mem["params"] + staging,
                                   groups_read_ahead=oa._prefetcher.groups_read_ahead if oa._prefetcher else 0)
            oa.close()
            ob.close()
        ok = all(o["losses_equal"] and o["masters_equal"] and o["shards_rounded"] and o["falls"]
                 and o["grad_bytes_expected"] and o["groups_read_ahead"] > 0 for o in outcomes.values())
        check("cuda_fsdp2_offload", ok, **outcomes)

    def fsdp2_one_rank():
        """FSDP2 with bf16 shards on the GPU, one rank: the gradients taken from FSDP2's unsharded
        parameters as backward produces them, each FSDP2 module's forward waiting for its own
        sub-groups; the same losses and master weights as the CUDA mode on the plain model with
        the same sub-groups, clipped and unclipped."""
        from torch.distributed.fsdp import fully_shard
        one_rank_process_group()
        hp = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        outcomes = {}
        for label, clip, spec in (("clipped", CLIP, False), ("unclipped", 0.0, True)):
            sharded = make_model(0, dev, dt)
            for blk in sharded.blocks:
                fully_shard(blk)
            fully_shard(sharded)
            oa = SuperOffloadAdamW(sharded.named_parameters(), model=sharded, max_grad_norm=clip, speculation=spec,
                                   gpu_budget_bytes=0, **hp)
            order = [names[0] for _, _, _, names in oa.subgroups()]
            plain = make_model(0, dev, dt)
            named = dict(plain.named_parameters())
            ob = SuperOffloadAdamW([(n, named[n]) for n in order], max_grad_norm=clip, speculation=spec,
                                   sub_group_numel=0, gpu_budget_bytes=0, wait="step", **hp)
            la, _ = train(sharded, oa, torch.optim.lr_scheduler.LambdaLR(oa, lr_lambda), data[:12])
            lb, _ = train(plain, ob, torch.optim.lr_scheduler.LambdaLR(ob, lr_lambda), data[:12])
            oa.synchronize(host=True)
            ob.synchronize(host=True)
            ours = {sg.params[0].name: sg.master for sg in oa._subgroups}
            masters = {sg.params[0].name: sg.master for sg in ob._subgroups}
            outcomes[label] = dict(losses_equal=la == lb, masters_equal=all(torch.equal(ours[n], masters[n])
                                                                            for n in order),
                                   falls=la[-1] < la[0], unsharded_handed=oa._handoff.unsharded_handed,
                                   expected=12 * len(order), waits=oa._waits.mode)
            oa.close()
            ob.close()
        ok = all(o["losses_equal"] and o["masters_equal"] and o["falls"] and o["unsharded_handed"] == o["expected"]
                 and o["waits"] == "module" for o in outcomes.values())
        check("cuda_fsdp2_one_rank", ok, **outcomes)

    for name, fn in (("cuda_fsdp2_one_rank", fsdp2_one_rank), ("cuda_fsdp2_offload", fsdp2_offload), ("cuda_state_dict_read", state_dict_read), ("cuda_budget_fraction", budget_under_fraction), ("cuda_parity", parity), ("cuda_speculation", speculation), ("cuda_resume", resume_check),
                     ("cuda_rerun", rerun),
                     ("cuda_accumulation", accumulation), ("cuda_gpu_fraction", gpu_fraction),
                     ("cuda_bf16_moments", bf16_moments), ("cuda_direct_read", direct_read),
                     ("cuda_lean_memory", lean_memory)):
        if name in ONLY or "torch" in ONLY:
            guarded(name, fn)


# ---- Hugging Face Trainer ---------------------------------------------------------------------

def trainer_checks(dev, steps):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from superoffload.hf import SuperOffloadTrainer, unwrap_optimizer

    vocab, seq, CLIP = 256, 64, 0.5

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, use_cache=False,
                          tie_word_embeddings=False, attn_implementation="eager")
        return LlamaForCausalLM(cfg)

    g = torch.Generator().manual_seed(1)
    ds = []
    for _ in range(512):
        a, c = torch.randint(1, vocab, (1,), generator=g), torch.randint(0, vocab, (1,), generator=g)
        x = [int(torch.randint(0, vocab, (1,), generator=g))]
        for _ in range(seq - 1):
            x.append(int((x[-1] * a + c) % vocab))
        ids = torch.tensor(x)
        ds.append({"input_ids": ids, "labels": ids.clone()})

    def args(out, **kw):
        base = dict(output_dir=out, per_device_train_batch_size=8, max_steps=steps, learning_rate=2e-3,
                    max_grad_norm=CLIP, weight_decay=0.1, warmup_steps=3, logging_steps=1, save_strategy="no",
                    report_to=[], seed=0, data_seed=0, bf16=True, full_determinism=True, disable_tqdm=True,
                    dataloader_num_workers=0)
        base.update(kw)
        return TrainingArguments(**base)

    class StepResults(TrainerCallback):
        """The optimizer's step result at each on_log, by Trainer's step."""

        def __init__(self):
            self.trainer, self.by_step = None, {}

        def on_log(self, a, state, control, logs=None, **kw):
            opt = unwrap_optimizer(self.trainer.optimizer)
            if logs and "loss" in logs and opt is not None:
                self.by_step[state.global_step] = opt.last_step_result(wait=False)

    class GradNorms(TrainerCallback):
        """The norm of the gradients backward produced in each step, from post-accumulate-grad
        hooks registered before the optimizer's own (which takes p.grad)."""

        def __init__(self, m):
            self.sumsq, self.by_step = 0.0, {}
            for p in m.parameters():
                p.register_post_accumulate_grad_hook(self.add)

        def add(self, p):
            self.sumsq = self.sumsq + p.grad.detach().double().square().sum()

        def on_step_end(self, a, state, control, **kw):
            self.by_step[state.global_step] = math.sqrt(float(self.sumsq))
            self.sumsq = 0.0

    def logs(t):
        return [h for h in t.state.log_history if "loss" in h]

    tmp = tempfile.mkdtemp(prefix="so-hf-")
    try:
        ref = Trainer(model=model(), args=args(f"{tmp}/ref"), train_dataset=ds)
        ref.train()
        results = StepResults()
        ours_model = model()
        grads = GradNorms(ours_model)
        ours = SuperOffloadTrainer(model=ours_model, args=args(f"{tmp}/ours"), train_dataset=ds,
                                   callbacks=[results, grads], superoffload_kwargs=dict(sub_group_numel=1 << 18))
        results.trainer = ours
        ours.train()
        opt = unwrap_optimizer(ours.optimizer)
        # weights right after train(): a direct read, as a user would; then the masters
        ws = {n: p.detach().cpu().clone() for n, p in ours.model.named_parameters()}
        sd = opt.state_dict()
        masters = {sd["superoffload"]["names"][i]: st["master"].reshape(-1) for i, st in sd["state"].items()}
        final = all(torch.equal(ws[n].reshape(-1).to(masters[n].dtype), masters[n]) for n in masters)
        a, b = logs(ours), logs(ref)
        d = rel([x["loss"] for x in a], [x["loss"] for x in b])
        clipped = sum(x["clip_coef"] < 1 for x in a)
        check("trainer_parity", len(d) >= 30 and sum(d) / len(d) <= 1e-3 and clipped > 0, steps=len(d),
              mean_rel_loss_diff=f"{sum(d) / len(d):.3e}", clipped_steps=clipped,
              first_loss=round(a[0]["loss"], 4), last_loss=round(a[-1]["loss"], 4))
        logged_is_library = all(
            results.by_step.get(x["step"]) is not None and results.by_step[x["step"]]["step"] == x["step"]
            and x["grad_norm"] == results.by_step[x["step"]]["global_norm"]
            and x["clip_coef"] == results.by_step[x["step"]]["clip_coef"] for x in a)
        dn = [abs(x["grad_norm"] - grads.by_step[x["step"]]) / grads.by_step[x["step"]] for x in a]
        dc = [abs(x["clip_coef"] - min(1.0, CLIP / (grads.by_step[x["step"]] + 1e-6))) for x in a]
        check("trainer_grad_norm", len(a) == steps and logged_is_library and max(dn) <= 1e-5 and max(dc) <= 1e-5
              and clipped > 0, logged_steps=len(a), logged_is_library_result_of_that_step=logged_is_library,
              max_rel_diff_vs_handed_over_gradients=f"{max(dn):.3e}", max_clip_coef_diff_vs_torch=f"{max(dc):.3e}",
              clipped_steps=clipped)
        check("trainer_final", final, weights_equal_masters_after_train=final)

        k = steps // 2
        so_kw = dict(sub_group_numel=1 << 18, speculation=False)  # clipped + bit for bit: every step exact
        full = SuperOffloadTrainer(model=model(), args=args(f"{tmp}/run", save_strategy="steps", save_steps=k),
                                   train_dataset=ds, superoffload_kwargs=so_kw)
        full.train()
        wa = [p.detach().cpu().clone() for p in full.model.parameters()]
        la = [x["loss"] for x in logs(full)]
        res = SuperOffloadTrainer(model=model(), args=args(f"{tmp}/run", save_strategy="steps", save_steps=k),
                                  train_dataset=ds, superoffload_kwargs=so_kw)
        res.train(resume_from_checkpoint=f"{tmp}/run/checkpoint-{k}")
        lb = [x["loss"] for x in logs(res)]
        wb = [p.detach().cpu().clone() for p in res.model.parameters()]
        same = la[k:] == lb[-(steps - k):] and all(torch.equal(x, y) for x, y in zip(wa, wb))
        check("trainer_resume", same, checkpoint_step=k, losses_and_weights_equal=same)

        acc_args = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4)
        ref2 = Trainer(model=model(), args=args(f"{tmp}/ref2", **acc_args), train_dataset=ds)
        ref2.train()
        ours2 = SuperOffloadTrainer(model=model(), args=args(f"{tmp}/ours2", **acc_args), train_dataset=ds)
        ours2.train()
        d2 = rel([x["loss"] for x in logs(ours2)], [x["loss"] for x in logs(ref2)])
        check("trainer_accumulation", sum(d2) / len(d2) <= 1e-3, steps=len(d2),
              mean_rel_loss_diff=f"{sum(d2) / len(d2):.3e}")
    except Exception as e:
        traceback.print_exc()
        check("trainer", False, exception=repr(e)[:300])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--only", default="torch,trainer")
    ap.add_argument("--trainer-steps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks.py: no GPU (torch.cuda.is_available() is False)")
        sys.exit(77)
    import superoffload
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"superoffload {superoffload.__version__} ({superoffload.library_path()}); torch {torch.__version__}; "
          f"{torch.cuda.get_device_name(dev)}; library CUDA: {superoffload.cuda_available()}", flush=True)
    only = args.only.split(",")
    ONLY.update(only)
    if "torch" in only or any(o.startswith("cuda_") for o in only):
        torch_checks(dev)
    if "trainer" in only:
        try:
            import transformers
            print(f"transformers {transformers.__version__}", flush=True)
        except ImportError:
            check("trainer", False, exception="transformers is not installed")
        else:
            trainer_checks(dev, args.trainer_steps)
    n_fail = sum(not r["pass"] for r in RESULTS)
    print(f"\ngpu_checks: {len(RESULTS) - n_fail} passed, {n_fail} failed")
    for r in RESULTS:
        print(f"  {'PASS' if r['pass'] else 'FAIL'}  {r['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()
