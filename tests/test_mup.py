"""model.mup (models/mup.py, optimizer/mup.py): each factor against an independent float64
re-derivation, the base width being the standard model exactly, the config's refusals and header
lines, and the coordinate check (scripts/coord_check.py) telling muP from SP by its slope."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EPS32, compose_config, load_script, rounding_rtol, sum_atol

import models
from models import gpt, llama
from models import mup as mup_model
from models.layers import causal_attention
from optimizer import OPTIMIZERS, make_optimizer
from optimizer import mup as mup_optim
from utils.config import validate
from utils.errors import ConfigError

TINY = dict(num_heads=2, num_blocks=2, context_length=8, vocab_size=64)


def _gpt(dim, mup, base=16, **kw):
    return gpt.GPTConfig(dim=dim, mup=mup, mup_base_dim=base, **{**TINY, **kw})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_mup_at_its_base_width_is_the_standard_model(family):
    """Every factor is 1 at m = 1: the same weights and, bit for bit, the same logits."""
    cls = gpt.GPTConfig if family == "gpt" else llama.LlamaConfig
    cfgs = [cls(dim=32, mup=m, mup_base_dim=32, **TINY) for m in (False, True)]
    built = [models.build(c, jax.random.PRNGKey(0)) for c in cfgs]
    arrays = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in built]
    for a, b in zip(*arrays):
        np.testing.assert_array_equal(a, b)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 64)
    np.testing.assert_array_equal(built[0](tokens), built[1](tokens))


def test_mup_hidden_init_is_sp_times_inverse_sqrt_m_and_embeddings_unchanged():
    """m = 64/16 = 4: the same random draws, hidden matrices x 1/sqrt(4) = 0.5, embeddings and gains as SP."""
    sp, mu = (models.build(_gpt(64, m), jax.random.PRNGKey(0)) for m in (False, True))
    labels = models.param_labels(sp)
    for lab, a, b in zip(jax.tree.leaves(labels), jax.tree.leaves(eqx.filter(sp, eqx.is_array)),
                         jax.tree.leaves(eqx.filter(mu, eqx.is_array))):
        want = np.asarray(a, np.float64) * (0.5 if lab == "hidden" else 1.0)
        # 0.02·x and 0.01·x from the same float32 normal draw x: one rounding each side (rtol 2 roundings)
        np.testing.assert_allclose(b, want, rtol=rounding_rtol(2), atol=0)


def test_mup_logits_are_sp_logits_over_m():
    """With one token the attention is its own value (softmax over one key): the attention scale drops
    out, and a muP model given the SP model's weights computes SP's logits times base/width."""
    sp = models.build(_gpt(64, False), jax.random.PRNGKey(0))
    mu_built = models.build(_gpt(64, True), jax.random.PRNGKey(0))
    mu = jax.tree.unflatten(jax.tree.structure(mu_built), jax.tree.leaves(sp))  # SP's arrays, the muP config
    tokens = jnp.array([[3], [7]])
    want = np.asarray(sp(tokens), np.float64) / 4.0  # m = 64/16
    # one more float32 rounding (the multiply by 0.25, exact in binary): rtol 1 rounding, margin 2
    np.testing.assert_allclose(mu(tokens), want, rtol=rounding_rtol(1), atol=0)


def test_attention_scale_is_one_over_head_dim_against_numpy():
    """muP scores x sqrt(K_base)/K; at K = 16, K_base = 4 (m = 4): 2/16 = 1/8, against a float64 softmax attention."""
    cfg = _gpt(64, True, num_heads=4)  # K = 16, base 16 -> K_base = 4
    scale = mup_model.attention_scale(cfg)
    assert scale == pytest.approx(math.sqrt(4) / 16, rel=1e-15)  # a float64 Python computation
    assert mup_model.attention_scale(_gpt(64, False)) is None  # SP: the kernel's own 1/sqrt(K)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, 5, 16)) for i in range(3))
    out = causal_attention(q, k, v, scale=scale)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bhtk,bhsk->bhts", q64, k64) * scale
    s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p @ v64
    # the scores are K = 16-term float32 dot products, the output a 5-term sum of probabilities x values
    # (|v| <= max|v|): sum_atol over 16 + 5 terms at the values' scale, margin 4 (the exp's and the softmax's roundings)
    np.testing.assert_allclose(out, want, rtol=0, atol=sum_atol(21, float(np.abs(v64).max()) * 5, margin=4))


def test_lr_rules_per_optimizer():
    """Adam-type: hidden lr x 1/m; Muon reference: spectral already (no factor); adam_rms x m^-1/2;
    no rule (sgdm, hyperball): none, as a warning."""
    r = 0.25
    assert mup_optim.lr_scales(OPTIMIZERS["adamw"](), "adamw", r, 64, 16)[:1] == ({"hidden": 0.25},)
    assert mup_optim.lr_scales(OPTIMIZERS["lion"](), "lion", r, 64, 16)[0] == {"hidden": 0.25}
    assert mup_optim.lr_scales(OPTIMIZERS["muon"](), "muon", r, 64, 16)[0] == {}
    assert mup_optim.lr_scales(OPTIMIZERS["scion"](), "scion", r, 64, 16)[0] == {}  # Spectral LMO: width-invariant
    assert mup_optim.lr_scales(OPTIMIZERS["muon"](shape_scale="adam_rms"), "muon", r, 64, 16)[0] == {"hidden": 0.5}
    scales, line, warning = mup_optim.lr_scales(OPTIMIZERS["sgdm"](), "sgdm", r, 64, 16)
    assert (scales, warning) == ({}, True) and "optimizer=sgdm has no known muP lr rule" in line
    assert mup_optim.lr_scales(OPTIMIZERS["adamw"](), "adamw", r, 64, 16, hyperball=True)[:3:2] == ({}, True)


def test_adamw_first_update_scales_hidden_lr_and_keeps_decay_per_step():
    """One AdamW update with lr_scales {"hidden": 1/4} against its float64 form: the first Adam step is
    -lr·(g/(|g| + eps) + wd·p); muP's hidden group: -(lr/4)·g/(|g|+eps) - lr·wd·p (decay per step unchanged)."""
    lr, wd, eps = 1e-2, 0.1, 1e-8
    p = {"h": jnp.full((3, 4), 0.5), "e": jnp.full((5, 4), 0.5)}
    g = {"h": jnp.linspace(-1, 1, 12).reshape(3, 4) + 0.05, "e": jnp.linspace(-2, 1, 20).reshape(5, 4) + 0.01}
    labels = {"h": "hidden", "e": "embed"}
    hp = OPTIMIZERS["adamw"](weight_decay=wd, eps=eps)
    tx = make_optimizer(hp, lambda step: lr, labels, None, lr, {}, lr_scales={"hidden": 0.25})
    u, _ = tx.update(g, tx.init(p), p)
    g64 = {k: np.asarray(v, np.float64) for k, v in g.items()}
    want_h = -(lr * 0.25) * g64["h"] / (np.abs(g64["h"]) + eps) - lr * wd * 0.5
    want_e = -lr * g64["e"] / (np.abs(g64["e"]) + eps)  # embeddings: no decay by default, lr unchanged
    # a handful of float32 operations per entry (moments, bias corrections, sqrt, divide, decay, lr): 8 roundings
    np.testing.assert_allclose(u["h"], want_h, rtol=rounding_rtol(8), atol=lr * EPS32)
    np.testing.assert_allclose(u["e"], want_e, rtol=rounding_rtol(8), atol=lr * EPS32)


