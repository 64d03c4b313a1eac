"""Model arrays saved by reference instead of by value: LoRA's frozen base.

A LoRA run fine-tuning a Hugging Face model (model.init_from) trains a few million factor values
beside a base of up to billions that no step changes; saving that base again in every checkpoint
costs its full size each time for nothing. A checkpoint of such a run holds only the trained
arrays in its `model` (and `eval_model`) item; its manifest's `frozen` entry says where the rest
come from (`source`: the directory and train.param_dtype) and holds a fingerprint of their values.
A restore rebuilds the base from that directory and refuses, in one line, a base whose fingerprint
differs (the directory's weights changed, another param_dtype), so a resume stays bit-identical or
fails before training. (A random base is saved whole: trainer/resume.py `frozen_base`.)

Nothing is lost when the base did move after all: each save fingerprints the frozen arrays it
would leave out, and if they no longer match the run's start the checkpoint is written in full
(with a warning), as any other run's.

The fingerprint is an integer hash of the values' bits, exact and the same on any mesh: per array
the sum, and the position-weighted sum, of the bit patterns as uint32, both modulo 2^32 (integer
sums do not depend on the order XLA reduces shards in), with -0.0 read as 0.0 (a frozen weight
plus a zero update turns one into the other).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from utils.errors import CheckpointError

MANIFEST_KEY = "frozen"  # the manifest entry of a checkpoint that holds its frozen arrays by reference
_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative-hash constant: positions weigh differently


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


@dataclass(frozen=True)
class FrozenPart:
    """What a run's checkpoints leave out: the leaves `is_frozen(path)` picks, made from `source`
    (a JSON dict for the manifest and the error messages), whose values hashed to `fingerprint`
    at the run's start."""

    is_frozen: Callable[[Any], bool]
    source: dict
    fingerprint: str

    def trained(self, tree: Any) -> Any:
        """`tree` with its frozen leaves None: what the checkpoint saves."""
        return jax.tree_util.tree_map_with_path(lambda p, x: None if self.is_frozen(p) else x, tree)

    def unchanged(self, tree: Any) -> bool:
        """Whether `tree`'s frozen leaves still hash to the run's start (one pass over them on device)."""
        return FrozenPart.of(tree, self.is_frozen, self.source).fingerprint == self.fingerprint

    def manifest(self) -> dict:
        return {"source": self.source, "fingerprint": self.fingerprint}

    @classmethod
    def of(cls, model: Any, is_frozen: Callable[[Any], bool], source: dict) -> "FrozenPart":
        """The frozen part of `model` as it is now: its fingerprint taken from the model's values."""
        frozen = jax.tree_util.tree_map_with_path(lambda p, x: x if is_frozen(p) else None, model)
        return cls(is_frozen, source, fingerprint(frozen))


@jax.jit
def _leaf_sums(leaves: list[jax.Array]) -> jax.Array:
    """(num_leaves, 2) uint32: each leaf's bit-pattern sum and position-weighted sum, mod 2^32."""
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            x = jnp.where(x == 0, jnp.zeros_like(x), x)  # -0.0 -> 0.0
            bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        else:
            bits = x.astype(jnp.uint32)
        weight = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * _GOLDEN + jnp.uint32(1)
        out.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)]))
    return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def fingerprint(tree: Any) -> str:
    """A short hex hash of `tree`'s array leaves (names, shapes, dtypes and values); None leaves
    are not part of it, so a model's frozen leaves (`FrozenPart.of`) and a rebuilt base with the trained leaves
    taken out hash alike."""
    named = [(_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "dtype")]
    named.sort(key=lambda item: item[0])
    sums = _leaf_sums([x for _, x in named])
    if not sums.is_fully_addressable:  # several processes: each holds its shards' part of the (tiny) result
        from jax.experimental import multihost_utils

        sums = multihost_utils.process_allgather(sums, tiled=True)
    sums = np.asarray(sums)
    h = hashlib.sha256()
    for (name, x), row in zip(named, sums):
        h.update(f"{name}:{tuple(x.shape)}:{jnp.dtype(x.dtype).name}:{int(row[0])}:{int(row[1])};".encode())
    return h.hexdigest()[:16]


def complete(restored: Any, rebuilt: Any, record: dict, where: str) -> Any:
    """The model of a checkpoint that holds its frozen arrays by reference: `restored`'s trained
    leaves (the rest None) with the frozen ones taken from `rebuilt` (the base remade as the run
    made it), once their fingerprint matches the manifest's `record`."""
    trained = {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]
               if isinstance(x, (jax.Array, np.ndarray))}
    base = jax.tree_util.tree_map_with_path(lambda p, b: None if _name(p) in trained else b, rebuilt)
    got = fingerprint(base)
    if got != record["fingerprint"]:
        source = ", ".join(f"{k}={v}" for k, v in record.get("source", {}).items())
        raise CheckpointError(
            f"{where} holds LoRA factors over a frozen base made from {source} (fingerprint {record['fingerprint']}), "
            f"but the base this run rebuilds from its config hashes to {got}: the weights in model.init_from changed "
            "since the save, or train.param_dtype differs; restore those and load again")
    return jax.tree_util.tree_map_with_path(lambda p, b: trained.get(_name(p), b), rebuilt)
