"""Parameter groups and the optimizer zoo: per-group overrides reach the right leaves, Muon
orthogonalises each stacked block, and every registered optimizer trains the tiny model."""


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_jax as T
from models.gpt import GPT, GPTConfig, param_labels
from optimizer import OPTIMIZERS, make_optimizer
from optimizer.adamw import AdamW
from optimizer.muon import Muon
from optimizer.sgdm import SGDM
from utils import mesh as meshlib
from utils.errors import ConfigError

CFG = GPTConfig(dim=32, num_heads=2, num_blocks=3, context_length=16, vocab_size=64, tie_embeddings=False)


def _params_labels_grads(seed: int = 0):
    model = eqx.filter_eval_shape(GPT, CFG, jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), model)
    return params, param_labels(model), grads


def _first_update(tx, grads, params):
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)


def test_every_group_gets_its_own_lr_and_weight_decay():
    # Plain SGD, lr 1 base: the update of a leaf is -(lr_g * (g + wd_g * p)). Distinct values per
    # group catch a late-binding closure (every group would get the last group's value).
    params, labels, grads = _params_labels_grads()
    lrs = {"hidden": 0.5, "embed": 0.25, "head": 0.125, "scalar": 0.0625}
    wds = {"hidden": 0.1, "embed": 0.2, "head": 0.3, "scalar": 0.4}
    overrides = {g: {"lr": lrs[g], "weight_decay": wds[g]} for g in lrs}
    tx = make_optimizer(SGDM(momentum=0.0), optax.constant_schedule(1.0), labels, None, 1.0, overrides)
    updates = _first_update(tx, grads, params)
    for u, g, p, label in zip(*(jax.tree.leaves(t) for t in (updates, grads, params, labels)), strict=True):
        np.testing.assert_allclose(u, -lrs[label] * (g + wds[label] * p), rtol=1e-5, atol=1e-6, err_msg=label)


def test_group_without_override_keeps_defaults_and_scalars_never_decay():
    params, labels, grads = _params_labels_grads()
    overrides = {"embed": {"lr": 0.1}}
    tx = make_optimizer(SGDM(momentum=0.0, weight_decay=0.5), optax.constant_schedule(1.0), labels, None, 1.0,
                        overrides)
    updates = _first_update(tx, grads, params)
    for u, g, p, label in zip(*(jax.tree.leaves(t) for t in (updates, grads, params, labels)), strict=True):
        lr = 0.1 if label == "embed" else 1.0
        wd = 0.5 if label in ("hidden", "head") else 0.0
        np.testing.assert_allclose(u, -lr * (g + wd * p), rtol=1e-5, atol=1e-6, err_msg=label)


def test_group_lr_follows_the_schedule_shape():
    run_schedule = optax.linear_schedule(0.0, 2.0, 10)
    from optimizer import group_schedules

    s = group_schedules(AdamW(), run_schedule, 2.0, {"hidden": {"lr": 0.5}})
    for step in (0, 3, 10, 20):
        assert float(s["hidden"](step)) == pytest.approx(float(run_schedule(step)) * 0.25)
        assert float(s["embed"](step)) == pytest.approx(float(run_schedule(step)))


def test_muon_orthogonalises_each_stacked_block_and_adams_the_rest():
    params, labels, grads = _params_labels_grads(seed=3)
    muon = Muon(momentum=0.0, nesterov=False, ns_steps=8, weight_decay=0.0, adam_lr=0.01)
    tx = make_optimizer(muon, optax.constant_schedule(1.0), labels, None, 1.0, {})
    updates = _first_update(tx, grads, params)
    adam = _first_update(optax.adam(0.01, b1=muon.adam_b1, b2=muon.adam_b2, eps=muon.adam_eps), grads, params)
    for u, a, label in zip(*(jax.tree.leaves(t) for t in (updates, adam, labels)), strict=True):
        if label != "hidden":
            np.testing.assert_allclose(u, a, rtol=1e-5, atol=1e-7, err_msg=label)  # AdamW path
            continue
        assert u.ndim == 3 and u.shape[0] == CFG.num_blocks
        for block_u in np.asarray(u):  # each block on its own: singular values ~1 after scaling
            sv = np.linalg.svd(block_u, compute_uv=False)
            sv = sv / sv.max()
            assert sv.min() > 0.5, sv  # NS-orthogonalised: flat spectrum (a raw gradient is not)
    hidden_grad = next(g for g, label in zip(jax.tree.leaves(grads), jax.tree.leaves(labels)) if label == "hidden")
    raw = np.linalg.svd(np.asarray(hidden_grad)[0], compute_uv=False)
    assert raw.min() / raw.max() < 0.5  # the check above would notice an un-orthogonalised update


def test_group_override_validation(tiny_run):
    with pytest.raises(ConfigError, match=r"optimizer\.groups\.hiden"):
        tiny_run("+optimizer.groups.hiden.lr=0.1")
    with pytest.raises(ConfigError, match=r"optimizer\.groups\.hidden\.lr=-0\.1"):
        tiny_run("optimizer.groups.hidden.lr=-0.1")
    with pytest.raises(ConfigError, match=r"optimizer\.groups\.embed\.b1"):
        tiny_run("optimizer.groups.embed.b1=1.5")
    with pytest.raises(ConfigError, match=r"optimizer\.groups\.hidden\.nesterov cannot be set per group"):
        tiny_run("+optimizer.groups.hidden.nesterov=true")
    run = tiny_run("optimizer=muon", "optimizer.groups.hidden.lr=0.02", "optimizer.groups.embed.lr=3e-3")
    assert run.optimizer.group_overrides == {"hidden": {"lr": 0.02}, "embed": {"lr": 3e-3}}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_trains_the_tiny_model(tiny_run, name):
    lr = {"sgdm": 0.3, "lion": 3e-3}.get(name)  # others: their yaml defaults
    run = tiny_run(f"optimizer={name}", "train.max_steps=30", "optimizer.lr_config.warmup=5",
                   *([f"optimizer.lr_config.lr={lr}"] if lr else []))
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    batch = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    # A learnable pattern: the next token is the current one plus one.
    batch[..., 1:] = (batch[..., :1] + np.arange(1, 17)) % 64
    placed = meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1))
    losses = []
    for _ in range(30):
        state, metrics = step(state, placed)
        losses.append(float(metrics["train/loss"]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], (name, losses[0], losses[-1])
    assert {f"train/lr/{g}" for g in ("hidden", "embed", "scalar")} <= set(metrics)
