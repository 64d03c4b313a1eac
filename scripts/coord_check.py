"""Coordinate check of model.mup (docs/models.md "muP"): does a few steps' training move the
activations by the same amount at every width?

    python scripts/coord_check.py                                  # adamw and muon, widths 32..256, 4 steps
    python scripts/coord_check.py --optimizers adamw --widths 8 16 32 --steps 2 model.num_blocks=2

For each optimizer, width and parametrisation (SP: model.mup=false; muP: model.mup=true with
model.mup_base_dim=--base-dim) it builds the run's model and optimizer from conf/ exactly as
train_jax.py does (every other argument is a Hydra override, e.g. optimizer.lr_config.lr=1e-2),
trains --steps steps at the peak lr (optimizer.lr_config.warmup=0 unless the overrides set it) on
one fixed batch of random tokens (float32, no dropout), and before each
step and after the last records the activation RMS the model reports for logging.activation_norms
(`collect=True`: per block the attention output, the MLP output, the residual stream;
trainer/activations.py logs the same values) and the RMS of the output logits and of their change
since step 0.

Under SP an Adam step moves every weight entry by ~lr whatever the width, and a width-n matmul
adds n such aligned changes: the activations' change grows ∝ width (log-log slope ≈ 1). Under muP
the hidden lr ∝ 1/width and the 1/width logit multiplier cancel that (slope ≈ 0). Printed: the
fitted slope of the logits' change at the last step, per optimizer and parametrisation.
Written to --out-dir: coord_check_<optimizer>.png (RMS vs width, one panel per step and
parametrisation) and coord_check.json (every number and the slopes).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as `python scripts/coord_check.py`: the checkout's packages, not an install's

import argparse
import json

import numpy as np

from utils.errors import ConfigError, EqtrainError
from utils.script_errors import script_error

PARAMETRISATIONS = ("sp", "mup")


def build_run(optimizer: str, width: int, mup: bool, base_dim: int, overrides: list[str]):
    """The validated RunConfig of one point, as train_jax.py would build it."""
    from utils.config import compose_overrides, validate

    # no warmup: the steps measured run at the peak lr the hyperparameters name (warmup=N in the overrides wins)
    knobs = [f"optimizer={optimizer}", "optimizer.lr_config.warmup=0", *overrides, f"model.dim={width}",
             f"model.mup={str(mup).lower()}",
             f"model.mup_base_dim={base_dim}", "model.dropout=0.0", "logging.log_callback_data=false"]
    return validate(compose_overrides(knobs, "coord_check"))


def measure(run, steps: int, batch_size: int, seed: int) -> dict[str, list[float]]:
    """{quantity: its value before step 1..steps and after the last (steps + 1 values)}: `logits`,
    `logits_change` (RMS of logits_t − logits_0) and `act/<i>/<kind>` (the model's collect=True RMS)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import models
    import train_jax
    from trainer.activations import KINDS
    from utils.config import resolve_vocab

    run = resolve_vocab(run, run.model.vocab_size or 256)  # null: a 256-token vocabulary (the byte tokenizer's)
    model = train_jax.init_model(run, jax.random.PRNGKey(seed))
    schedule = train_jax.init_scheduler(run)
    tx = train_jax.init_optimizer(run, schedule, models.param_labels(model))
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = tx.init(params)
    T = run.context_length
    tokens_BxT1 = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch_size, T + 1), 0, run.model.vocab_size)

    def loss_fn(params):
        logits_BxTxV = eqx.combine(params, static)(tokens_BxT1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, tokens_BxT1[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def observe(params):
        return eqx.combine(params, static)(tokens_BxT1[:, :-1], collect=True)

    rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a))))
    out: dict[str, list[float]] = {}
    logits0 = None
    for t in range(steps + 1):
        logits, stats = observe(params)
        logits0 = logits if logits0 is None else logits0
        values = {"logits": rms(logits), "logits_change": rms(logits - logits0)}
        values.update({f"act/{i}/{kind}": float(stats[kind][i]) for kind in KINDS
                       for i in range(run.model.num_blocks)})
        for name, v in values.items():
            out.setdefault(name, []).append(v)
        if t < steps:
            params, opt_state = step(params, opt_state)
    return out


