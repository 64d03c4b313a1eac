"""Learning-rate finder: an exponential lr sweep from the run's initial state, for any optimizer.

    python scripts/lr_find.py                                   # adamw, gpt_tiny: the defaults
    python scripts/lr_find.py optimizer=muon
    python scripts/lr_find.py optimizer=adamw model=gpt_tiny lr_find.steps=200 lr_find.min_lr=1e-6 lr_find.max_lr=1

Every argument is a Hydra override exactly as for `train_jax.py` (the same conf/, the same
checks), except the `lr_find.*` ones, which are the finder's own knobs and are taken out before
the config is composed:

    lr_find.min_lr=1e-6      first lr of the sweep (step 0)
    lr_find.max_lr=10        last lr (step steps-1); the lr grows geometrically in between
    lr_find.steps=300        sweep length in optimizer updates (>= 10): ~43 steps per decade by default
    lr_find.smooth=0.2       half-width of the loss smoothing window, in decades of lr (> 0)
    lr_find.stop_factor=4    stop once the loss's EMA (a causal smoothing of the same width) exceeds this
                             multiple of its minimum (> 1), or as soon as the loss is not finite
    lr_find.out_dir=null     where the outputs go; null = outputs/lr_find/<optimizer>-<YYYY-mm-dd_HH-MM-SS>/
                             (beside Hydra's run dirs, so git ignores it too)

"The lr" is the run's base lr, `optimizer.lr_config.lr`: the sweep replaces optimizer.lr_config's
schedule (no warmup, no decay) by lr(s) = min_lr * (max_lr/min_lr)^(s/(steps-1)), and every
parameter group keeps its ratio to it, as in training (Muon's AdamW groups run at
adam_lr/lr times the sweep; `optimizer.groups.<g>.lr` overrides likewise). Everything else is the
run's: model init, data order (random_seed), batch and accumulation, clipping, weight decay,
dtypes, mesh. No evaluation, no checkpoint, no sampling; the step's loss is pulled every step
(one step behind the dispatch, so the device never waits on the host), and the aux-state
diagnostics are switched off (`logging.log_callback_data=false` unless given).

The suggestion (rule "min/10"): the lr at the minimum of the smoothed loss, divided by 10 (Smith's
LR range test as fastai reports it, its `lr_min`). Why: the minimum is the best-defined point of
the curve, the largest lr at which the loss still falls while the lr keeps rising, so the edge of
stability over a few steps; a decade below that edge is a peak lr that holds over a full run with
warmup and decay. The other common rule, the steepest descent (most negative d loss / d log lr),
reads a derivative, which a long shallow descent leaves poorly determined (SGDM's on gpt_tiny
spans three decades, and there the two rules differ by 7x), and it marks where the loss fell
fastest at that point of the sweep, which depends on the lrs before it as much as on the lr. It
is printed and saved as a secondary figure (left of the minimum). On AdamW and Muon the two
agree within 1.3x (docs/optimizers.md, "Finding a learning rate"). Neither is exact: short small-batch sweeps
move either by up to ~6x between seeds (60 steps, batch 8, context 64: min/10 from 5.2e-4 to
3.0e-3 over three seeds).

The smoothed curve both rules read is centred (no lag): at each step, a straight line fitted
to the losses within +-smooth decades (tricube weights, i.e. LOWESS without robustness passes).
An EMA, the usual choice, trails the loss by beta/(1-beta) steps, which moves the minimum to
the right, and its long tail drags the blow-up at the end of the sweep into the minimum; a
finite, centred window does neither. The early stop has to be causal: it uses an EMA whose mean
lag is the same half-width (beta = h/(h+1) for a half-width of h steps).

Outputs, in the output folder: lr_find.png (loss vs lr, log x axis: raw and smoothed loss, the
suggestion, the steepest point and the yaml lr marked), lr_find.csv (step, lr, loss, smoothed),
summary.json (knobs, overrides, the suggestion and its rule, the secondary figure, why the sweep
stopped, the yaml lr). A bad knob (finder's or run's) exits 2 with one line, before anything
compiles.
"""

