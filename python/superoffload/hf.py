"""Hugging Face Trainer with SuperOffloadAdamW: exact gradient clipping with overlap.

    from superoffload.hf import SuperOffloadTrainer
    args = TrainingArguments(..., max_grad_norm=1.0, gradient_accumulation_steps=2, bf16=True)
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=ds,
                                  superoffload_kwargs=dict(sub_group_numel=1 << 25))
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

What it does:
- builds `SuperOffloadAdamW` from `TrainingArguments`: learning_rate, adam_beta1/2, adam_epsilon,
  weight_decay (Trainer's decay / no-decay split), `max_grad_norm` (the optimizer clips exactly,
  with speculative steps during backward) and `gradient_accumulation_steps`; Trainer's own
  clipping is turned off in the Trainer's copy of the arguments (`trainer.args.max_grad_norm`
  is 0; the `TrainingArguments` passed in keep their value), which it says once in the log;
- logs the session's global norm as Trainer's `grad_norm`, plus `clip_coef` and
  `optimizer_exposed_s` (seconds the training loop spent in the optimizer's hand-offs, step()
  and waits since the step before) and, on a skipped step, `optimizer_skipped`;
- checkpoints and resumes through Trainer's own `save_steps` / `resume_from_checkpoint`
  (`optimizer.pt` holds the torch-native state dict; it is loaded memory-mapped); the resumed run
  equals the uninterrupted one bit for bit, whatever the settings (the speculation history
  travels in the state dict);
- weights are final whenever Trainer or a callback reads them at an event that does not cost
  overlap: `on_log`, `on_save`, `on_evaluate`, `on_epoch_end`, `on_train_end` (Trainer's own
  reads, model.state_dict() for saving and forwards for evaluation, wait by themselves).

The rule for direct parameter reads: inside a forward, `model.state_dict()`, or in the callbacks
above, the weights are final. Anywhere else between steps (an EMA in `on_step_end`, a custom save,
`p.detach().cpu()` in your loop) call `superoffload.hf.synchronize(trainer)` first, or pass
`sync_every_step=True` (which costs the overlap of the next forward with the optimizer's
finalization).

transformers and accelerate are optional dependencies: `pip install superoffload[hf]`.
"""
import copy
import logging
import os

import torch
from transformers import Trainer, TrainerCallback

from .torch import SuperOffloadAdamW

logger = logging.getLogger("superoffload")

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"


def unwrap_optimizer(opt):
    """The SuperOffloadAdamW inside accelerate's wrapper (or None)."""
    seen = 0
    while opt is not None and not isinstance(opt, SuperOffloadAdamW) and seen < 4:
        opt = getattr(opt, "optimizer", None)
        seen += 1
    return opt if isinstance(opt, SuperOffloadAdamW) else None


def synchronize(trainer, host=True):
    """Makes the latest step's weights final for direct reads (see the module docstring)."""
    opt = unwrap_optimizer(getattr(trainer, "optimizer", None))
    if opt is not None and not opt.closed:
        opt.synchronize(host=host)


class SuperOffloadCallback(TrainerCallback):
    """Synchronizes the optimizer at the events where Trainer or callbacks read weights."""

    def __init__(self, trainer, sync_every_step=False):
        self.trainer = trainer
        self.sync_every_step = sync_every_step

    def _sync(self):
        synchronize(self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        if self.sync_every_step:
            self._sync()

    def on_log(self, args, state, control, **kwargs):
        self._sync()

    def on_save(self, args, state, control, **kwargs):
        self._sync()

    def on_evaluate(self, args, state, control, **kwargs):
        self._sync()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._sync()

    def on_train_end(self, args, state, control, **kwargs):
        self._sync()


def make_optimizer(model, args, max_grad_norm, decay_parameters, **superoffload_kwargs):
    """SuperOffloadAdamW from TrainingArguments, with Trainer's weight-decay groups."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = set(decay_parameters)
    groups = [{"params": [(n, p) for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0}]
    kw = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
              max_grad_norm=max_grad_norm, accumulation_steps=args.gradient_accumulation_steps, model=model)
    kw.update(superoffload_kwargs)
    return SuperOffloadAdamW(groups, **kw)


class SuperOffloadTrainer(Trainer):
    """transformers.Trainer whose optimizer is SuperOffloadAdamW (see the module docstring).

    Args (beyond Trainer's):
        superoffload_kwargs: extra SuperOffloadAdamW arguments (sub_group_numel, cores,
            cores_fraction, moment_dtype, speculation, gpu_fraction, ...).
        sync_every_step: make the weights final at every on_step_end (costs overlap).
    """

    def __init__(self, *args, superoffload_kwargs=None, sync_every_step=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.superoffload_kwargs = dict(superoffload_kwargs or {})
        self.superoffload_max_grad_norm = float(self.args.max_grad_norm or 0.0)
        if self.superoffload_max_grad_norm > 0:
            logger.warning("SuperOffloadTrainer: gradient clipping (max_grad_norm=%g) is done exactly by "
                           "SuperOffloadAdamW; Trainer's own clipping is turned off (trainer.args.max_grad_norm "
                           "= 0, in the Trainer's copy of the arguments)", self.superoffload_max_grad_norm)
        # A copy: the caller's TrainingArguments may serve another Trainer, which must still clip.
        self.args = copy.copy(self.args)
        self.args.max_grad_norm = 0.0
        self.callback_handler.callbacks.insert(0, SuperOffloadCallback(self, sync_every_step))

    @property
    def superoffload_optimizer(self):
        return unwrap_optimizer(self.optimizer)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            self.optimizer = make_optimizer(opt_model, self.args, self.superoffload_max_grad_norm,
                                            self.get_decay_parameter_names(opt_model), **self.superoffload_kwargs)
        return self.optimizer

    def _get_grad_norm(self, model, grad_norm=None):
        # The norm is the session's (logged in log()); nothing to compute over p.grad, which the
        # optimizer has already taken.
        return grad_norm

    def log(self, logs, *args, **kwargs):
        opt = self.superoffload_optimizer
        if opt is not None and "loss" in logs and not opt.closed:
            m = opt.metrics()
            if m:
                logs["grad_norm"] = m["global_norm"]
                logs["clip_coef"] = m["clip_coef"]
                logs["optimizer_exposed_s"] = m["exposed_s"]
                if m["skipped"]:
                    logs["optimizer_skipped"] = 1.0
        return super().log(logs, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Plain (non-DeepSpeed, non-FSDP, non-XLA) runs: optimizer.pt is loaded memory-mapped, so
        resuming does not hold a second copy of the state in RAM."""
        opt = self.superoffload_optimizer
        path = os.path.join(checkpoint, OPTIMIZER_NAME) if checkpoint else None
        plain = not getattr(self, "is_deepspeed_enabled", False) and not getattr(self, "is_fsdp_enabled", False)
        if opt is None or path is None or not plain or not os.path.isfile(path) or \
                not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, TypeError):  # an old-format file: no mmap
            state = torch.load(path, map_location="cpu", weights_only=True)
        opt.load_state_dict(state)
        del state
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
