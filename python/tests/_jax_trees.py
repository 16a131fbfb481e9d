"""Comparisons of JAX pytrees, shared by test_jax.py (pytest) and gpu_jax.py (a script). jax is
imported on first use, so that gpu_jax.py can import this and still report SKIP without jax."""
import numpy as np


def _leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def relative_error(tree, reference):
    """The largest, over the leaves, of the largest |difference| from `reference` over the largest
    |value| of `reference`."""
    worst = 0.0
    for a, b in zip(_leaves(tree), _leaves(reference)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = np.max(np.abs(a - b))
        if diff:
            worst = max(worst, diff / np.max(np.abs(b)))
    return worst


def _bits(tree):
    return [np.asarray(x).view(np.uint32 if np.asarray(x).dtype == np.float32 else np.uint16).copy()
            for x in _leaves(tree)]


def same_bits(a, b):
    """Whether two trees of float32 or 16-bit float leaves hold the same bits, leaf for leaf."""
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b)))
