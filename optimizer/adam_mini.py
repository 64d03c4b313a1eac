"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More",
arXiv:2406.16793): Adam with ONE second-moment scalar per block of parameters instead of one per
coordinate, the block being where the authors find the Hessian's dense diagonal sub-blocks. The
first moment is Adam's, per coordinate; v keeps, per block, an EMA of the block's mean squared
gradient; the update is m̂ / (√v̂ + eps) with Adam's bias corrections, then AdamW's decoupled weight
decay times the lr. v shrinks from one float per weight to one per block: the state is about half
of Adam's.

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

from optimizer.diagnostics import find_states, sqrt_v_stats
from optimizer.groups import check_non_negative, check_positive, check_unit_interval
from utils.errors import ConfigError

QK_PROJECTIONS = ("q_proj", "k_proj")  # Llama's separate projections (models/llama.py), columns (head, head_dim)
FUSED_QKV = "attn_qkv"  # GPT's fused projection (models/gpt.py), columns (head, q|k|v, head_dim)
TOKEN_EMBEDDINGS = ("wte", "embed")  # substrings of a token embedding's name, as the reference's "wte"/"embed"


@dataclass(frozen=True)
class Blocks:
    """How one leaf's coordinates share a second moment: viewed as `view`, g² averaged over `axes`
    (negative, of the view) gives v (the view without those axes). `kind` names the rule (and
    "qkv": GPT's fused projection, per head for its q and k thirds and per column for v). Static:
    derived from the leaf's path and shape."""

    kind: str  # "adam" | "neuron" | "token" | "tensor" | "head" | "qkv"
    view: tuple[int, ...]
    axes: tuple[int, ...] = ()


def _names(path) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", "")))) for k in path]


def leaf_blocks(group: str, path, shape: tuple[int, ...], head_dim: int | None) -> Blocks:
    """The Adam-mini blocks of one leaf of `group` (see the module docstring)."""
    names = _names(path)
    leaf, module = (names[-1] if names else ""), (names[-2] if len(names) > 1 else "")
    shape, ndim = tuple(shape), len(shape)
    whole = Blocks("tensor", shape, tuple(range(-ndim, 0)))
    if ndim == 0:
        return Blocks("adam", shape)
    if group == "scalar":
        return Blocks("adam", shape) if "bias" in leaf.lower() else Blocks("tensor", shape, (-1,))
    if group == "embed":
        return Blocks("token", shape, (-1,)) if any(n in leaf.lower() for n in TOKEN_EMBEDDINGS) else whole
    if ndim < 2:
        return whole
    if group == "hidden" and leaf == "weight_IxO" and module in (*QK_PROJECTIONS, FUSED_QKV):
        if head_dim is None:
            raise ConfigError(f"optimizer=adam_mini: {'.'.join(names)} is a query/key projection but the model has "
                              "no cfg.head_dim to split its columns into heads: use a model of models/ (gpt, llama)")
        n = shape[-1]
        if module == FUSED_QKV:
            if n % (3 * head_dim):
                raise ConfigError(f"optimizer=adam_mini: {'.'.join(names)} has {n} columns, not 3 x heads x "
                                  f"head_dim {head_dim}")
            return Blocks("qkv", (*shape[:-1], n // (3 * head_dim), 3, head_dim))
        if n % head_dim:
            raise ConfigError(f"optimizer=adam_mini: {'.'.join(names)} has {n} columns, not heads x head_dim "
                              f"{head_dim}")
        return Blocks("head", (*shape[:-1], n // head_dim, head_dim), (-3, -1))
    return Blocks("neuron", shape, (-2,))  # hidden, head (D x V: a token per column), lora


def mean_square(blocks: Blocks, g: jax.Array):
    """Each block's mean of g² in float32: an array (the view less `axes`), or for "qkv" a pair
    (q and k per head (..., H, 2); v per column (..., H, K))."""
    sq = jnp.square(g.astype(jnp.float32)).reshape(blocks.view)
    if blocks.kind == "qkv":  # view (..., D, H, 3, K)
        return jnp.mean(sq[..., :2, :], axis=(-4, -1)), jnp.mean(sq[..., 2, :], axis=-3)
    return jnp.mean(sq, axis=blocks.axes) if blocks.axes else sq


def normalise(blocks: Blocks, m_hat: jax.Array, v_hat, eps) -> jax.Array:
    """m̂ / (√v̂ + eps), each coordinate divided by its block's √v̂, shaped as m̂."""
    m = m_hat.astype(jnp.float32).reshape(blocks.view)
    if blocks.kind == "qkv":
        qk, v = v_hat  # (..., H, 2), (..., H, K)
        den = jnp.concatenate([jnp.broadcast_to(qk[..., None], (*qk.shape, blocks.view[-1])), v[..., None, :]],
                              axis=-2)  # (..., H, 3, K)
        out = m / (jnp.sqrt(den)[..., None, :, :, :] + eps)
    else:
        out = m / (jnp.sqrt(jnp.expand_dims(v_hat, blocks.axes)) + eps)
    return out.reshape(m_hat.shape).astype(m_hat.dtype)


class ScaleByAdamMiniState(NamedTuple):
    count: jax.Array  # updates taken (int32)
    mu: Any  # Adam's first moment, shaped as the parameters
    nu: Any  # per leaf, one float32 per block (a pair for GPT's fused qkv): Blocks / mean_square


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
        nu = [jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda x, b=b: mean_square(b, x), x))
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
            v = jax.tree.map(lambda v, s: b2 * v + (1 - b2) * s, v, mean_square(blocks, g))
            v_hat = jax.tree.map(lambda x: x / correction2, v)
            out.append(normalise(blocks, (m / correction1).astype(m.dtype), v_hat, eps).astype(g.dtype))
            mus.append(m)
            nus.append(v)
        return treedef.unflatten(out), ScaleByAdamMiniState(count, treedef.unflatten(mus), treedef.unflatten(nus))

    return optax.GradientTransformation(init_fn, update_fn)


@dataclass(frozen=True)
class AdamMini:
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False

    GROUP_KNOBS = ("lr", "weight_decay", "b1", "b2", "eps")  # settable per group

    def check(self, prefix: str) -> None:
        check_unit_interval(prefix, self, "b1", "b2")
        check_non_negative(prefix, self, "weight_decay")
        check_positive(prefix, self, "eps")

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
        nus = [x for x in jax.tree.leaves(states[0].nu) if hasattr(x, "shape")]
        return sqrt_v_stats(nus, states[0].count, self.b2)
