"""Mixture-of-Experts MLPs (`model.moe.*`), for any family: a router picks each token's top-k
experts, the family's MLP runs as a stack of experts, and the router's statistics come back for
the router losses the training loss adds.

Routing (per micro-batch; the N = B·T tokens flattened row-major: batch row, then position):
router logits in float32 (Switch's selective precision), softmax over the E experts, the top-k
experts per token; their weights are the top-k probabilities renormalised to sum to 1
(`renormalize`, Mixtral) or left as they are (Switch). A token's MoE output is the weighted sum
of its experts' MLP outputs. A shared expert (`shared_expert_hidden` > 0, Qwen2-MoE's) is one more
MLP that every token passes through, scaled by a sigmoid gate sigmoid(x·w_gate) (w_gate: D x 1) and
added to the routed experts' sum; it is not routed, so it enters no router statistic.

Dispatch:
  dropless (`capacity_factor: null`)  every token-slot is computed: the slots sorted by expert and
      run as one grouped matmul per weight (`jax.lax.ragged_dot`), the active FLOPs only.
  capacity (`capacity_factor: c`)  each expert has C = ceil(c·N·k/E) slots (at most N). Slots are
      filled in priority order, as Switch and GShard do: every token's first choice before any
      second choice, and within one choice by the token's place in the micro-batch (row-major). A
      token-slot beyond its expert's C is dropped: it contributes zero, and the residual stream
      carries the token past the layer unchanged. Deterministic: the same batch drops the same
      slots on any number of devices (the rule is over the global micro-batch).

Router losses: load balance E·Σ_e f_e·P_e (f_e the fraction of token-slots routed to e before any
drop, P_e the mean router probability of e; 1 when balanced, E when collapsed onto one expert;
Hugging Face's Mixtral loss is k times this) and z-loss mean_n(logsumexp(logits_n)²) (ST-MoE).
Only the tokens the loss counts enter f, P, the z-loss and the dropped fraction: the batch's loss
mask (> 0; chat's assistant tokens, not padding, not a target that starts the next document under
dataset.document_mask), as `router_mask_BxT` (losses.py for AR, mdlm.py for masked diffusion), as
transformers' Mixtral excludes padding by its attention mask. Masked tokens are still routed and
computed (and take capacity slots): only the statistics leave them out.
Over the MoE layers (`balance_pooling`): `layer` (default) averages the per-layer losses
mean_l E·Σ_e f_le·P_le (so a coefficient does not depend on depth); `global` pools f and P over all
layers first, E·Σ_e mean_l(f_le)·mean_l(P_le), as transformers' `load_balancing_loss_func` does
(it concatenates every layer's router logits). The two differ by E·Σ_e Cov_l(f_le, P_le); every
layer counts the same tokens, so the mean over layers is the pooled mean. The z-loss is the same
either way.

A model with MoE on returns its router statistics beside the logits when called with
`collect=True` (stats["moe"]); `forward` asks for them only for such a model, so a dense model's
call, and so its compiled program, is untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from models.layers import Linear, apply_blocks
from utils.errors import ConfigError

BALANCE_POOLINGS = ("layer", "global")  # MoEConfig.balance_pooling: see the module docstring


@dataclass(frozen=True)
class MoEConfig:
    """`model.moe`: which blocks have a Mixture-of-Experts MLP and how tokens are routed."""

    num_experts: int = 0  # experts per MoE block; 0 = MoE off (every block dense)
    top_k: int = 2  # experts per token (Mixtral: 2; Switch: 1)
    capacity_factor: float | None = None  # slots per expert = ceil(c * tokens * top_k / num_experts); null = dropless
    every: int = 1  # block i is MoE when (i + 1) % every == 0: 1 = all, 2 = every second (blocks 1, 3, ...)
    renormalize: bool = True  # top-k weights renormalised to sum to 1 (Mixtral); false = raw probabilities (Switch)
    load_balance_coef: float = 0.01  # times the load-balance loss E * sum_e f_e * P_e, added to the training loss
    z_loss_coef: float = 0.001  # times the router z-loss mean(logsumexp(logits)^2), added to the training loss
    # layer: the mean over MoE layers of E*sum_e f_e*P_e; global: f and P pooled over the layers first (transformers)
    balance_pooling: str = "layer"
    # the width of a shared SwiGLU expert every token passes, times sigmoid(x·w) (Qwen2-MoE; llama only); 0 = none
    shared_expert_hidden: int = 0

    def check(self, prefix: str) -> None:
        if self.num_experts < 0:
            raise ConfigError(f"{prefix}.num_experts={self.num_experts} must be >= 0 (0 = MoE off)")
        if self.every <= 0:
            raise ConfigError(f"{prefix}.every={self.every} must be a positive integer (1 = every block is MoE)")
        for knob in ("load_balance_coef", "z_loss_coef"):
            if getattr(self, knob) < 0:
                raise ConfigError(f"{prefix}.{knob}={getattr(self, knob)} must be >= 0 (0 = not added)")
        if self.shared_expert_hidden < 0:
            raise ConfigError(f"{prefix}.shared_expert_hidden={self.shared_expert_hidden} must be >= 0 (0 = no "
                              "shared expert)")
        if self.balance_pooling not in BALANCE_POOLINGS:
            raise ConfigError(f"{prefix}.balance_pooling={self.balance_pooling!r} must be one of "
                              f"{', '.join(BALANCE_POOLINGS)}")
        if not self.num_experts:
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{prefix}.top_k={self.top_k} must be between 1 and {prefix}.num_experts="
                              f"{self.num_experts}: each token picks top_k distinct experts")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"{prefix}.capacity_factor={self.capacity_factor} must be positive (e.g. 1.25), "
                              "or null for dropless routing")

    @property
    def on(self) -> bool:
        return self.num_experts > 0

    def check_blocks(self, num_blocks: int, prefix: str) -> None:
        """The family's part: `every` must tile the blocks (they are scanned in groups of `every`)."""
        if self.on and num_blocks % self.every:
            raise ConfigError(f"{prefix}.num_blocks={num_blocks} is not a multiple of {prefix}.moe.every="
                              f"{self.every}: blocks are scanned in groups of `every` (the last one MoE)")

    def layers(self, num_blocks: int) -> tuple[int, ...]:
        """The indices of the MoE blocks."""
        return tuple(i for i in range(num_blocks) if (i + 1) % self.every == 0) if self.on else ()

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert for `num_tokens` tokens; None = dropless."""
        if self.capacity_factor is None:
            return None
        return max(1, min(num_tokens, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)))


# ----------------------------------------------------------------------------- the experts' matmuls


@dataclass(frozen=True)
class Groups:
    """How a stack of experts' inputs is laid out, so a family's MLP is written once for both
    dispatches: capacity slots `x_ExCxI` (an einsum per expert, which splits cleanly over the
    `expert` mesh axis), or dropless rows `x_MxI` sorted by expert with `sizes_E` rows each
    (`expert_M`: each row's expert, for the biases)."""

    sizes_E: jax.Array | None = None
    expert_M: jax.Array | None = None

    def matmul(self, x: jax.Array, w_ExIxO: jax.Array) -> jax.Array:
        w_ExIxO = w_ExIxO.astype(x.dtype)
        if self.sizes_E is None:
            return jnp.einsum("eci,eio->eco", x, w_ExIxO)
        return jax.lax.ragged_dot(x, w_ExIxO, self.sizes_E)

    def linear(self, x: jax.Array, layer: Linear) -> jax.Array:
        """A Linear whose weight (E, I, O) and bias (E, O) carry a leading expert axis."""
        y = self.matmul(x, layer.weight_IxO)
        if layer.bias_O is None:
            return y
        b_ExO = layer.bias_O.astype(y.dtype)
        return y + (b_ExO[:, None, :] if self.sizes_E is None else b_ExO[self.expert_M])


class MoE(eqx.Module):
    """A router and a stack of experts. `experts` is the family's MLP with every weight carrying a
    leading expert axis, called as `experts(x, groups)` (see `Groups`). `shared` (or None): the
    family's plain MLP every token passes, `shared(x_NxD)`, scaled by sigmoid(x·shared_gate)."""

    router: Linear  # D x E, no bias
    experts: Any
    shared: Any = None  # the shared expert (MoEConfig.shared_expert_hidden > 0); None = none
    shared_gate: Linear | None = None  # D x 1, no bias: the shared expert's sigmoid gate

    def __call__(self, x_BxTxD: jax.Array, cfg: MoEConfig, router_mask_BxT: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the MoE output, B x T x D in x's dtype; this layer's router statistics over the tokens
        where `router_mask_BxT` > 0, all of them when None)."""
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D)
        logits_NxE = x_NxD.astype(jnp.float32) @ self.router.weight_IxO.astype(jnp.float32)
        mask_N = None if router_mask_BxT is None else router_mask_BxT.reshape(B * T)
        route = routing(logits_NxE, cfg.top_k, cfg.capacity(B * T), cfg.renormalize, mask_N)
        y_NxD = dispatch(self.experts, x_NxD, route, cfg.num_experts)
        if self.shared is not None:
            gate_Nx1 = jax.nn.sigmoid(self.shared_gate(x_NxD))
            y_NxD = y_NxD + (gate_Nx1 * self.shared(x_NxD)).astype(y_NxD.dtype)
        return y_NxD.reshape(B, T, D), route.stats


@dataclass(frozen=True)
class Route:
    """Where each token-slot goes: `expert_NxK`, `weight_NxK` (float32), `slot_NxK` (its index among
    the expert's slots; capacity routing only) and `kept_NxK`; the layer's `stats`."""

    expert_NxK: jax.Array
    weight_NxK: jax.Array
    slot_NxK: jax.Array | None
    kept_NxK: jax.Array | None
    capacity: int | None
    stats: dict


def routing(logits_NxE: jax.Array, top_k: int, capacity: int | None, renormalize: bool,
            mask_N: jax.Array | None = None) -> Route:
    """Top-k routing with the drop rule of the module docstring, and the router statistics over
    the tokens where `mask_N` > 0 (every token when None; all zeros when no token counts). The
    routing itself ignores the mask: a masked token is routed, computed and takes its slots."""
    N, E = logits_NxE.shape
    probs_NxE = jax.nn.softmax(logits_NxE, axis=-1)
    weight_NxK, expert_NxK = jax.lax.top_k(probs_NxE, top_k)  # ties: the lower expert index first
    if renormalize:
        weight_NxK = weight_NxK / weight_NxK.sum(-1, keepdims=True)
    # Priority order: slot k of every token before slot k+1 of any, then row-major position.
    chosen_KxNxE = jax.nn.one_hot(expert_NxK.T, E, dtype=jnp.int32)
    counted_N = jnp.ones((N,), jnp.float32) if mask_N is None else (mask_N > 0).astype(jnp.float32)
    n = jnp.maximum(counted_N.sum(), 1.0)  # the counted tokens (1 when none: the statistics are then 0)
    # Masked means as matmuls with the 0/1 mask (a masked token's probabilities, even inf·0, never enter).
    load_E = jnp.einsum("n,kne->e", counted_N, chosen_KxNxE.astype(jnp.float32)) / (n * top_k)  # f_e, before any drop
    prob_E = jnp.where(counted_N[:, None] > 0, probs_NxE, 0.0).sum(0) / n  # P_e
    lse_sq_N = jnp.square(jax.nn.logsumexp(logits_NxE, axis=-1))
    stats = {"load_balance": E * jnp.sum(load_E * prob_E),
             "z_loss": jnp.where(counted_N > 0, lse_sq_N, 0.0).sum() / n,
             "load": load_E, "prob": prob_E}
    if capacity is None:
        return Route(expert_NxK, weight_NxK, None, None, None, {**stats, "dropped": jnp.zeros((), jnp.float32)})
    before_KxNxE = jnp.cumsum(chosen_KxNxE.reshape(top_k * N, E), axis=0).reshape(top_k, N, E) - chosen_KxNxE
    slot_NxK = jnp.sum(before_KxNxE * chosen_KxNxE, axis=-1).T  # slots of this expert taken before this one
    kept_NxK = slot_NxK < capacity
    dropped = jnp.sum(counted_N[:, None] * (~kept_NxK)) / (n * top_k)  # of the counted tokens' slots
    return Route(expert_NxK, weight_NxK, slot_NxK, kept_NxK, capacity, {**stats, "dropped": dropped})


def dispatch(experts: Callable, x_NxD: jax.Array, route: Route, num_experts: int) -> jax.Array:
    """Σ_k weight_k · expert_k(x) per token (dropped slots contribute 0), in x's dtype."""
    N, D = x_NxD.shape
    K, E = route.expert_NxK.shape[1], num_experts
    if route.capacity is None:
        # Dropless: the N·K slots in priority order, sorted (stably) by expert, as ragged groups.
        expert_S = route.expert_NxK.T.reshape(-1)
        order_S = jnp.argsort(expert_S, stable=True)
        sizes_E = jnp.bincount(expert_S, length=E).astype(jnp.int32)
        y_SxD = experts(x_NxD[order_S % N], Groups(sizes_E, expert_S[order_S]))
        y_KxNxD = jnp.zeros_like(y_SxD).at[order_S].set(y_SxD).reshape(K, N, D)
        weight_KxN = route.weight_NxK.T
    else:
        C = route.capacity
        # Each kept slot's place in the E·C buffer; dropped ones point at one spare row past its end.
        dest_NxK = jnp.where(route.kept_NxK, route.expert_NxK * C + route.slot_NxK, E * C)
        token_of_slot = jnp.full((E * C + 1,), N, jnp.int32).at[dest_NxK.reshape(-1)].set(
            jnp.repeat(jnp.arange(N, dtype=jnp.int32), K))
        x_pad = jnp.concatenate([x_NxD, jnp.zeros((1, D), x_NxD.dtype)])  # empty slots read zeros
        y_ExCxD = experts(x_pad[token_of_slot[:E * C]].reshape(E, C, D), Groups())
        y_pad = jnp.concatenate([y_ExCxD.reshape(E * C, D), jnp.zeros((1, D), y_ExCxD.dtype)])
        y_KxNxD = y_pad[dest_NxK.T]
        weight_KxN = jnp.where(route.kept_NxK, route.weight_NxK, 0.0).T
    return jnp.einsum("kn,knd->nd", weight_KxN.astype(y_KxNxD.dtype), y_KxNxD)


# ----------------------------------------------------------------------------- stacked blocks


class Group(eqx.Module):
    """`every` consecutive blocks when `every` > 1: the dense ones (leaves (G, every-1, ...)) and the
    MoE one last (leaves (G, ...)); the model's blocks are G = num_blocks / every such groups."""

    dense: Any
    moe: Any


def init_blocks(key: jax.Array, cfg, dense_init: Callable, moe_init: Callable):
    """A family's stacked blocks with MoE on (`cfg`: the family's Config): block i from the i-th of
    num_blocks keys, as dense blocks are; all MoE blocks stacked (every = 1), or groups (`Group`)."""
    every, keys_L = cfg.moe.every, jax.random.split(key, cfg.num_blocks)
    if every == 1:
        return eqx.filter_vmap(moe_init)(keys_L)
    keys_GxEvery = keys_L.reshape(cfg.num_blocks // every, every, *keys_L.shape[1:])
    return Group(eqx.filter_vmap(eqx.filter_vmap(dense_init))(keys_GxEvery[:, :-1]),
                 eqx.filter_vmap(moe_init)(keys_GxEvery[:, -1]))


def run_blocks(call: Callable, x_BxTxD: jax.Array, blocks, key: jax.Array | None, cfg, collect: bool):
    """Run stacked blocks with MoE on by layers.apply_blocks (scan or unrolled, remat): `call(block, x,
    key)` -> x (a dense block without `collect`) or (x, stats) (with `collect`, and an MoE block
    always, its router statistics under "moe"). Returns (x, stats): with `collect` the activation
    RMS per block (num_blocks,) (and whatever else the blocks report, e.g. "max_logit" (num_blocks,
    H)), and "moe" (each value with a leading MoE-layer axis)."""
    every, L = cfg.moe.every, cfg.num_blocks
    if every == 1:
        return apply_blocks(lambda x, bk: call(bk[0], x, bk[1]), x_BxTxD, blocks, key, L, cfg.remat,
                            cfg.scan_blocks, cfg.scan_unroll, True)

    def group(x_BxTxD, group_and_key):
        g, k = group_and_key
        keys = list(jax.random.split(k, every)) if k is not None else [None] * every
        per_block = []
        for j in range(every - 1):
            out = call(jax.tree.map(lambda a, j=j: a[j], g.dense), x_BxTxD, keys[j])
            x_BxTxD, stats = out if collect else (out, {})
            per_block.append(stats)
        x_BxTxD, stats = call(g.moe, x_BxTxD, keys[-1])
        per_block.append({kind: v for kind, v in stats.items() if kind != "moe"})
        rms_every = {kind: jnp.stack([s[kind] for s in per_block]) for kind in per_block[-1]}
        return x_BxTxD, {**rms_every, "moe": stats["moe"]}

    x_BxTxD, stats = apply_blocks(group, x_BxTxD, blocks, key, L // every, cfg.remat, cfg.scan_blocks,
                                  cfg.scan_unroll, True)
    return x_BxTxD, {kind: v if kind == "moe" else v.reshape(L, *v.shape[2:]) for kind, v in stats.items()}


def logical_axes(model, table: dict[tuple[str, ...], tuple[str, ...]]):
    """Same tree as `model`, each array replaced by the logical names of its dimensions: the `table`
    entry whose key ends the array's path (a family's PARAM_AXES), after the stacked axes of blocks
    (block_axes); `embed` for every dimension of an array the table does not name."""

    def axes(path, leaf) -> tuple:
        names = tuple(getattr(p, "name", "") for p in path)
        logical = next((v for key, v in table.items() if names[-len(key):] == key), None)
        if names[0] == "blocks":  # the stacked axes in front (grouped MoE blocks: two; experts: `expert`)
            return block_axes(names, leaf.ndim, logical)
        return logical or ("embed",) * leaf.ndim

    return jax.tree_util.tree_map_with_path(axes, model)


def block_axes(names: tuple[str, ...], ndim: int, logical: tuple | None) -> tuple:
    """The logical axes of a stacked block leaf at path `names`: `logical` is the family's for a
    plain stacked block (("layers", ...); None: a vector per block, ("layers", "embed")). Every
    leading axis before the per-block ones is `layers` (two for a grouped dense block), and an
    expert's weight has `expert` right before its own axes. A dense model gets what it always got."""
    own = (logical or ("layers", "embed"))[1:]
    expert = ("expert",) if "experts" in names else ()
    return ("layers",) * (ndim - len(own) - len(expert)) + expert + own


def per_block(blocks):
    """The per-block view of stacked blocks (the per-layer metrics): every leaf with a leading
    num_blocks axis. A Group's leaves are padded with zeros into their blocks' places (squared
    norms per block stay exact); other stacks are returned as they are."""
    if not isinstance(blocks, Group):
        return blocks
    dense = jax.tree.leaves(blocks.dense)
    G, every = (dense[0].shape[0], dense[0].shape[1] + 1) if dense else (0, 1)

    def place(a, at: int, n: int):  # (G, n, ...) -> (G*every, ...) with zeros in the other blocks' places
        pad = [(0, 0), (at, every - at - n)] + [(0, 0)] * (a.ndim - 2)
        return jnp.pad(a, pad).reshape(G * every, *a.shape[2:])

    return (jax.tree.map(lambda a: place(a, 0, every - 1), blocks.dense),
            jax.tree.map(lambda a: place(a[:, None], every - 1, 1), blocks.moe))


# ----------------------------------------------------------------------------- the loss side


def moe_config(model) -> MoEConfig | None:
    """The model's MoE config when MoE is on, else None (any family; a wrapper's `cfg` too)."""
    moe = getattr(getattr(model, "cfg", None), "moe", None)
    return moe if moe is not None and moe.on else None


def forward(model, inputs_BxT: jax.Array, router_mask_BxT: jax.Array | None = None, max_logits: bool = False,
            **kwargs) -> tuple[jax.Array, dict | None]:
    """(logits, router statistics or None): a dense model is called exactly as before.
    `router_mask_BxT`: the tokens the router statistics count (> 0; the batch's loss mask), None = all.
    `max_logits` (optimizer.qk_clip_tau): the statistics are then a dict whatever the model, with
    "max_logit" (num_blocks, num_heads), each head's largest attention logit, beside "moe" (MoE only)."""
    if moe_config(model) is None and not max_logits:
        return model(inputs_BxT, **kwargs), None
    if moe_config(model) is None:
        logits, stats = model(inputs_BxT, max_logits=True, **kwargs)
        return logits, {"max_logit": stats["max_logit"]}
    logits, stats = model(inputs_BxT, collect=True, router_mask_BxT=router_mask_BxT, max_logits=max_logits, **kwargs)
    return logits, ({"moe": stats["moe"], "max_logit": stats["max_logit"]} if max_logits else stats["moe"])


def add_router_losses(loss: jax.Array, model, router: dict | None) -> tuple[jax.Array, dict]:
    """(the training loss: `loss` + coefficients x router losses; the aux entries the step's moe/*
    metrics read). `router`: the per-MoE-layer statistics, each with a leading layer axis."""
    if router is None:
        return loss, {}
    cfg = moe_config(model)
    balance, z = balance_loss(router, cfg), router["z_loss"].mean()
    layers = cfg.layers(model.cfg.num_blocks)
    aux = {"load_balance_loss": balance, "router_z_loss": z, "dropped_fraction": router["dropped"].mean(),
           "load": {str(layer): router["load"][i] for i, layer in enumerate(layers)}}
    return loss + cfg.load_balance_coef * balance + cfg.z_loss_coef * z, {"moe": aux}


def split_stats(stats: dict | None, max_logits: bool) -> tuple[dict | None, jax.Array | None]:
    """(router statistics or None, max logits (num_blocks, num_heads) or None) of `forward`'s statistics."""
    return (stats.get("moe"), stats["max_logit"]) if max_logits else (stats, None)


def balance_loss(router: dict, cfg: MoEConfig) -> jax.Array:
    """The load-balance loss over the MoE layers by `cfg.balance_pooling` (the module docstring):
    the mean of the per-layer losses, or E·Σ_e f̄_e·P̄_e of f and P pooled over the layers."""
    if cfg.balance_pooling == "global":
        return cfg.num_experts * jnp.sum(router["load"].mean(0) * router["prob"].mean(0))
    return router["load_balance"].mean()


def flops_per_token(cfg: MoEConfig, dim: int, mlp_matmul: int) -> float:
    """Forward multiply-adds per token of one MoE MLP: top_k experts (`mlp_matmul` weights each)
    and the router (dim x E); the caller multiplies by 6 for training FLOPs as for dense weights."""
    return cfg.top_k * mlp_matmul + dim * cfg.num_experts
