"""`model.mup`: the maximal-update parametrisation (muP, "Tensor Programs V", Yang et al. 2022), so
that hyperparameters tuned at `model.mup_base_dim` carry over to wider models.

With the width multiplier m = dim / mup_base_dim, muP for Adam-type optimizers is (Microsoft's
`mup` package: MuReadout / MuSharedReadout and MuAdam):

    hidden matrices   init std x 1/sqrt(m) (∝ 1/sqrt(fan_in)); Adam lr x 1/m (optimizer/mup.py)
    embeddings        init and lr unchanged
    output logits     x 1/m (MuReadout's output multiplier; tied or untied head alike)
    attention scores  x 1/d_head instead of 1/sqrt(d_head): here sqrt(K_base) / K, K_base the head
                      size at the base width with the same head count, so the factor is SP's there

Every factor is 1 at m = 1: a muP model at its base width is the standard model, the same weights
and the same function; that is where its hyperparameters are tuned. The model reads only the
factors below; the optimizer's side is optimizer/mup.py.
"""

from __future__ import annotations

import math

from utils.errors import ConfigError


def on(cfg) -> bool:
    """Whether the config asks for muP (families and configs without the knob: no)."""
    return bool(getattr(cfg, "mup", False))


def width_ratio(cfg) -> float:
    """base / width = 1/m (1.0 without muP): the factor of the output logits and of Adam's hidden lr."""
    return cfg.mup_base_dim / cfg.dim if on(cfg) else 1.0


def hidden_std(cfg, std: float) -> float:
    """A hidden matrix's init std: `std` at the base width, times 1/sqrt(m) (∝ 1/sqrt(fan_in))."""
    return std * math.sqrt(width_ratio(cfg))


def attention_scale(cfg) -> float | None:
    """The scores' factor under muP, sqrt(K_base)/K: ∝ 1/K (q·k of aligned, correlated q and k
    grows ∝ K once training has moved them), equal to SP's 1/sqrt(K) at the base width (K_base =
    head_dim · base / dim: the width grows by widening each head). None without muP: the kernels'
    own 1/sqrt(K)."""
    if not on(cfg):
        return None
    K = cfg.head_dim
    return math.sqrt(K * width_ratio(cfg)) / K


def check(cfg, prefix: str = "model") -> None:
    """The knobs alone (the family Config's `check`); with init_from at config validation."""
    if not isinstance(cfg.mup_base_dim, int) or cfg.mup_base_dim <= 0:
        raise ConfigError(f"{prefix}.mup_base_dim={cfg.mup_base_dim} must be a positive integer (the width the "
                          f"hyperparameters were tuned at, e.g. 256)")
    if on(cfg) and getattr(cfg, "init_from", None):
        raise ConfigError(f"{prefix}.mup=true with {prefix}.init_from={cfg.init_from}: a pretrained checkpoint is "
                          f"standard-parametrised (its weights, logits and attention scale would change meaning); "
                          f"set {prefix}.mup=false")


def refuse_hf_export(cfg) -> None:
    """A Hugging Face config has no output multiplier or 1/d attention: a muP model's export would
    compute another function; eqtrain's own safetensors format keeps the knobs."""
    if on(cfg) and width_ratio(cfg) != 1.0:
        raise ConfigError(f"model.mup=true (dim={cfg.dim}, mup_base_dim={cfg.mup_base_dim}) cannot be exported in a "
                          "Hugging Face format (no output-logit multiplier or 1/d attention there): export with "
                          "--format safetensors")
