"""superoffload.jax on JAX's CUDA platform, one command on a GPU machine:

    SUPEROFFLOAD_LIBRARY=.../libsuperoffload.so PYTHONPATH=python timeout 600 python python/tests/gpu_jax.py

Prints a PASS or FAIL line per check and exits 0 (all passed), 1 (a check failed) or 77 (skipped:
no GPU for JAX, or CUDA unusable by the library). The checks:

- parity, clipped and unclipped: per step, from the session's state before the step (state_dict),
  `optax.chain(clip_by_global_norm, adamw)` with f32 state takes the same step on the GPU;
- a non-finite gradient skips the step (every bit unchanged) and a loss scale of 1024 changes no bit;
- state_dict resume: 4 steps, save, pickle, load into a new optimizer, 4 steps == 8 steps, bit for bit;
  and a skipped step right after the load returns the loaded weights;
- CUDA platform == CPU platform, bit for bit, for a loss whose gradient both platforms compute exactly
  (unclipped: the CPU-Adam arithmetic is the same code; f32 and bf16 parameters), and within 1e-6
  clipped (the gradient norm is summed on the GPU in one and on the CPU in the other).
"""
import os
import pickle
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _jax_trees import relative_error, same_bits  # noqa: E402

SKIP = 77


def main():
    try:
        import jax
        import jax.numpy as jnp  # noqa: F401
        import optax  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e}")
        return SKIP
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as e:
        print(f"SKIP: JAX has no GPU here ({e})")
        return SKIP
    from superoffload import _core
    available, why = _core.cuda_available()
    if not available:
        print(f"SKIP: the library cannot use CUDA here: {why}")
        return SKIP
    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"jax {jax.__version__} on {gpu.device_kind}; library {_core.library_path()}")
    checks = Checks(gpu)
    failed = 0
    for name in ("parity_clipped", "parity_unclipped", "parity_clipped_wait_step", "skip_and_loss_scale",
                 "state_dict_resume",
                 "skip_after_load", "cuda_equals_cpu_f32", "cuda_equals_cpu_bf16", "cuda_near_cpu_clipped",
                 "gpu_budget_split"):
        start = time.perf_counter()
        try:
            detail = getattr(checks, name)()
            print(f"PASS {name} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 - every check reports, then the next runs
            failed += 1
            traceback.print_exc()
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    print("gpu_jax:", "all passed" if not failed else f"{failed} failed")
    return 1 if failed else 0


class Checks:
    SIZES = [16, 64, 64, 4]

    def __init__(self, gpu):
        import jax
        import jax.numpy as jnp
        import optax
        import superoffload.jax as sojax
        self.jax, self.jnp, self.optax, self.sojax, self.gpu = jax, jnp, optax, sojax, gpu
        self.cpu = jax.devices("cpu")[0]

    # ---- the model, the data, optax -----------------------------------------------------------

    def params(self, seed=0, dtype=None, device=None):
        jnp = self.jnp
        rng = np.random.default_rng(seed)
        tree = [{"w": rng.standard_normal((a, b)) / np.sqrt(a), "b": np.zeros(b)}
                for a, b in zip(self.SIZES[:-1], self.SIZES[1:])]
        tree = self.jax.tree.map(lambda x: x.astype(dtype or jnp.float32), tree)
        return self.jax.device_put(tree, device or self.gpu)

    def loss(self, params, x, y):
        jnp = self.jnp
        h = x
        for layer in params[:-1]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        out = h @ params[-1]["w"] + params[-1]["b"]
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    def exact_loss(self, params, c):
        """A loss whose gradient, c (rounded to the parameter's dtype), both platforms compute
        exactly: no arithmetic that XLA may fuse differently (a GPU contracts a multiply and an
        add into one rounding, a CPU may not)."""
        jnp = self.jnp
        total = 0.0
        for layer, cl in zip(params, c):
            for k in layer:
                total = total + jnp.sum(cl[k] * layer[k].astype(jnp.float32))
        return total

    def batch(self, step, nan=False, device=None):
        r = np.random.default_rng(1000 + step)
        x = r.standard_normal((64, self.SIZES[0])).astype(np.float32)
        y = np.sin(2.0 * x[:, :self.SIZES[-1]]).astype(np.float32)
        if nan:
            x[3, 5] = np.nan
        return self.jax.device_put((x, y), device or self.gpu)

    def schedule(self):
        return self.optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=2, decay_steps=10, end_value=3e-4)

    def ours(self, opt, loss=None):
        loss = loss or self.loss
        return self.jax.jit(lambda p, s, *a: opt.step(loss, p, s, *a))

    def optax_step(self, tx):
        jax, optax = self.jax, self.optax

        @jax.jit
        def step(params, state, x, y):
            loss, grads = jax.value_and_grad(self.loss)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return loss, optax.apply_updates(params, updates), state

        def x64_step(params, state, x, y):
            enable = jax.enable_x64(True) if hasattr(jax, "enable_x64") else __import__(
                "jax.experimental", fromlist=["enable_x64"]).enable_x64()
            with enable:
                return step(params, state, x, y)
        return step, x64_step

    def optax_from(self, tx, sd):
        jax, jnp = self.jax, self.jnp
        put = lambda t: jax.device_put(jax.tree.map(jnp.asarray, t), self.gpu)  # noqa: E731
        params = put(sd["master"])
        count = jnp.asarray(jax.tree.leaves(sd["step"])[0], jnp.int32)
        state = self.optax.tree_utils.tree_set(tx.init(params), count=count, mu=put(sd["exp_avg"]),
                                               nu=put(sd["exp_avg_sq"]))
        return params, state

    def on_gpu(self, tree):
        platforms = {d.platform for x in self.jax.tree.leaves(tree) for d in x.devices()}
        assert platforms == {"gpu"}, f"the step's results are on {platforms}, not the GPU"

    # ---- the checks ---------------------------------------------------------------------------

    def _parity(self, max_grad_norm, wait="forward"):
        optax, steps = self.optax, 8
        lr = self.schedule()
        opt = self.sojax.adamw(lr, weight_decay=0.01, max_grad_norm=max_grad_norm, speculation="on",
                               sub_group_numel=64 * 64, wait=wait)
        adamw = optax.adamw(lr, weight_decay=0.01)
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw) if max_grad_norm else adamw
        as_is, f64_bias = self.optax_step(tx)
        bounds = {"optax": (as_is, 3e-5), "optax with f64 bias corrections": (f64_bias, 2e-6)}
        worst = dict.fromkeys(bounds, 0.0)
        params = self.params()
        state = opt.init(params)
        step, clipped = self.ours(opt), 0
        for i in range(steps):
            x, y = self.batch(i)
            before = opt.state_dict(state)
            loss, params, state = step(params, state, x, y)
            latest = opt.params(params, state)
            self.on_gpu(params)
            self.on_gpu(latest)
            if wait == "step":
                assert same_bits(params, latest), "wait='step' returns the updated weights"
            m = opt.metrics(state)
            assert not m["skipped"], m
            clipped += m["clip_coef"] < 1.0
            for name, (train, bound) in bounds.items():
                ref_loss, ref, _ = train(*self.optax_from(tx, before), x, y)
                assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
                err = relative_error(latest, ref)
                worst[name] = max(worst[name], err)
                assert err <= bound, f"step {i}: relative difference {err:.3g} from {name} (bound {bound})"
        if max_grad_norm:
            assert clipped >= steps // 2, f"only {clipped} of {steps} steps clipped"
        opt.close()
        return ", ".join(f"worst per step {worst[k]:.3g} from {k}" for k in bounds) + f"; {clipped}/{steps} clipped"

    def parity_clipped(self):
        return self._parity(0.5)

    def parity_unclipped(self):
        return self._parity(None)

    def parity_clipped_wait_step(self):
        return self._parity(0.5, wait="step")

    def skip_and_loss_scale(self):
        runs = {}
        for scale in (1.0, 1024.0):
            opt = self.sojax.adamw(1e-3, weight_decay=0.01, max_grad_norm=1.0, loss_scale=scale, sub_group_numel=0)
            params = self.params(1)
            state, step = opt.init(params), self.ours(opt)
            for i in range(3):
                _, params, state = step(params, state, *self.batch(i))
            before = opt.params(params, state)
            _, params, state = step(params, state, *self.batch(99, nan=True))
            m = opt.metrics(state)
            assert m["skipped"] and m["skip_reason"] == "non_finite_gradient", m
            assert same_bits(opt.params(params, state), before), "a skipped step changed a parameter"
            _, params, state = step(params, state, *self.batch(3))
            assert not opt.metrics(state)["skipped"]
            runs[scale] = opt.params(params, state)
            opt.close()
        assert same_bits(runs[1.0], runs[1024.0]), "a loss scale of 1024 changed bits"
        return "skipped with every bit unchanged; loss scale 1024 == 1 bit for bit"

    def _train(self, opt, params, state, steps, first=0):
        """The latest weights and the state after `steps` steps."""
        step = self.ours(opt)
        for i in range(first, first + steps):
            _, params, state = step(params, state, *self.batch(i))
        return opt.params(params, state), state

    def state_dict_resume(self):
        make = lambda: self.sojax.adamw(self.schedule(), weight_decay=0.01, max_grad_norm=0.5,  # noqa: E731
                                        sub_group_numel=64 * 64)
        straight = make()
        p8, s8 = self._train(straight, self.params(), straight.init(self.params()), 8)
        sd8 = straight.state_dict(s8)
        first = make()
        p4, s4 = self._train(first, self.params(), first.init(self.params()), 4)
        saved = pickle.dumps(first.state_dict(s4))
        first.close()
        second = make()
        second.init(self.params(5))  # other weights: all of them come from the state dict
        params, state = second.load_state_dict(pickle.loads(saved))
        self.on_gpu(params)
        assert same_bits(params, p4), "the loaded parameters differ from the saved ones"
        p, s = self._train(second, params, state, 4, first=4)
        sd = second.state_dict(s)
        assert same_bits(p, p8), "4 + 4 steps across a state dict != 8 steps (parameters)"
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert same_bits(sd[key], sd8[key]), f"4 + 4 steps != 8 steps ({key})"
        assert sd["step"] == sd8["step"] and sd["count"] == sd8["count"]
        straight.close()
        second.close()
        return "4 steps, pickle, load, 4 steps == 8 steps bit for bit (parameters, master, both moments, counts)"

    def skip_after_load(self):
        opt = self.sojax.adamw(1e-3, max_grad_norm=1.0, sub_group_numel=64 * 64)
        p, s = self._train(opt, self.params(), opt.init(self.params()), 2)
        saved = opt.state_dict(s)
        p, s = self._train(opt, p, s, 2, first=2)  # the published buffers move on
        params, state = opt.load_state_dict(saved)
        _, out, state = self.ours(opt)(params, state, *self.batch(99, nan=True))
        assert opt.metrics(state)["skipped"]
        assert same_bits(out, params), "the forward after a load did not use the loaded weights"
        assert same_bits(opt.params(out, state), params), "a skipped step after a load changed the loaded weights"
        opt.close()
        return "a skipped step right after load_state_dict returns the loaded weights"

    def _both_platforms(self, dtype, max_grad_norm, steps=5):
        jax = self.jax
        rng = np.random.default_rng(3)
        shapes = [{k: v.shape for k, v in layer.items()} for layer in self.params()]
        c = [{k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in layer.items()} for layer in shapes]
        out = {}
        for name, device in (("cuda", self.gpu), ("cpu", self.cpu)):
            # Powers of two apart: a cosine schedule evaluated on each platform differs in its last bit.
            schedule = self.optax.piecewise_constant_schedule(3e-3, {2: 0.5, 4: 0.25})
            opt = self.sojax.adamw(schedule, weight_decay=0.01, max_grad_norm=max_grad_norm,
                                   speculation="on", sub_group_numel=64 * 64)
            params = self.params(dtype=dtype, device=device)
            state, cd = opt.init(params), jax.device_put(c, device)
            step = self.ours(opt, self.exact_loss)
            for _ in range(steps):
                _, params, state = step(params, state, cd)
            out[name] = (opt.params(params, state), opt.state_dict(state)["master"])
            opt.close()
        return out

    def _same_bits_on_both_platforms(self, dtype, name):
        out = self._both_platforms(dtype, None)
        (cuda_params, cuda_master), (cpu_params, cpu_master) = out["cuda"], out["cpu"]
        assert same_bits(cuda_master, cpu_master), \
            f"the master weights differ (relative {relative_error(cuda_master, cpu_master):.3g})"
        assert same_bits(cuda_params, cpu_params), f"the {name} differ"

    def cuda_equals_cpu_f32(self):
        self._same_bits_on_both_platforms(self.jnp.float32, "parameters")
        return "5 steps, f32: master weights and parameters bit for bit"

    def cuda_equals_cpu_bf16(self):
        self._same_bits_on_both_platforms(self.jnp.bfloat16, "bf16 parameters")
        return "5 steps, bf16 parameters (f32 masters): bit for bit"

    def cuda_near_cpu_clipped(self):
        out = self._both_platforms(self.jnp.float32, 0.5)
        err = relative_error(out["cuda"][1], out["cpu"][1])
        assert err <= 1e-6, f"relative difference {err:.3g}"
        return f"5 steps clipped at 0.5: relative difference {err:.3g}"

    def gpu_budget_split(self):
        """gpu_budget_bytes: clipping every step, the automatic split places sub-groups on the GPU
        after a few measured steps, and the library's GPU kernel steps them with the bits of a run
        that keeps everything in host memory; a state dict taken and loaded while they are placed
        resumes bit for bit."""
        def make(budget):
            return self.sojax.adamw(self.schedule(), weight_decay=0.01, max_grad_norm=1e-3,
                                    sub_group_numel=64 * 64, gpu_budget_bytes=budget)
        runs = {}
        for budget in (0, 1 << 30):
            opt = make(budget)
            p, s = self._train(opt, self.params(), opt.init(self.params()), 10)
            runs[budget] = (p, opt.state_dict(s)["master"], opt.metrics(s)["device_stepped"])
            opt.close()
        (host_p, host_master, _), (split_p, split_master, placed) = runs[0], runs[1 << 30]
        assert placed > 0, "nothing was placed on the GPU in 10 steps"
        assert same_bits(split_master, host_master), \
            f"the master weights differ (relative {relative_error(split_master, host_master):.3g})"
        assert same_bits(split_p, host_p), "the parameters differ"
        opt = make(1 << 30)
        p, s = self._train(opt, self.params(), opt.init(self.params()), 8)
        saved = pickle.dumps(opt.state_dict(s))
        p10, _ = self._train(opt, p, s, 2, first=8)
        params, state = opt.load_state_dict(pickle.loads(saved))
        again, _ = self._train(opt, params, state, 2, first=8)
        assert same_bits(again, p10), "a load with sub-groups on the GPU did not resume bit for bit"
        opt.close()
        return f"{placed} sub-groups stepped on the GPU, bit for bit with the host's; a load while placed resumes"


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
