"""Hugging Face Trainer with SuperOffloadTrainer on a tiny LlamaConfig model, on the CPU (host
mode, f32): parity with Trainer's own AdamW under clipping, grad_norm from the session, the
clipping hand-over log line, resume through save_steps / resume_from_checkpoint bit for bit,
gradient accumulation 2, weights final at on_log."""
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from superoffload.hf import SuperOffloadTrainer, unwrap_optimizer  # noqa: E402

torch.set_num_threads(2)
VOCAB, SEQ = 64, 16


def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def dataset(n=64):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        a, c = torch.randint(1, VOCAB, (1,), generator=g), torch.randint(0, VOCAB, (1,), generator=g)
        x = [int(torch.randint(0, VOCAB, (1,), generator=g))]
        for _ in range(SEQ - 1):
            x.append(int((x[-1] * a + c) % VOCAB))
        ids = torch.tensor(x)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def args(tmp, **kw):
    base = dict(output_dir=str(tmp), per_device_train_batch_size=4, max_steps=12, learning_rate=3e-3,
                max_grad_norm=0.5, weight_decay=0.1, warmup_steps=2, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def rel(a, b):
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


class Norms(TrainerCallback):
    """Records, at each on_log, the optimizer's last result (must be final there)."""

    def __init__(self):
        self.trainer = None
        self.seen = []

    def on_log(self, args, state, control, **kw):
        opt = unwrap_optimizer(self.trainer.optimizer)
        if "loss" in kw.get("logs", {}) and opt is not None and opt.last_step_result(wait=False) is not None:
            self.seen.append((state.global_step, opt.last_step_result(wait=False)["global_norm"]))


def test_trainer_parity_grad_norm_and_log_line(tmp_path, caplog):
    ds = dataset()
    ref = Trainer(model=model(), args=args(tmp_path / "ref"), train_dataset=ds)
    ref.train()
    norms = Norms()
    user_args = args(tmp_path / "ours")
    with caplog.at_level(logging.WARNING, logger="superoffload"):
        ours = SuperOffloadTrainer(model=model(), args=user_args, train_dataset=ds,
                                   callbacks=[norms], superoffload_kwargs=dict(sub_group_numel=4096))
    norms.trainer = ours
    assert any("clipping" in r.message and "turned off" in r.message for r in caplog.records)
    assert ours.args.max_grad_norm == 0.0 and user_args.max_grad_norm == 0.5  # the caller's arguments unchanged
    ours.train()
    a, b = train_logs(ours), train_logs(ref)
    assert len(a) == len(b) == 12
    d = rel([x["loss"] for x in a], [x["loss"] for x in b])
    assert sum(d) / len(d) <= 1e-3, d
    assert sum(x["clip_coef"] < 1 for x in a) > 0  # clipping active
    # Trainer's grad_norm is the session's norm (and agrees with Trainer's own AdamW run)
    assert [x["grad_norm"] for x in a] == [n for _, n in norms.seen]
    dn = rel([x["grad_norm"] for x in a], [x["grad_norm"] for x in b])
    assert max(dn) <= 1e-3, dn
    assert all("optimizer_exposed_s" in x for x in a)
    assert unwrap_optimizer(ours.optimizer).max_grad_norm == 0.5


def _weights(m):
    return [p.detach().clone() for p in m.parameters()]


def test_trainer_resume_bit_for_bit(tmp_path):
    # clipping active, the default settings (speculation auto)
    ds = dataset()
    kw = dict(save_strategy="steps", save_steps=6)
    full = SuperOffloadTrainer(model=model(), args=args(tmp_path / "run", **kw), train_dataset=ds,
                               superoffload_kwargs=dict(sub_group_numel=4096))
    full.train()
    wa = _weights(full.model)
    la = [x["loss"] for x in train_logs(full)][6:]
    resumed = SuperOffloadTrainer(model=model(), args=args(tmp_path / "run", **kw), train_dataset=ds,
                                  superoffload_kwargs=dict(sub_group_numel=4096))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-6"))
    lb = [x["loss"] for x in train_logs(resumed)]
    wb = _weights(resumed.model)
    assert la == lb[-6:]
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    st = torch.load(tmp_path / "run" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert st["state"] and "exp_avg" in st["state"][0] and "master" in st["state"][0]


def test_trainer_accumulation_2(tmp_path):
    ds = dataset()
    ref = Trainer(model=model(), args=args(tmp_path / "ref", gradient_accumulation_steps=2, max_steps=8,
                                           per_device_train_batch_size=2), train_dataset=ds)
    ref.train()
    ours = SuperOffloadTrainer(model=model(), args=args(tmp_path / "ours", gradient_accumulation_steps=2, max_steps=8,
                                                        per_device_train_batch_size=2), train_dataset=ds)
    ours.train()
    assert unwrap_optimizer(ours.optimizer).accumulation_steps == 2
    a, b = train_logs(ours), train_logs(ref)
    d = rel([x["loss"] for x in a], [x["loss"] for x in b])
    assert len(d) == 8 and sum(d) / len(d) <= 1e-3, d