from __future__ import annotations

import os
import sys

# Run as `python scripts/lr_find.py`, Python puts scripts/ on sys.path, not the repo root;
# the editable install would find the packages, but only those of the checkout it was made from.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import csv
import dataclasses
import datetime
import json
import math
import textwrap
import time
from dataclasses import dataclass

import numpy as np

from utils.cli import script_argv
from utils.errors import ConfigError, EqtrainError, TrainingError
from utils.script_errors import script_error

PREFIX = "lr_find."
RULE = "min/10: the lr at the minimum of the smoothed loss, divided by 10"


@dataclass(frozen=True)
class LRFindConfig:
    min_lr: float = 1e-6
    max_lr: float = 10.0
    steps: int = 300
    smooth: float = 0.2
    stop_factor: float = 4.0
    out_dir: str | None = None

    def check(self, prefix: str) -> None:
        if not (math.isfinite(self.min_lr) and self.min_lr > 0):
            raise ConfigError(f"{prefix}.min_lr={self.min_lr} must be a positive number")
        if not (math.isfinite(self.max_lr) and self.max_lr > self.min_lr):
            raise ConfigError(f"{prefix}.min_lr={self.min_lr} must be below {prefix}.max_lr={self.max_lr}")
        if self.steps < 10:
            raise ConfigError(f"{prefix}.steps={self.steps} must be >= 10 (a few hundred resolve the curve)")
        if not (math.isfinite(self.smooth) and self.smooth > 0):
            raise ConfigError(f"{prefix}.smooth={self.smooth} must be a positive number of decades (e.g. 0.2)")
        if not self.stop_factor > 1.0:
            raise ConfigError(f"{prefix}.stop_factor={self.stop_factor} must be > 1")

    @property
    def half_width(self) -> int:
        """The smoothing window's half-width in steps (at least 1)."""
        per_decade = (self.steps - 1) / math.log10(self.max_lr / self.min_lr)
        return max(1, round(self.smooth * per_decade))

    def lrs(self) -> np.ndarray:
        """The sweep's lr at every step, as the schedule computes it."""
        return self.min_lr * (self.max_lr / self.min_lr) ** (np.arange(self.steps) / (self.steps - 1))


def sweep_schedule(knobs: LRFindConfig):
    """optax schedule: min_lr at step 0, max_lr at step steps-1, geometric in between (held after)."""
    import jax.numpy as jnp

    log_ratio, last = math.log(knobs.max_lr / knobs.min_lr), knobs.steps - 1

    def schedule(step):
        s = jnp.clip(jnp.asarray(step, jnp.float32), 0.0, last)
        return knobs.min_lr * jnp.exp(log_ratio * s / last)

    return schedule


