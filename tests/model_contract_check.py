"""Every model family's forward pass sharded over 8 host devices against one device; prints one JSON line.

Run by tests/test_model_contract.py in a subprocess, because the device count must be fixed before jax
is imported:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/model_contract_check.py

Each family of models.MODELS, and docs/example_family.py registered as `tiny` (what a new family gets),
builds its tiny model (`family_config`), lays its parameters out by its own `param_axes` on a
data 2 x fsdp 2 x tensor 2 mesh (utils/parallel/layout.py param_spec, as a run does) with the batch
split over data x fsdp, and computes the logits and the loss gradient's norm there and on one device.
Also imported by the test for `family_config` and `TINY` (no jax work at import).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import models  # noqa: E402 - after the path
from models import hf  # noqa: E402

TINY_NAME = "tiny"


def _load_tiny():
    """docs/example_family.py as a module (the guide's family; registered by whoever runs it)."""
    spec = importlib.util.spec_from_file_location("eqtrain_example_family", os.path.join(ROOT, "docs",
                                                                                          "example_family.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while built
    spec.loader.exec_module(module)
    return module


TINY = _load_tiny()


def family_overrides(name: str) -> tuple[str, ...]:
    """The Hydra overrides of a family's run (on tests/helpers.py's TINY_OVERRIDES): its `<name>_tiny`
    yaml, else its first; a family without a yaml (the guide's) names itself on the default yaml's knobs."""
    yamls = hf.family_yamls(name)
    if not yamls:
        return (f"model.name={name}",)
    return (f"model={f'{name}_tiny' if f'{name}_tiny' in yamls else yamls[0]}",)


def family_config(name: str, *overrides: str):
    """The family's tiny model config (dim 32, 2 blocks, context 16, vocab 64), validated as a run's."""
    from helpers import compose_config

    from utils.config import validate

    return validate(compose_config(*family_overrides(name), *overrides)).model


def main() -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import logits_atol, mean_loss_atol
    from jax.sharding import NamedSharding

    from models.losses import cross_entropy
    from utils.parallel import mesh as meshlib
    from utils.parallel.layout import param_spec

    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    models.MODELS[TINY_NAME] = TINY
    mesh = meshlib.make_mesh(2, 2, 8, tensor=2)
    forward = eqx.filter_jit(lambda model, tokens_BxT: model(tokens_BxT))
    loss = eqx.filter_jit(lambda model, tokens_BxT1: cross_entropy(model, tokens_BxT1, None, jnp.float32)[0])
    out = {}
    for name in models.MODELS:
        cfg = family_config(name)
        model = models.build(cfg, jax.random.PRNGKey(0))
        tokens_BxT1 = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.context_length + 1), np.int32)
        want, want_loss = np.asarray(forward(model, tokens_BxT1[:, :-1])), float(loss(model, tokens_BxT1))
        arrays, static = eqx.partition(model, eqx.is_array)
        axes_of = {path: a for path, a in jax.tree_util.tree_leaves_with_path(
            models.param_axes(model), is_leaf=lambda x: isinstance(x, tuple))}
        specs = jax.tree_util.tree_map_with_path(lambda path, x, axes_of=axes_of: param_spec(
            x.shape, axes_of.get(path), mesh), arrays)
        sharded = eqx.combine(jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), arrays, specs),
                              static)
        tokens = jax.device_put(tokens_BxT1, meshlib.batch_sharding(mesh))
        got, got_loss = forward(sharded, tokens[:, :-1]), float(loss(sharded, tokens))
        out[name] = {"logits_diff": float(np.abs(np.asarray(got) - want).max()), "logits_atol": logits_atol(cfg, want),
                     "loss": [want_loss, got_loss],
                     "loss_atol": mean_loss_atol(cfg, want, want_loss, tokens_BxT1[:, 1:].size),
                     "tensor_split": sum("tensor" in s for s in jax.tree.leaves(specs)),
                     "fsdp_split": sum("fsdp" in s for s in jax.tree.leaves(specs)),
                     "devices": len(got.sharding.device_set)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
