"""Does the best lr transfer across width? The lr sweep of a tiny width ladder under SP and muP
(docs/models.md "muP"; tests/test_mup.py checks the optima).

    python scripts/mup_transfer.py                                   # adamw and muon, widths 32 64 128
    python scripts/mup_transfer.py --optimizers adamw --widths 32 64 --steps 40 model.num_blocks=2

For each optimizer, parametrisation (SP: model.mup=false; muP: model.mup=true, model.mup_base_dim=
--base-dim) and width it builds the run's model and optimizer from conf/ as train_jax.py does
(scripts/coord_check.py's build_run; other arguments are Hydra overrides), and trains --steps steps
at every lr of a log2 grid: the peak lr times 2^k for k in --log2-multipliers, each of the
optimizer's lr knobs (lr_config.lr and, for Muon-type optimizers, adam_lr: LR_KNOBS) times the same
factor. The lrs are the step's arguments (optimizer/arguments.py), so one vmapped program trains the
whole grid of one width. The data is a fixed random Markov chain over the vocabulary (a learnable,
width-independent task; no files), a fresh batch per step; the score is the loss on held-out
batches after the last step. Printed: the final loss per grid point and the best log2 multiplier per
width; the optimum "transfers" when it moves less than one grid step across the ladder.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as `python scripts/mup_transfer.py`: the checkout's packages, not an install's

import argparse
import json

import numpy as np

from utils.errors import ConfigError, EqtrainError
from utils.script_errors import script_error

PARAMETRISATIONS = ("sp", "mup")
LR_KNOBS = ("adam_lr",)  # optimizer knobs that are a second peak lr (Muon's AdamW groups): scaled with lr_config.lr


def markov_tokens(vocab: int, shape: tuple[int, ...], seed: int, concentration: float = 0.1) -> np.ndarray:
    """int32 tokens of `shape` (..., T): each row a walk of one fixed random Markov chain whose
    transition rows are Dirichlet(concentration) draws (peaked: a few likely successors per token)."""
    rng = np.random.default_rng(seed)
    trans_VxV = rng.dirichlet(np.full(vocab, concentration), size=vocab)
    cdf_VxV = np.cumsum(trans_VxV, axis=1)
    data = np.random.default_rng(seed + 1)
    rows = int(np.prod(shape[:-1]))
    out = np.empty((rows, shape[-1]), np.int32)
    out[:, 0] = data.integers(0, vocab, rows)
    for t in range(1, shape[-1]):
        u = data.random(rows)[:, None]
        out[:, t] = np.minimum((u > cdf_VxV[out[:, t - 1]]).sum(1), vocab - 1)
    return out.reshape(shape)


def final_losses(run, log2_multipliers: list[float], steps: int, batch_size: int, seed: int,
                 lr_knobs: tuple[str, ...] = LR_KNOBS) -> list[float]:
    """The held-out loss after `steps` steps at each lr multiplier 2^k (of lr_config.lr and the
    optimizer's `lr_knobs`), the same init and batches for all."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import models
    import train_jax
    from optimizer import arguments, make_optimizer

    model = train_jax.init_model(run, jax.random.PRNGKey(seed))
    labels = models.param_labels(model)
    params, static = eqx.partition(model, eqx.is_array)
    T, V = run.context_length, run.model.vocab_size
    tokens = markov_tokens(V, (steps + 4, batch_size, T + 1), seed)  # 4 held-out batches after the training ones
    train_SxBxT1, heldout_HxBxT1 = jnp.asarray(tokens[:steps]), jnp.asarray(tokens[steps:])
    o, clip = run.optimizer, run.train.gradient_clip_val
    knobs = arguments.lift(o, clip)

    def loss_fn(params, tokens_BxT1):
        logits_BxTxV = eqx.combine(params, static)(tokens_BxT1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, tokens_BxT1[:, 1:]).mean()

    def train(multiplier):
        values = jax.tree.map(lambda v: v, knobs)
        values["schedule"] = {**values["schedule"], "lr": knobs["schedule"]["lr"] * multiplier}
        values["optimizer"] = {k: v * multiplier if k in lr_knobs else v for k, v in knobs["optimizer"].items()}
        bound, bound_clip = arguments.bind(o, clip, values)
        tx = make_optimizer(bound.hparams, bound.schedule.build(bound.schedule_steps), labels, bound_clip,
                            bound.schedule.lr, bound.group_overrides, bound.cautious, bound.hyperball, bound.lr_scales)

        def step(carry, tokens_BxT1):
            p, s = carry
            grads = jax.grad(loss_fn)(p, tokens_BxT1)
            updates, s = tx.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), None

        (p, _), _ = jax.lax.scan(step, (params, tx.init(params)), train_SxBxT1)
        loss = jnp.mean(jax.vmap(lambda b: loss_fn(p, b))(heldout_HxBxT1))
        return jnp.where(jnp.isfinite(loss), loss, jnp.inf)

    multipliers = jnp.asarray([2.0 ** k for k in log2_multipliers], jnp.float32)
    return [float(x) for x in jax.jit(jax.vmap(train))(multipliers)]