# --- the command line -------------------------------------------------------------------------


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """(the lr_find.* knobs as a {knob: value} mapping, Hydra's overrides). Values are parsed as
    Hydra parses override values, so `1e-6`, `null` and quoting mean what they mean there."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    ours = [a for a in argv if a.startswith(PREFIX)]
    theirs = [a for a in argv if not a.startswith(PREFIX)]
    for a in theirs:
        if a.startswith("-"):
            raise ConfigError(f"{a}: lr_find.py takes Hydra overrides and lr_find.* knobs only (no flags, no "
                              "multirun); see `python scripts/lr_find.py --help`")
    node: dict = {}
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
    except OverrideParseException as e:  # a malformed value
        raise ConfigError(f"cannot parse {' '.join(ours)}: {str(e).splitlines()[0]}") from None
    for arg, o in zip(ours, parsed):
        key = o.key_or_group[len(PREFIX):]
        if not key or "." in key or o.is_delete():
            raise ConfigError(f"{arg}: expected lr_find.<knob>=<value>")
        node[key] = o.value()
    return node, theirs


def compose_run(overrides: list[str]):
    """conf/ composed with the overrides and validated, as train_jax.py does it; the aux-state
    diagnostics off unless the command line sets them."""
    from omegaconf import open_dict

    from utils.config import compose_overrides, validate

    cfg = compose_overrides(overrides, "lr_find")
    if "log_callback_data" in cfg.logging and not any(o.lstrip("+~").startswith("logging.log_callback_data")
                                                      for o in overrides):
        with open_dict(cfg):
            cfg.logging.log_callback_data = False
    run = validate(cfg)
    ck = run.checkpoint
    if ck.load or ck.resume:
        raise ConfigError("checkpoint.load/checkpoint.resume: the LR finder sweeps from the run's initial state; "
                          "drop them")
    return run


def default_out_dir(optimizer: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return os.path.join("outputs", "lr_find", f"{optimizer}-{stamp}")


# --- the sweep --------------------------------------------------------------------------------


def local_linear(values: np.ndarray, half_width: int) -> np.ndarray:
    """Centred smoothing without lag: at each step, the value at that step of a straight line
    fitted by weighted least squares to the steps within +-half_width (tricube weights; LOWESS
    without its robustness passes). A line, not a mean, so the ends of the sweep follow the
    trend instead of bending towards the middle; a finite window, so the blow-up at the end of a
    sweep does not leak into the minimum (an EMA's exponential tail would)."""
    y = np.asarray(values, dtype=np.float64)
    n, h = len(y), max(int(half_width), 1)
    out = np.empty(n)
    for i in range(n):
        lo, hi = max(0, i - h), min(n, i + h + 1)
        d = (np.arange(lo, hi) - i) / (h + 1)
        w = (1 - np.abs(d) ** 3) ** 3
        x, yy = d, y[lo:hi]
        sw, swx, swxx = w.sum(), (w * x).sum(), (w * x * x).sum()
        swy, swxy = (w * yy).sum(), (w * x * yy).sum()
        det = sw * swxx - swx * swx
        out[i] = swy / sw if det <= 1e-12 * sw * sw else (swxx * swy - swx * swxy) / det  # the line at x=0
    return out


def sweep(trainer, knobs: LRFindConfig, report=print) -> tuple[list[float], str]:
    """Train from trainer.state for up to knobs.steps updates; (each step's loss, why it stopped)."""
    import jax

    from utils.parallel import mesh as meshlib

    sharding = meshlib.batch_sharding(trainer.mesh, 1)
    lrs, state, logging_step = knobs.lrs(), trainer.state, False
    losses: list[float] = []
    beta = knobs.half_width / (knobs.half_width + 1)
    avg, best, reason = 0.0, math.inf, f"reached max_lr={knobs.max_lr:g}"
    pending = None
    every = max(knobs.steps // 10, 1)

    def record(loss_value) -> str | None:
        nonlocal avg, best
        loss = float(loss_value)
        step = len(losses)
        losses.append(loss)
        if not math.isfinite(loss):
            return f"the loss became {loss} at lr {lrs[step]:.3g} (step {step})"
        avg = beta * avg + (1 - beta) * loss
        smooth = avg / (1 - beta ** (step + 1))  # bias-corrected: the first steps are not pulled towards 0
        best = min(best, smooth)
        if step % every == 0:
            report(f"step {step:4d}/{knobs.steps}  lr {lrs[step]:.3e}  loss {loss:.4f}  ema {smooth:.4f}")
        if smooth > knobs.stop_factor * best:
            return (f"the loss's EMA {smooth:.3f} exceeded {knobs.stop_factor:g} x its minimum {best:.3f} at lr "
                    f"{lrs[step]:.3g} (step {step})")
        return None

    for step in range(knobs.steps):
        batch = meshlib.put_batch(next(trainer.data.train), sharding)
        if step == 0:  # the plain variant (cheapest) unless it leaves the loss to logging steps; traced, not run
            plain = jax.eval_shape(lambda s, b: trainer.train_step(s, b, False)[1], state, batch)
            logging_step = "train/loss" not in plain
        state, metrics = trainer.train_step(state, batch, logging_step)
        if pending is not None:  # the previous step's loss, pulled while this one runs
            stop = record(pending)
            if stop:
                return losses, stop
        pending = metrics["train/loss"]
    stop = record(pending)
    return losses, stop or reason


def suggest(lrs: np.ndarray, losses: np.ndarray, half_width: int) -> dict:
    """Both rules on the finite prefix of the sweep."""
    finite = np.isfinite(losses)
    n = len(losses) if finite.all() else int(np.argmin(finite))
    if n < 5:
        raise TrainingError(f"the loss was not finite from step {n} on (lr {lrs[n]:.3g}): lower lr_find.min_lr")
    smooth = local_linear(losses[:n], half_width)
    i_min = int(np.argmin(smooth))
    slope = np.gradient(smooth, np.log10(lrs[:n]))  # loss per decade
    i_steep = int(np.argmin(slope[: i_min + 1]))
    notes = []
    if i_min >= n - 1 and n == len(lrs):
        notes.append("the smoothed loss was still falling at max_lr: raise lr_find.max_lr")
    if i_min < max(n // 20, 2):
        notes.append("the smoothed loss is lowest at the start of the sweep: lower lr_find.min_lr")
    return {"suggested_lr": float(lrs[i_min] / 10), "rule": RULE, "min_loss_lr": float(lrs[i_min]),
            "min_smoothed_loss": float(smooth[i_min]), "steepest_lr": float(lrs[i_steep]),
            "steepest_slope_per_decade": float(slope[i_steep]), "notes": notes, "smoothed": smooth}


def plot(path: str, lrs, losses, smooth, result: dict, yaml_lr: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(losses)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(lrs[:n], losses, color="0.7", lw=0.8, label="loss (each step)")
    ax.plot(lrs[: len(smooth)], smooth, color="C0", lw=2, label="smoothed")
    ax.axvline(result["suggested_lr"], color="C3", ls="--",
               label=f"suggested {result['suggested_lr']:.2e} (min/10)")
    ax.axvline(result["min_loss_lr"], color="C3", ls=":", lw=1, label=f"min of smoothed {result['min_loss_lr']:.2e}")
    ax.axvline(result["steepest_lr"], color="C2", ls="-.", lw=1, label=f"steepest {result['steepest_lr']:.2e}")
    ax.axvline(yaml_lr, color="k", ls=":", lw=1, label=f"yaml lr {yaml_lr:.2e}")
    ax.set_xscale("log")
    ax.set_xlabel("lr (optimizer.lr_config.lr; groups keep their ratios)")
    ax.set_ylabel("train loss (nats/token)")
    finite = np.asarray(losses)[np.isfinite(losses)]
    top = min(float(finite.max()), 2.0 * float(smooth[0]) - float(np.min(smooth)) + 0.5) if len(finite) else 1.0
    ax.set_ylim(float(np.min(finite)) - 0.1 if len(finite) else 0.0, top)
    ax.set_title(textwrap.fill(title, 110), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def group_lrs_at(run, lr: float) -> dict[str, float]:
    """Each group's lr when the base lr is `lr` (the ratios the sweep kept), for the groups the model has."""
    import jax

    import models
    from optimizer.groups import group_lr

    o = run.optimizer
    present = sorted(set(jax.tree.leaves(models.param_labels(models.abstract(run.model)))))
    return {g: lr * group_lr(o.hparams, g, o.schedule.lr, o.group_overrides) / o.schedule.lr for g in present}


def find(knobs: LRFindConfig, run, overrides: list[str]) -> dict:
    import jax

    import train_jax
    from models import count_params

    t0 = time.perf_counter()
    trainer = train_jax.build_trainer(run, schedule=sweep_schedule(knobs))
    run = trainer.run
    out_dir = knobs.out_dir or default_out_dir(run.optimizer.name)
    os.makedirs(out_dir, exist_ok=True)
    yaml_lr = run.optimizer.schedule.lr
    print(f"lr_find: {count_params(trainer.state.model) / 1e6:.2f}M params | {run.optimizer.name} | "
          f"{trainer.data.tokens_per_step:,} tokens/step | {len(jax.devices())} {jax.devices()[0].platform} "
          f"device(s) | lr {knobs.min_lr:g} -> {knobs.max_lr:g} over {knobs.steps} steps | out {out_dir}", flush=True)
    for warning in run.warnings:
        if "outlasts" not in warning:  # the yaml schedule's warmup warnings: that schedule is not used
            print(f"warning: {warning}", flush=True)
    losses, reason = sweep(trainer, knobs)
    seconds = time.perf_counter() - t0
    lrs, loss_arr = knobs.lrs(), np.asarray(losses, dtype=np.float64)
    result = suggest(lrs, loss_arr, knobs.half_width)
    smooth = result.pop("smoothed")

    groups = group_lrs_at(run, result["suggested_lr"])
    apply = [f"optimizer.lr_config.lr={result['suggested_lr']:.3g}"] + [
        f"optimizer.groups.{g}.lr={v:.3g}" for g, v in groups.items()
        if not math.isclose(v, result["suggested_lr"], rel_tol=1e-6)]
    summary = {
        "optimizer": run.optimizer.name, "overrides": overrides, "knobs": dataclasses.asdict(knobs),
        "out_dir": out_dir, "steps_run": len(losses), "stopped": reason, "seconds": round(seconds, 1),
        "yaml_lr": yaml_lr, **result, "group_lrs_at_suggestion": groups, "apply": " ".join(apply),
    }
    if jax.process_index() == 0:  # one writer when several processes share the sweep
        with open(os.path.join(out_dir, "lr_find.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "lr", "loss", "smoothed"])
            for i, loss in enumerate(losses):
                w.writerow([i, f"{lrs[i]:.6e}", f"{loss:.6f}", f"{smooth[i]:.6f}" if i < len(smooth) else ""])
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        title = (f"{run.optimizer.name}, {' '.join(overrides) or 'defaults'}: {len(losses)}/{knobs.steps} steps, "
                 f"{trainer.data.tokens_per_step:,} tokens/step")
        plot(os.path.join(out_dir, "lr_find.png"), lrs, losses, smooth, result, yaml_lr, title)

    print(f"stopped: {reason} ({len(losses)} steps, {seconds:.0f} s)")
    for note in result["notes"]:
        print(f"warning: {note}")
    print(f"suggested lr: {result['suggested_lr']:.3g}  (rule {RULE}: {result['min_loss_lr']:.3g} / 10)")
    print(f"steepest descent of the smoothed loss: lr {result['steepest_lr']:.3g}  "
          f"({result['steepest_slope_per_decade']:.3f} nats per decade)  [secondary]")
    print(f"yaml lr: optimizer.lr_config.lr={yaml_lr:g}  (suggestion / yaml = {result['suggested_lr'] / yaml_lr:.2g})")
    print(f"to train with it: python train_jax.py {' '.join([*overrides, *apply])}")
    print(f"wrote {out_dir}/lr_find.png, lr_find.csv, summary.json", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = script_argv(argv, __doc__)
    if argv is None:
        return 0
    from utils.sections import build_section

    try:
        node, overrides = split_argv(argv)
        knobs = build_section(LRFindConfig, node, PREFIX[:-1])
        if knobs.out_dir is not None:
            from utils.files import user_path

            knobs = dataclasses.replace(knobs, out_dir=user_path(knobs.out_dir))
        run = compose_run(overrides)
        find(knobs, run, overrides)
    except (EqtrainError, OSError) as e:  # OSError: a file of lr_find.out_dir it could not write
        return script_error(e, hint="check lr_find.out_dir and the disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
