"""Pytree helpers the optimizer transforms share."""

from __future__ import annotations

import jax


class _Results(tuple):
    """Several results of one leaf, kept together as one pytree leaf (a tuple subclass is not a
    registered pytree node) until `map_unzipped` parts them."""


def map_unzipped(fn, n: int, tree, *rest) -> tuple:
    """jax.tree.map with fn returning n values per leaf: n trees shaped like `tree`. Nodes without
    leaves (optax.MaskedNode, None) stay as they are in all n; containers of any shape are safe
    (unlike telling results apart by `isinstance(x, tuple)`)."""
    packed = jax.tree.map(lambda *args: _Results(fn(*args)), tree, *rest)
    is_packed = lambda x: isinstance(x, _Results)
    return tuple(jax.tree.map(lambda r, i=i: r[i], packed, is_leaf=is_packed) for i in range(n))
