"""The optimizer contract (optimizer/contract.py): every registered optimizer is an `Optimizer`, inherits the
shared knob instead of copying it, and overrides only what the contract names; an optimizer that declares
nothing but `transform` gets every default and goes through the per-group plumbing, the step arguments,
the cautious mask and validation's hooks like the registered ones."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optimizer import OPTIMIZERS, eval_view, for_run, make_optimizer
from optimizer.arguments import optimizer_knobs
from optimizer.contract import Optimizer
from optimizer.groups import GROUPS, group_knobs, group_lr

CONTRACT = {name for name, _ in inspect.getmembers(Optimizer) if not name.startswith("_")}
NONE = type(None)
KINDS = {"GROUP_KNOBS": tuple, "CONSTANT_KNOBS": tuple, "RUN_LENGTH_KNOB": (str, NONE), "COOLDOWN": bool,
         "CAUTIOUS_UNSUPPORTED": (str, NONE), "HYPERBALL_UNSUPPORTED": (str, NONE),
         "MUP_HIDDEN_LR_POWER": (float, NONE, property),
         "diagnostics": (NONE, type(lambda: 0)), "eval_params": (NONE, type(lambda: 0)), "check": "method",
         "transform": "method", "group_knobs": "method", "group_knob_hint": "method", "default_group_lr": "method",
         "for_run": "method", "hessian_due": "method", "decay_embeddings": bool}


def test_the_contract_lists_every_member_it_has():
    assert set(KINDS) == CONTRACT  # a new member of the contract gets its kind here (and its docs)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_optimizer_is_an_optimizer_and_inherits_the_shared_knob(name):
    cls = OPTIMIZERS[name]
    assert issubclass(cls, Optimizer) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    own = [c for c in cls.__mro__ if c is not Optimizer and issubclass(c, Optimizer)]
    assert not any("decay_embeddings" in c.__dict__.get("__annotations__", {}) for c in own), \
        f"{name} copies decay_embeddings: the contract's base class gives it"
    # whatever it overrides of the contract keeps the contract's kind
    for member, kind in KINDS.items():
        value = getattr(cls, member)
        assert (callable(value) if kind == "method" else isinstance(value, kind)), (name, member, value)


@dataclasses.dataclass(frozen=True)
class Plain(Optimizer):
    """The least an optimizer declares: its knobs and its transform."""

    momentum: float = 0.5
    weight_decay: float = 0.1

    def transform(self, group, schedule):
        return optax.chain(optax.trace(self.momentum), optax.add_decayed_weights(self.weight_decay),
                           optax.scale_by_learning_rate(schedule))


def test_an_optimizer_that_declares_only_its_transform_gets_every_default():
    hp = Plain()
    assert hp.decay_embeddings is False and hp.CONSTANT_KNOBS == () and hp.RUN_LENGTH_KNOB is None
    assert hp.COOLDOWN and hp.CAUTIOUS_UNSUPPORTED is None and hp.HYPERBALL_UNSUPPORTED is None
    assert hp.MUP_HIDDEN_LR_POWER is None  # no known muP rule: the header says so
    assert all(group_knobs(hp, g) == ("lr",) for g in GROUPS)
    assert group_lr(hp, "embed", 0.3, {}) == 0.3 and for_run(hp, "cosine", None, 100) is hp
    assert eval_view(hp) is None and hp.diagnostics is None
    assert hp.hessian_due(None) is None  # reads no Hessian estimate: the train step computes none
    assert optimizer_knobs(hp) == ("momentum", "weight_decay")  # the float knobs become step arguments
    params = {"w": jnp.ones((3, 2)), "b": jnp.ones((2,))}
    labels = {"w": "hidden", "b": "scalar"}
    grads = jax.tree.map(lambda x: 0.5 * x, params)
    for cautious in (False, True):
        tx = make_optimizer(hp, optax.constant_schedule(0.1), labels, clip=1.0, base_lr=0.1, cautious=cautious)
        updates, _ = tx.update(grads, tx.init(params), params)
        # clip (the global norm √(8·0.25) = √2 > 1 scales by 1/√2), momentum's first step, then decay on the
        # hidden matrix only (a scalar group does not decay by default), times -lr: exact in float32 to ~1 ulp
        g = 0.5 / np.sqrt(2.0)
        np.testing.assert_allclose(updates["w"], -0.1 * (g + 0.1) * np.ones((3, 2)), rtol=4e-7)  # ~3 f32 ulps
        np.testing.assert_allclose(updates["b"], -0.1 * g * np.ones(2), rtol=4e-7)  # (4e-7: ~3 f32 ulps)
    with pytest.raises(NotImplementedError, match="Bare.transform"):
        type("Bare", (Optimizer,), {})().transform("hidden", optax.constant_schedule(0.1))