def test_config_sets_lr_scales_and_says_so_in_the_header():
    run = validate(compose_config("model.mup=true", "model.mup_base_dim=16"))  # tiny dim 32: m = 2
    assert run.optimizer.lr_scales == {"hidden": 0.5}
    assert any(n.startswith("model.mup=true: width multiplier m = 32/16 = 2") for n in run.notes)
    assert validate(compose_config()).optimizer.lr_scales == {}
    run = validate(compose_config("model.mup=true", "model.mup_base_dim=16", "optimizer=sgdm"))
    assert run.optimizer.lr_scales == {} and any("no known muP lr rule" in w for w in run.warnings)


def test_config_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"model.mup=true with model.init_from=.*set model.mup=false") as e:
        models.config_from_dict(dict(name="gpt", dim=32, num_heads=2, num_blocks=1, context_length=8,
                                     mup=True, init_from="/some/hf/dir"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"model.mup_base_dim=0 must be a positive integer"):
        models.config_from_dict(dict(name="llama", dim=32, num_heads=2, num_blocks=1, context_length=8,
                                     mup=True, mup_base_dim=0))
    with pytest.raises(ConfigError, match="cannot be exported in a Hugging Face format"):
        gpt.hf_config(_gpt(64, True))
    gpt.hf_config(_gpt(16, True))  # at the base width it is the standard model: exportable


@pytest.mark.slow  # six tiny trainings' compilations: ~40 s on a shared 2-core machine
def test_coord_check_tells_mup_from_sp_by_the_slope(tmp_path):
    """The logits' change after 2 AdamW steps vs width (8, 16, 32). Theory: under SP each of the width's
    aligned Θ(lr) entry changes adds up, the change ∝ width (log-log slope 1); under muP the 1/m hidden
    lr and 1/m logit multiplier make it width-independent (slope 0; at these small widths finite-width
    terms ∝ 1/sqrt(width) pull it below 0: docs/models.md "muP"). The threshold is halfway between the
    predictions, 0.5."""
    coord = load_script("coord_check")
    results = coord.check(["adamw"], [8, 16, 32], 2, 8, ["model.num_blocks=2", "model.num_heads=2",
                                                         "model.context_length=16", "model.vocab_size=64"])
    sp, mu = results["adamw"]["sp"]["slope"], results["adamw"]["mup"]["slope"]
    assert sp > 0.5 > mu, (sp, mu)
    paths = coord.plot(results, [8, 16, 32], 2, str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["coord_check_adamw.png"]
    assert (tmp_path / "coord_check_adamw.png").stat().st_size > 0


# The lr transfer test's ladder (scripts/mup_transfer.py): widths 32, 64, 128 (base 32), 2 blocks of 2
# heads, context 16, a 64-token Markov chain, 40 AdamW steps of batch 16 at the peak lr, a log2 grid.
TRANSFER = ["model.num_blocks=2", "model.num_heads=2", "model.context_length=16", "model.vocab_size=64",
            "optimizer.lr_config.warmup=0"]


@pytest.mark.slow  # five vmapped tiny trainings' compilations (each trains the whole lr grid): ~2 min on 2 shared cores
def test_adamw_best_lr_transfers_across_width_under_mup_and_moves_under_sp():
    """The issue's done-when for AdamW. Theory: under SP an Adam step moves each entry of a width-n matrix
    by ~lr and a width-n matmul adds n aligned such changes, so the best lr ∝ 1/width: one log2 grid step
    down per doubling, 2 steps over 32 → 128; under muP (hidden lr × base/width, logits × base/width) it
    stays put. Asserted: muP's best moves less than one grid step, SP's at least one, downward."""
    script = load_script("mup_transfer")
    widths = [32, 64, 128]
    results = script.sweep(["adamw"], widths, [-1, 0, 1, 2, 3, 4], 40, 32, TRANSFER)["adamw"]
    sp, mu = results["sp"], results["mup"]
    table = script.table({"adamw": results}, widths)
    assert all(-1 < best < 4 for r in (sp, mu) for best in r["best"].values()), table  # inside the grid, not at an edge
    assert mu["shift"] < 1, table
    assert sp["shift"] >= 1 and sp["best"][128] < sp["best"][32], table


@pytest.mark.slow  # five vmapped tiny Muon trainings' compilations: ~4 min on 2 shared cores
def test_muon_best_hidden_lr_transfers_under_sp_and_mup_alike():
    """Muon's hidden update is orthogonalised, spectral norm ~lr times a shape constant: width-invariant
    without muP, so its muP rule leaves the hidden lr alone (optimizer/mup.py, power 0) and theory predicts
    the best hidden lr (adam_lr fixed) transfers under both parametrisations: each moves less than one grid
    step (docs/models.md says why the issue's "moves more without" does not apply to Muon)."""
    script = load_script("mup_transfer")
    widths = [32, 64, 128]
    results = script.sweep(["muon"], widths, [-1, 0, 1, 2], 40, 32, TRANSFER, lr_knobs=())["muon"]
    table = script.table({"muon": results}, widths)
    assert all(-1 < best < 2 for r in results.values() for best in r["best"].values()), table  # not at an edge
    assert results["mup"]["shift"] < 1 and results["sp"]["shift"] < 1, table
