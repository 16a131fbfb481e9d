"""Calls a loss function with each parameter fetched right before its first use.

`call(fn, params, treedef, args, fetch)` traces `fn(params, *args)` to a jaxpr and evaluates it
equation by equation. A parameter stands in the evaluation as a marker until the first equation
that computes with it; `fetch(index, after)` then supplies its value, given that equation's other
traced operands (`after`) so that the fetch can be ordered after them: a layer's weights are
fetched once the layers before it have run, and XLA cannot move the fetch to the program's start.

A cast, reshape or transpose of a parameter alone (a model that casts its weights to bf16 first)
is carried with the marker, not counted as a use; a nested `jax.jit` is evaluated inline, so its
equations count one by one. Parameters the function never computes with are fetched at the end.
"""
import contextlib

import jax

# Equations of one parameter alone that only change its type or layout: carried with the marker.
_CARRIED = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim",
                      "copy", "copy_p", "reduce_precision"})
_INLINED = frozenset({"pjit", "jit"})


class _Pending:
    """A parameter not fetched yet, with the carried equations to apply to it once it is."""
    __slots__ = ("index", "carried", "value")

    def __init__(self, index, carried=()):
        self.index, self.carried, self.value = index, carried, None


class _Fetcher:
    def __init__(self, fetch):
        self.fetch, self.fetched = fetch, {}

    def resolve(self, x, after):
        if not isinstance(x, _Pending):
            return x
        if x.value is None:
            if x.index not in self.fetched:
                self.fetched[x.index] = self.fetch(x.index, after)
            value = self.fetched[x.index]
            for eqn in x.carried:
                (value,) = _bind(eqn, [value])
            x.value = value
        return x.value

    def run(self, jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if hasattr(v, "val") else env[v]  # a literal, or a variable

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            pending = [x for x in invals if isinstance(x, _Pending)]
            if not pending:
                outs = _bind(eqn, invals)
            elif (eqn.primitive.name in _CARRIED and len(invals) == 1 and len(eqn.outvars) == 1):
                outs = [_Pending(pending[0].index, pending[0].carried + (eqn,))]
            elif eqn.primitive.name in _INLINED and hasattr(eqn.params.get("jaxpr"), "consts"):  # a ClosedJaxpr
                inner = eqn.params["jaxpr"]
                outs = self.run(inner.jaxpr, inner.consts, invals)
            else:
                after = [x for x in invals if isinstance(x, jax.core.Tracer)]
                outs = _bind(eqn, [self.resolve(x, after) for x in invals])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals):
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)  # older jax: (subfuns, params)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    with ctx:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def call(fn, params, treedef, args, fetch):
    """`(fn(params, *args), fetched)`: `params` is a list of leaves (`treedef` makes the tree `fn`
    takes); `fetch(index, after)` returns the value leaf `index` takes, fetched after the arrays in
    `after`. `fetched` lists every leaf's fetched value, in leaf order."""
    closed, out_shape = jax.make_jaxpr(lambda leaves: fn(jax.tree_util.tree_unflatten(treedef, leaves), *args),
                                       return_shape=True)(list(params))
    fetcher = _Fetcher(fetch)
    markers = [_Pending(i) for i in range(len(params))]
    outs = fetcher.run(closed.jaxpr, closed.consts, markers)
    outs = [fetcher.resolve(x, []) for x in outs]
    fetched = [fetcher.resolve(m, []) for m in markers]  # the ones used were fetched already
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs), fetched
