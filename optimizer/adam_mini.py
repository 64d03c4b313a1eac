"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More",
arXiv:2406.16793): Adam with ONE second-moment scalar per block of parameters instead of one per
coordinate, the block being where the authors find the Hessian's dense diagonal sub-blocks. The
first moment is Adam's, per coordinate; v keeps, per block, an EMA of the block's mean squared
gradient; the update is m̂ / (√v̂ + eps) with Adam's bias corrections, then AdamW's decoupled weight
decay times the lr. v shrinks from one float per weight to one per block (stored per column for
the query/key heads, see `Blocks`): the state is about half of Adam's.

The blocks, as the authors' reference code (PyPI `adam-mini` 1.1.1, `Adam_mini.step`) draws them
from parameter names, mapped onto our leaves (all weights stored d_in×d_out, PyTorch's out×in;
every leading axis is a stack axis: scan blocks, MoE experts, each slice its own blocks):
  * query and key projections: one block per attention head, the d_in×head_dim columns of that
    head (`q_proj`/`k_proj` of Llama: kv heads for k under GQA; the q and k thirds of GPT's fused,
    head-major `attn_qkv`, whose columns are (head, q|k|v, head_dim): models/gpt.py `_head_major`);
  * every other `hidden` matrix (values, the attention output, MLPs, MoE experts and router), the
    `lora` factors and the untied `head` (D×V): one block per output neuron, a column;
  * the token embedding (`wte_VxD`, `embed_VxD`): one block per token, a row;
  * biases: Adam, one v per coordinate (the reference's "bias" names);
  * norm gains: one block per gain vector (the reference's fallback for a name it does not know,
    one v per tensor); likewise GPT's position embedding `wpe_TxD`, whose name matches none of the
    reference's embedding names ("embed", "embd", "wte"), so it takes the fallback too: one v.
Which leaf is which is read from the parameter tree's paths and the model's `cfg.head_dim` (the
root of the tree the transform is handed: the Equinox model, its other groups' leaves masked), as
the reference reads `named_parameters()` and its `dim`/`n_heads` arguments. A tree without those
names (a dict of arrays) gets the per-group rules without the head rule.

One difference from the reference: it decays every parameter whose name has no "norm", "ln" or
"bias" (embeddings included); here, as for every optimizer, the groups decide
(`decay_embeddings`, default false, as AdamW's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optimizer.contract import Optimizer
from optimizer.diagnostics import find_states, sqrt_v_stats
from optimizer.groups import check_adam
from utils.errors import ConfigError

QK_PROJECTIONS = ("q_proj", "k_proj")  # Llama's separate projections (models/llama.py), columns (head, head_dim)
FUSED_QKV = "attn_qkv"  # GPT's fused projection (models/gpt.py), columns (head, q|k|v, head_dim)
TOKEN_EMBEDDINGS = ("wte", "embed")  # substrings of a token embedding's name, as the reference's "wte"/"embed"


@dataclass(frozen=True)
class Blocks:
    """How one leaf's coordinates share a second moment (static: from the leaf's path and shape).
    v is stored without `axes` (it broadcasts back over them): "adam" keeps every coordinate,
    "token" and "tensor" (a norm gain: per vector) average the last axis, "tensor" of a whole leaf
    (wpe) every axis, "neuron" the d_in axis (one v per column). "head" and "qkv" are stored as
    "neuron" is, per column, each head's v repeated over its head_dim columns: a query/key head's
    columns hold one number, and the state keeps the parameter's columns, so it is laid out as
    the parameter (utils/parallel/layout.py: heads split over the tensor axis whole) at the cost
    of head_dim copies of a few floats per head."""

    kind: str  # "adam" | "token" | "tensor" | "neuron" | "head" | "qkv"
    axes: tuple[int, ...] = ()
    head_dim: int = 0  # "head", "qkv": columns per head


def _names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", "")))) for k in path]


def leaf_blocks(group: str, path, shape: tuple[int, ...], head_dim: int | None) -> Blocks:
    """The Adam-mini blocks of one leaf of `group` (see the module docstring)."""
    names = _names(path)
    leaf, module = (names[-1] if names else ""), (names[-2] if len(names) > 1 else "")
    ndim = len(shape)
    whole = Blocks("tensor", tuple(range(-ndim, 0)))
    if ndim == 0:
        return Blocks("adam")
    if group == "scalar":
        return Blocks("adam") if "bias" in leaf.lower() else Blocks("tensor", (-1,))
    if group == "embed":
        return Blocks("token", (-1,)) if any(n in leaf.lower() for n in TOKEN_EMBEDDINGS) else whole
    if ndim < 2:
        return whole
    if group == "hidden" and leaf == "weight_IxO" and module in (*QK_PROJECTIONS, FUSED_QKV):
        where = f"optimizer=adam_mini: {'.'.join(names)}"
        if head_dim is None:
            raise ConfigError(f"{where} is a query/key projection but the model has no cfg.head_dim to split its "
                              "columns into heads: use a model of models/ (gpt, llama)")
        per_head = 3 * head_dim if module == FUSED_QKV else head_dim
        if shape[-1] % per_head:
            raise ConfigError(f"{where} has {shape[-1]} columns, not a multiple of {per_head} (head_dim {head_dim})")
        return Blocks("qkv" if module == FUSED_QKV else "head", (-2,), head_dim)
    return Blocks("neuron", (-2,))  # hidden, head (D x V: a token per column), lora


def mean_square(blocks: Blocks, g: jax.Array) -> jax.Array:
    """Each block's mean of g² in float32, shaped as v is stored (`Blocks`)."""
    sq = jnp.square(g.astype(jnp.float32))
    K = blocks.head_dim
    if blocks.kind == "head":  # (..., D, H·K), columns (head, K)
        per_head = jnp.mean(sq.reshape(*sq.shape[:-1], -1, K), axis=(-3, -1))  # (..., H)
        return jnp.repeat(per_head, K, axis=-1)
    if blocks.kind == "qkv":  # (..., D, H·3·K), columns (head, q|k|v, K)
        by_head = sq.reshape(*sq.shape[:-1], -1, 3, K)
        qk = jnp.mean(by_head[..., :2, :], axis=(-4, -1))  # (..., H, 2): q and k per head
        v = jnp.mean(by_head[..., 2, :], axis=-3)  # (..., H, K): v per column
        both = jnp.concatenate([jnp.broadcast_to(qk[..., None], (*qk.shape, K)), v[..., None, :]], axis=-2)
        return both.reshape(*v.shape[:-2], -1)
    return jnp.mean(sq, axis=blocks.axes) if blocks.axes else sq


def distinct(blocks: Blocks, v: jax.Array) -> jax.Array:
    """v with each block once (a query/key head's repeated columns taken once), flat."""
    K = blocks.head_dim
    if blocks.kind == "head":
        return v.reshape(*v.shape[:-1], -1, K)[..., 0].reshape(-1)
    if blocks.kind == "qkv":
        by_head = v.reshape(*v.shape[:-1], -1, 3, K)
        return jnp.concatenate([by_head[..., :2, 0].reshape(-1), by_head[..., 2, :].reshape(-1)])
    return v.reshape(-1)


def normalise(blocks: Blocks, m_hat: jax.Array, v_hat: jax.Array, eps) -> jax.Array:
    """m̂ / (√v̂ + eps), each coordinate divided by its block's √v̂."""
    den = jnp.sqrt(jnp.expand_dims(v_hat, blocks.axes)) + eps
    return (m_hat.astype(jnp.float32) / den).astype(m_hat.dtype)


class ScaleByAdamMiniState(NamedTuple):
    count: jax.Array  # updates taken (int32)
    mu: Any  # Adam's first moment, shaped as the parameters
    nu: Any  # per leaf, float32: each block's v, stored as `Blocks` says (per column for the head rule)


def _head_dim(tree) -> int | None:
    return getattr(getattr(tree, "cfg", None), "head_dim", None)


def _plans(group: str, tree) -> tuple[list, Any, list[Blocks]]:
    """(leaves, treedef, their Blocks) of `tree`: paths are read here, once, at trace time."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    head_dim = _head_dim(tree)
    return ([x for _, x in with_paths], treedef,
            [leaf_blocks(group, path, x.shape, head_dim) for path, x in with_paths])


def scale_by_adam_mini(group: str, b1: float = 0.9, b2: float = 0.95,
                       eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam-mini's direction m̂ / (√v̂ + eps) for the leaves of one parameter group (no lr, no decay)."""

    def init_fn(params):
        leaves, treedef, plans = _plans(group, params)
        nu = [jnp.zeros(jax.eval_shape(lambda x, b=b: mean_square(b, x), x).shape, jnp.float32)
              for x, b in zip(leaves, plans)]
        return ScaleByAdamMiniState(count=jnp.zeros((), jnp.int32), mu=jax.tree.map(jnp.zeros_like, params),
                                    nu=treedef.unflatten(nu))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef, plans = _plans(group, updates)
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        correction1, correction2 = 1 - jnp.asarray(b1, jnp.float32) ** t, 1 - jnp.asarray(b2, jnp.float32) ** t
        out, mus, nus = [], [], []
        for g, m, v, blocks in zip(leaves, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu), plans):
            m = (b1 * m + (1 - b1) * g).astype(m.dtype)
            v = b2 * v + (1 - b2) * mean_square(blocks, g)
            out.append(normalise(blocks, (m / correction1).astype(m.dtype), v / correction2, eps).astype(g.dtype))
            mus.append(m)
            nus.append(v)
        return treedef.unflatten(out), ScaleByAdamMiniState(count, treedef.unflatten(mus), treedef.unflatten(nus))

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class AdamMini(Optimizer):
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")  # settable per group
    MUP_HIDDEN_LR_POWER = 1.0  # model.mup: Adam-type (a block's shared v), hidden lr x base/width (optimizer/mup.py)

    def check(self, prefix: str) -> None:
        check_adam(prefix, self)

    def transform(self, group: str, schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            scale_by_adam_mini(group, self.b1, self.b2, self.eps),
            optax.add_decayed_weights(self.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )

    def diagnostics(self, group: str, group_state, params) -> dict:
        """sqrt_v_min / _median / _max: √v̂ (bias-corrected with the group's b2) over the group's
        blocks, each block counted once (a per-coordinate Adam leaf: each coordinate)."""
        states = find_states(group_state, ScaleByAdamMiniState)
        if not states:
            return {}
        shapes = {path: x.shape for path, x in jax.tree_util.tree_leaves_with_path(params)}
        head_dim = _head_dim(params)
        nus = [distinct(leaf_blocks(group, path, shapes[path], head_dim), v)
               for path, v in jax.tree_util.tree_leaves_with_path(states[0].nu)]
        return sqrt_v_stats(nus, states[0].count, self.b2)
