"""Checkpoints held in memory inside a comparison process (utils/checkpoint/memory.py): a restore from
there equals, bit for bit and sharding for sharding, orbax's restore of the files the same save wrote."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import train_jax as T
from utils.checkpoint import memory
from utils.checkpoint.storage import Checkpointer, open_checkpoint
from utils.parallel import mesh as meshlib


def _mesh(run):
    p = run.parallel
    return meshlib.make_mesh(p.data, p.fsdp, run.dataset.batch_size, tensor=p.tensor, expert=p.expert)


def _scrambled(state):
    """Every float leaf moved off its init by noise (the optimizer's zero moments too), so that equal
    restores mean equal bits, not equal zeros."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    moved = [x + jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x + 3
             for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, moved)


def _bits(tree) -> list[tuple]:
    """(shape, dtype, sharding, raw bytes) per leaf: equal means bit for bit, placed alike."""
    return [(x.shape, x.dtype, x.sharding, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # a tiny state built, saved and restored three times: 2.1-4.4 s on the shared 2-core VM
def test_a_held_checkpoint_restores_the_state_orbax_reads_back(tiny_run, tmp_path, monkeypatch):
    run = tiny_run("checkpoint.save=true", f"checkpoint.save_path={tmp_path / 'ckpt'}")
    mesh = _mesh(run)
    _, tx, state, _ = T.init_training(run, mesh)
    state = _scrambled(state)
    restored = lambda source: T.init_state(run, tx, mesh, (), source)[0]  # the run's restore (no step metrics)
    with memory.holding():
        saver = Checkpointer(run.checkpoint, run.config_dict, dataclasses.asdict(run.model), print)
        assert saver.save(3, state, {"position": 1}, {}, "test")
        saver.close()
        source = open_checkpoint(run.checkpoint.save_path, "iter_3", with_opt_state=True)
        assert memory.held(source.path) is not None
        with monkeypatch.context() as m:  # no file read: orbax's restore is never called
            m.setattr(ocp.Checkpointer, "restore", lambda *a, **k: pytest.fail("orbax read the files"))
            held = restored(source)
            # The restored buffers are donated, as the run's step donates them: the held copy stays as saved.
            jax.jit(lambda s: jax.tree.map(lambda x: x * 0, s), donate_argnums=0)(held)
            again = restored(source)
    assert memory.held(source.path) is None  # emptied with the outermost block
    from_files = restored(open_checkpoint(run.checkpoint.save_path, "iter_3", with_opt_state=True))
    assert jax.tree.structure(again) == jax.tree.structure(from_files)
    assert _bits(again) == _bits(from_files) == _bits(state)


def test_the_held_checkpoints_are_bounded_and_a_mismatch_reads_the_files(monkeypatch):
    x = lambda n: {"model": {"w": np.arange(n, dtype=np.float32)}}
    memory.keep("/c/iter_0", x(4))
    assert memory.held("/c/iter_0") is None  # outside holding(): nothing kept
    monkeypatch.setattr(memory, "MAX_BYTES", 10 * 4 * 4)  # ten arrays of 4 float32
    with memory.holding():
        for i in range(memory.MAX_ENTRIES + 1):
            memory.keep(f"/c/iter_{i}", x(4))
        assert memory.held("/c/iter_0") is None and memory.held(f"/c/iter_{memory.MAX_ENTRIES}") is not None
        memory.keep("/c/big", x(11 * 4))  # alone over MAX_BYTES: not kept
        assert memory.held("/c/big") is None
        memory.keep("/c/iter_9", x(9 * 4))  # 9 of the 10 arrays' bytes: one 4-array entry fits beside it
        assert [p for p in [f"/c/iter_{i}" for i in range(10)] if memory.held(p) is not None] == ["/c/iter_8",
                                                                                                 "/c/iter_9"]
        held = memory.held("/c/iter_8")
        target = lambda dtype, n=4: {"model": {"w": jax.ShapeDtypeStruct((n,), dtype)}}
        assert memory.restore(held, target(jnp.bfloat16)) is None  # orbax would cast: the files are read
        assert memory.restore(held, target(jnp.float32, 5)) is None
        assert memory.restore(held, {"opt_state": target(jnp.float32)["model"]}) is None
        out = memory.restore(held, target(jnp.float32))
        np.testing.assert_array_equal(out["model"]["w"], np.arange(4, dtype=np.float32))