def sweep(optimizers: list[str], widths: list[int], log2_multipliers: list[float], steps: int, base_dim: int,
          overrides: list[str], batch_size: int = 16, seed: int = 0, lr_knobs: tuple[str, ...] = LR_KNOBS) -> dict:
    """{optimizer: {sp|mup: {"losses": {width: [loss per multiplier]}, "best": {width: best log2 multiplier},
    "shift": max - min of the best over the widths, in grid steps}}}."""
    coord = _coord_check()
    if steps < 1 or len(widths) < 2 or len(log2_multipliers) < 3:
        raise ConfigError(f"--steps={steps}, --widths={widths}, --log2-multipliers={log2_multipliers}: a transfer "
                          "needs at least 1 step, 2 widths and 3 grid points")
    grid_step = float(np.min(np.diff(sorted(log2_multipliers))))
    results: dict = {}
    for opt in optimizers:
        for p in PARAMETRISATIONS:
            losses = {}
            for w in widths:
                if p == "mup" and w == base_dim:  # muP at its base width is SP, bit for bit (tests/test_mup.py)
                    losses[w] = results[opt]["sp"]["losses"][w]
                    continue
                run = coord.build_run(opt, w, p == "mup", base_dim, [f"train.max_steps={steps}", *overrides])
                losses[w] = final_losses(run, log2_multipliers, steps, batch_size, seed, lr_knobs)
            best = {w: float(log2_multipliers[int(np.argmin(losses[w]))]) for w in widths}
            shift = (max(best.values()) - min(best.values())) / grid_step
            results.setdefault(opt, {})[p] = {"losses": losses, "best": best, "shift": shift}
    return results


def _coord_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coord_check", os.path.join(REPO, "scripts", "coord_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(results: dict, widths: list[int]) -> str:
    """A markdown table: per optimizer and parametrisation, the best log2 lr multiplier per width and the shift."""
    head = "| optimizer | parametrisation | " + " | ".join(f"best log2 lr x, dim {w}" for w in widths)
    lines = [head + " | shift (grid steps) |", "|" + " --- |" * (len(widths) + 3)]
    for opt, by_p in results.items():
        for p in PARAMETRISATIONS:
            r = by_p[p]
            lines.append(f"| {opt} | {p} | " + " | ".join(f"{r['best'][w]:+g}" for w in widths) +
                         f" | {r['shift']:g} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--widths", nargs="+", type=int, default=[32, 64, 128])
    parser.add_argument("--log2-multipliers", nargs="+", type=float, default=[-4, -3, -2, -1, 0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--base-dim", type=int, default=32, help="model.mup_base_dim of the muP runs")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-adam-lr", action="store_true",
                        help="sweep lr_config.lr alone (Muon's hidden lr), adam_lr held at its value")
    parser.add_argument("--out", default=None, help="also write every number to this JSON file")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train_jax.py")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = sweep(args.optimizers, args.widths, args.log2_multipliers, args.steps, args.base_dim,
                        args.overrides, args.batch_size, args.seed, () if args.fixed_adam_lr else LR_KNOBS)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**vars(args), "results": results}, f, indent=1)
    except (EqtrainError, OSError) as e:
        return script_error(e, hint="check --out's folder")
    for opt, by_p in results.items():
        for p in PARAMETRISATIONS:
            for w in args.widths:
                row = " ".join(f"{x:7.4f}" for x in by_p[p]["losses"][w])
                print(f"{opt:8s} {p:4s} dim {w:4d}: {row}")
    print(table(results, args.widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
