"""SuperOffloadAdamW's state in torch's layout (`state_dict`, `load_state_dict`, `optimizer.state`)
and in the library's checkpoint file (`save_checkpoint`, `load_checkpoint`).

The per-parameter tensors view the host buffers the session steps in place (master weights and
moments). With the dynamic loss scaler on, whose state lives only in the session, state goes in
and out through a checkpoint file the session writes or reads (`_checkpoint`)."""
import logging
import os
import tempfile

import torch

from .. import _abi, _core
from . import _checkpoint
from ._params import TORCH_DTYPES, DTensor, is_dtensor, local

logger = logging.getLogger("superoffload")

STATE_DICT_FORMAT = 2
_TORCH_ADAMW_KEYS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                         fused=None)
_GROUP_HPARAMS = ("lr", "beta1", "beta2", "eps", "weight_decay")


def _rank_local(x):
    return x.to_local() if is_dtensor(x) else x


def _set_group_hparams(param_groups, saved_groups):
    for g, saved in zip(param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params" and k in g:
                g[k] = tuple(v) if k == "betas" else v


class StateDictMixin:
    """The state methods of SuperOffloadAdamW (see the module docstring)."""

    # ---- torch's layout -------------------------------------------------------------------

    def state_dict(self):
        """torch.optim.AdamW's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq",
        "master"}}, "param_groups": [...]} with tensors shaped like the parameters (DTensors under
        FSDP2), plus {"superoffload": {...}} (format, parameter names, step count, loss scaler).
        The tensors view the host state (a mapped file the session wrote, with the loss scaler
        on); "master" is the f32 master weight. torch.optim.AdamW loads it (it ignores "master");
        `load_state_dict` takes it or a torch AdamW state dict."""
        self._check_idle("state_dict")
        self.synchronize(host=True)
        index, groups = 0, []
        for g in self.param_groups:
            entry = dict(_TORCH_ADAMW_KEYS)
            entry.update({k: v for k, v in g.items() if k != "params"})
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        so = {"format": STATE_DICT_FORMAT, "library_version": _core.version(), "steps": self._nsteps,
              "moment_dtype": self.moment_dtype, "names": {i.index: i.name for i in self._infos},
              "device_placed": [i.name for i in self._device_infos],
              # Which sub-groups speculate next is decided from it: a resume continues bit for bit.
              "speculation_history": list(self.session.speculation_history())}
        if self._nsteps == 0 and not self._loaded:
            # Like torch: no per-parameter state before the first step (and nothing to copy
            # when a wrapper round-trips the state dict, as accelerate's device placement does).
            return {"state": {}, "param_groups": groups, "superoffload": so}
        slices, scaler, file_meta = self._slice_states()
        state = {}
        for info in self._infos:
            if info.name in slices:
                master, m, v, step = slices[info.name]
            else:  # an empty local shard
                master, m, v = self._empty_state()
                step = self._subgroup_steps()
            copy = file_meta is not None
            state[info.index] = {"step": torch.tensor(float(step)), "exp_avg": self._wrap(info, m, copy),
                                 "exp_avg_sq": self._wrap(info, v, copy), "master": self._wrap(info, master, copy)}
        if scaler:
            so["loss_scaler"] = scaler
        if file_meta:
            so["checkpoint_meta"] = dict(file_meta)  # lets a load skip recomputing the checksum
        return {"state": state, "param_groups": groups, "superoffload": so}

    def _empty_state(self):
        mdt = TORCH_DTYPES[self.moment_dtype]
        return torch.zeros(0), torch.zeros(0, dtype=mdt), torch.zeros(0, dtype=mdt)

    def _wrap(self, info, t, copy):
        """A per-parameter state tensor shaped like the parameter (a DTensor like it under FSDP2)."""
        shard = t.view(local(info.param).shape)
        if not info.dtensor:
            return shard
        if copy or shard.storage_offset() != 0:
            # A view of a mapped file, or one that starts inside its storage (a slice of the master
            # arena), cannot be pickled inside a DTensor (torch.save refuses its storage): the
            # rank-local shard is copied.
            shard = shard.clone()
        p = info.param
        return DTensor.from_local(shard, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    def _slice_states(self):
        """({param name: (master, exp_avg, exp_avg_sq, step)} of the offloaded parameters as 1-d
        tensors viewing the host state, the loss scaler's metadata or None, the checkpoint file's
        metadata or None): the buffers themselves, or with the loss scaler a mapped checkpoint
        file the session wrote."""
        out = {}
        if not self._loss_scaler:
            for sg in self._subgroups:
                step = self.session.get_subgroup_state(sg.id)["step_count"]  # also brings device-placed state up
                for info in sg.params:
                    out[info.name] = (sg.master[sg.span(info)], sg.exp_avg[sg.span(info)],
                                      sg.exp_avg_sq[sg.span(info)], int(step))
            return out, None, None
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "state.safetensors")
            self.session.save(path)
            meta, tensors = _checkpoint.read(path)  # views of the mapping, which outlives the file
        for sg in self._subgroups:
            for info in sg.params:
                out[info.name] = (tensors[f"master/{info.name}"], tensors[f"exp_avg/{info.name}"],
                                  tensors[f"exp_avg_sq/{info.name}"], int(meta[f"slice.{info.name}.step"]))
        scaler = {k: v for k, v in meta.items() if k.startswith("loss_scaler")}
        return out, scaler, meta

    def _subgroup_steps(self):
        for sg in self._subgroups:
            return self.session.step_count(sg.id)
        return 0

    def _expose_state(self):
        """Gives `optimizer.state` one entry per parameter once there is state, as torch's
        optimizers do (tools such as torch.distributed.checkpoint's state-dict helpers test it
        for emptiness): views of the parameter's host buffers, current once the step is final
        (`synchronize(host=True)`; device-placed sub-groups: after `state_dict()`). Step counts
        and the complete layout are `state_dict()`'s."""
        if self.state:
            return
        for sg in self._subgroups:
            for info in sg.params:
                shape = local(info.param).shape
                self.state[info.param] = {"exp_avg": sg.exp_avg[sg.span(info)].view(shape),
                                          "exp_avg_sq": sg.exp_avg_sq[sg.span(info)].view(shape),
                                          "master": sg.master[sg.span(info)].view(shape)}
        for info in self._infos:
            if info.sg is None:  # an empty local shard
                master, m, v = self._empty_state()
                self.state[info.param] = {"exp_avg": m, "exp_avg_sq": v, "master": master}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Restores master weights (and through them the model's parameters), moments, step counts
        and the param groups' hyperparameters from `state_dict()`'s output, or from a
        torch.optim.AdamW state dict of the same param groups (migration: its moments and steps;
        master weights from the model's current parameters)."""
        self._check_idle("load_state_dict")
        self._drop_read_ahead()
        so = state_dict.get("superoffload") if isinstance(state_dict, dict) else None
        if isinstance(so, dict) and so.get("format") != STATE_DICT_FORMAT:
            raise ValueError(f"state dict format {so.get('format')!r}: this version loads format "
                             f"{STATE_DICT_FORMAT} (its own state_dict()) or a torch.optim.AdamW state dict")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                        for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state dict's param groups do not match this optimizer's (same groups, same "
                             "number of parameters in each, as torch.optim.AdamW requires)")
        saved_state = self._saved_state_by_index(state_dict["state"])
        if not saved_state and self._nsteps == 0 and not self._loaded:
            # Nothing to restore into a fresh optimizer (torch's state dict before a first step,
            # or accelerate's device-placement round trip): the hyperparameters only.
            _set_group_hparams(self.param_groups, groups)
            self._sync_groups()
            return
        plan = self._load_plan(saved_state)  # everything checked before anything changes
        # The latest step's passes (a state pass after the copy among them) must not write the
        # buffers after they are loaded.
        self.synchronize()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        _set_group_hparams(self.param_groups, groups)
        self._group_hp = [None] * len(self.param_groups)
        self._sync_groups()
        if self._loss_scaler:
            self._load_through_file(plan, so)
            self._group_hp = [None] * len(self.param_groups)
            self._sync_groups()  # the file carried the saved session's values; param_groups win
        else:
            self._load_into_buffers(plan)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if so and "speculation_history" in so:
            self.session.set_speculation_history(*so["speculation_history"])
        steps = [s for _, s, _ in plan]
        self._nsteps = int(so.get("steps", 0)) if so else (max(steps) if steps else 0)
        self._loaded = True
        self._expose_state()
        self._waits.pending.clear()

    def _saved_state_by_index(self, saved):
        by_name = {i.name: i.index for i in self._infos}
        out = {}
        for k, v in saved.items():
            if isinstance(k, str) and not k.isdigit():  # keyed by parameter name (FQN)
                if k not in by_name:
                    raise ValueError(f"the state dict has state for {k!r}, which is not a parameter of this optimizer")
                out[by_name[k]] = v
            else:
                out[int(k)] = v
        return out

    def _load_plan(self, saved_state):
        """[(sub-group, step, [(info, master, exp_avg, exp_avg_sq)])] with 1-d rank-local tensors
        (None where the state dict has none: moments start at 0, the master from the parameter)."""
        plan = []
        for sg in self._subgroups:
            entries, steps = [], set()
            for info in sg.params:
                st = saved_state.get(info.index)
                if st:
                    m = _rank_local(st["exp_avg"]).detach().reshape(-1)
                    v = _rank_local(st["exp_avg_sq"]).detach().reshape(-1)
                    master = _rank_local(st["master"]).detach().reshape(-1) if "master" in st else None
                    step = int(float(st["step"]))
                else:
                    m = v = master = None
                    step = 0
                for what, t in (("exp_avg", m), ("exp_avg_sq", v), ("master", master)):
                    if t is not None and t.numel() != info.numel:
                        raise ValueError(f"state of {info.name}: {what} has {t.numel()} elements, the parameter "
                                         f"{info.numel}")
                steps.add(step)
                entries.append((info, master, m, v))
            if len(steps) > 1:
                raise ValueError(f"parameters {[i.name for i in sg.params]} share a sub-group but have different "
                                 f"step counts {sorted(steps)} in the state dict; use sub_group_numel=0 (one "
                                 "sub-group per parameter) to load it")
            plan.append((sg, steps.pop(), entries))
        return plan

    def _load_into_buffers(self, plan):
        for sg, step, entries in plan:
            with self._host_authoritative(sg):
                for info, master, m, v in entries:
                    span = sg.span(info)
                    sg.master[span].copy_(master if master is not None else local(info.param).reshape(-1))
                    sg.exp_avg[span].copy_(m if m is not None else torch.zeros(()))
                    sg.exp_avg_sq[span].copy_(v if v is not None else torch.zeros(()))
                self.session.set_step_count(sg.id, step)
            if self.cuda:  # publish the loaded masters into the model's parameters
                sg.device_param.copy_(sg.master.to(self.device, non_blocking=False).to(self.param_dtype))
            elif sg.copy is not None:  # host FSDP's low-precision shards are the weights' copy
                sg.copy.copy_(sg.master.to(self.param_dtype))

    def _load_through_file(self, plan, so):
        """Writes the state as a checkpoint file and has the session load it (CUDA: the session
        also publishes the loaded weights)."""
        mdt = TORCH_DTYPES[self.moment_dtype]
        tensors, meta = {}, self._checkpoint_meta(so)
        for sg, step, entries in plan:
            for info, master, m, v in entries:
                if master is None:
                    master = local(info.param).detach().reshape(-1)
                tensors[f"master/{info.name}"] = master.to("cpu", torch.float32).contiguous()
                for key, t in (("exp_avg", m), ("exp_avg_sq", v)):
                    t = torch.zeros(info.numel, dtype=mdt) if t is None else t.to("cpu", mdt).contiguous()
                    tensors[f"{key}/{info.name}"] = t
                meta[f"slice.{info.name}.group"] = str(sg.group)
                meta[f"slice.{info.name}.step"] = str(step)
        saved = (so or {}).get("checkpoint_meta")
        same_slices = saved and {k: v for k, v in saved.items() if k.startswith("slice.")} == \
            {k: v for k, v in meta.items() if k.startswith("slice.")}
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "state.safetensors")
            if same_slices:
                # Our own state dict, same slices and steps: the file the library wrote had exactly
                # these tensors and metadata, so its checksum holds unless a tensor changed (the
                # library checks; then the checksum is computed here).
                try:
                    _checkpoint.write(path, tensors, saved, known_checksum=saved["checksum"])
                    self.session.load(path)
                    return
                except _core.SuperOffloadError as e:
                    if e.status != _abi.Status.BAD_CHECKPOINT:
                        raise
                    logger.info("load_state_dict: the state changed since it was saved; recomputing the "
                                "checkpoint checksum")
            _checkpoint.write(path, tensors, meta)
            self.session.load(path)

    def _checkpoint_meta(self, so):
        """Metadata of a library checkpoint file for this session (everything but the slices)."""
        meta = {"format": _checkpoint.FORMAT, "format_version": _checkpoint.FORMAT_VERSION,
                "library_version": _core.version(), "mode": "adamw",
                "bias_correction": "true" if self._bias_correction else "false",
                "moment_dtype": self.moment_dtype, "groups": str(len(self.param_groups))}
        for gi in range(len(self.param_groups)):
            hp = self.session.get_group(gi)
            for k in _GROUP_HPARAMS:
                meta[f"group.{gi}.{k}"] = repr(float(hp[k]))
        scaler = (so or {}).get("loss_scaler")
        if not scaler:  # keep the scaler's current state
            with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
                path = os.path.join(d, "s.safetensors")
                self.session.save(path)
                cur, _ = _checkpoint.read(path)
            scaler = {k: v for k, v in cur.items() if k.startswith("loss_scaler")}
        meta.update(scaler)
        return meta

    # ---- the library's checkpoint file ------------------------------------------------------

    def save_checkpoint(self, path):
        """The library's own checkpoint file (safetensors, per-slice, partition-independent)."""
        self._check_idle("save_checkpoint")
        self.synchronize(host=True)
        self.session.save(str(path))

    def load_checkpoint(self, path):
        """Loads a file of `save_checkpoint` (CUDA: republishes the weights)."""
        self._check_idle("load_checkpoint")
        self._drop_read_ahead()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.session.load(str(path))
        self._group_hp = [tuple(self.session.get_group(gi)[k] for k in _GROUP_HPARAMS)
                          for gi in range(len(self.param_groups))]
        for g, hp in zip(self.param_groups, self._group_hp):
            g["lr"], g["betas"], g["eps"], g["weight_decay"] = hp[0], (hp[1], hp[2]), hp[3], hp[4]
        self._waits.pending.clear()
