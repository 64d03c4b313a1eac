"""muP's optimizer side (model.mup; the model's side is models/mup.py): the `hidden` group's peak lr
times (base / width)^p, p the optimizer's `MUP_HIDDEN_LR_POWER`:

    1    Adam-type (entrywise-normalised) updates: each entry of an update is Θ(lr) whatever the
         width, so a fan_in-wide matmul sums fan_in aligned terms; lr ∝ 1/fan_in keeps the
         activation change Θ(1) (MuAdam's rule). AdamW, NAdamW, ADOPT, AdEMAMix, Schedule-Free
         AdamW, MARS, Lion (sign updates), Adafactor without parameter scaling.
    0    updates already spectrally scaled: an orthogonalised update has spectral norm Θ(lr), and
         Muon's `reference` factor √max(1, fan_out/fan_in) is a constant for a fixed aspect ratio:
         the spectral condition (Yang, Simon & Bernstein 2023) ‖ΔW‖* ∝ √(fan_out/fan_in) already
         holds at one lr for every width (Muon, NorMuon with shape_scale=reference; Scion, whose
         Spectral LMO is sized √(fan_out/fan_in) without the max).
    1/2  Muon/NorMuon with shape_scale=adam_rms: its factor 0.2·√max(fan_in, fan_out) grows ∝ √width.

Embeddings, the head (its logits carry the 1/m multiplier instead: MuReadout) and scalars keep
their lr. An optimizer without the attribute (SGD-momentum, Shampoo, SOAP, Kron, Prodigy: no rule
for their group structure here) and `optimizer.hyperball` (relative steps) get no scaling, and the
run's header says so. Weight decay is decoupled but times the lr here, so the hidden group's decay
is divided by the same factor: lr·weight_decay, the decay per step, stays what was tuned (MuAdamW
with the torch AdamW convention does the same).
"""

from __future__ import annotations

from typing import Any


def hidden_lr_power(hparams: Any) -> float | None:
    """The optimizer's exponent p (None: no known muP rule)."""
    return hparams.MUP_HIDDEN_LR_POWER


def lr_scales(hparams: Any, opt_name: str, width_ratio: float, dim: int, base_dim: int,
              hyperball: bool = False) -> tuple[dict[str, float], str, bool]:
    """({group: lr factor}, the header's line, whether that line is a warning) for a muP run of
    width `dim` over `base_dim` (width_ratio = base_dim / dim)."""
    power = None if hyperball else hidden_lr_power(hparams)
    m = f"width multiplier m = {dim}/{base_dim} = {dim / base_dim:g}"
    if power is None:
        why = "optimizer.hyperball=true (relative steps)" if hyperball else f"optimizer={opt_name}"
        return {}, (f"model.mup=true: {why} has no known muP lr rule; every group keeps its lr ({m}; the model's "
                    "init, logit and attention factors still apply): hyperparameters may not transfer"), True
    if power == 0:
        return {}, (f"model.mup=true: {m}; optimizer={opt_name}'s hidden update is spectrally scaled: "
                    "lr unchanged"), False
    factor = width_ratio ** power
    return {"hidden": factor}, (f"model.mup=true: {m}; hidden lr x {factor:.4g} (1/m^{power:g}), hidden weight "
                                f"decay x {1 / factor:.4g}; embed, head, scalar lr unchanged; logits x 1/m"), False