def slope(widths, values) -> float:
    """The least-squares slope of log(value) against log(width)."""
    return float(np.polyfit(np.log(widths), np.log(np.maximum(values, 1e-30)), 1)[0])


def check(optimizers: list[str], widths: list[int], steps: int, base_dim: int, overrides: list[str],
          batch_size: int = 8, seed: int = 0) -> dict:
    """{optimizer: {sp|mup: {"rms": {width: measure()}, "slope": the logits_change slope at the last step}}}."""
    if steps < 1 or len(widths) < 2:
        raise ConfigError(f"--steps={steps} and --widths={widths}: a slope needs at least 1 step and 2 widths")
    results: dict = {}
    for opt in optimizers:
        for p in PARAMETRISATIONS:
            per_width = {w: measure(build_run(opt, w, p == "mup", base_dim, overrides), steps, batch_size, seed)
                         for w in widths}
            last = [per_width[w]["logits_change"][-1] for w in widths]
            results.setdefault(opt, {})[p] = {"rms": per_width, "slope": slope(widths, last)}
    return results


def plot(results: dict, widths: list[int], steps: int, out_dir: str) -> list[str]:
    """One PNG per optimizer: rows SP and muP, a column per step, RMS vs width (log-log), a line per quantity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    paths = []
    for opt, by_p in results.items():
        fig, axes = plt.subplots(2, steps + 1, figsize=(3.2 * (steps + 1), 6), squeeze=False, sharey="row")
        for row, p in enumerate(PARAMETRISATIONS):
            per_width = by_p[p]["rms"]
            for t in range(steps + 1):
                ax = axes[row][t]
                for name in per_width[widths[0]]:
                    ys = [per_width[w][name][t] for w in widths]
                    if name == "logits_change" and t == 0:
                        continue  # zero by definition
                    style = dict(lw=2.5, color="k") if name == "logits_change" else dict(lw=0.8, alpha=0.6)
                    ax.loglog(widths, ys, marker="o", ms=3, label=name, **style)
                ax.set_title(f"{p.upper()} t={t}" + (f" (slope {by_p[p]['slope']:.2f})" if t == steps else ""),
                             fontsize=9)
                ax.set_xlabel("width")
                ax.set_xticks(widths, [str(w) for w in widths])
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0][0].set_ylabel("RMS")
        axes[1][0].set_ylabel("RMS")
        axes[0][-1].legend(fontsize=5, loc="best")
        fig.suptitle(f"coord check: {opt} (black: RMS of the logits' change since t=0)")
        fig.tight_layout()
        path = os.path.join(out_dir, f"coord_check_{opt}.png")
        fig.savefig(path, dpi=60)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--widths", nargs="+", type=int, default=[32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--base-dim", type=int, default=32, help="model.mup_base_dim of the muP runs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=os.path.join("outputs", "coord_check"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train_jax.py")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = check(args.optimizers, args.widths, args.steps, args.base_dim, args.overrides, args.batch_size,
                        args.seed)
        os.makedirs(args.out_dir, exist_ok=True)
        paths = plot(results, args.widths, args.steps, args.out_dir)
        with open(os.path.join(args.out_dir, "coord_check.json"), "w") as f:
            json.dump({"widths": args.widths, "steps": args.steps, "base_dim": args.base_dim,
                       "overrides": args.overrides, "results": results}, f, indent=1)
    except (EqtrainError, OSError) as e:
        return script_error(e, hint="check --out-dir and the disk")
    print(f"logits' change after {args.steps} steps, log-log slope vs width {args.widths} (SP: ~1, muP: ~0)")
    for opt, by_p in results.items():
        changes = {p: ", ".join(f"{by_p[p]['rms'][w]['logits_change'][-1]:.3g}" for w in args.widths)
                   for p in PARAMETRISATIONS}
        row = "  ".join(f"{p} {by_p[p]['slope']:+.2f} ({changes[p]})" for p in PARAMETRISATIONS)
        print(f"  {opt:10s} {row}")
    print(f"wrote {', '.join(paths)} and {os.path.join(args.out_dir, 'coord_check.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
