"""objective=mdlm (masked diffusion): the masking rate and the 1/t weighting against NumPy,
bidirectional attention (and AR's causal one untouched), the chat loss mask, deterministic
validation, iterative unmasking, the one-line errors; and (slow) a tiny run that lowers its val
bound, resumes bit-identically, and whose checkpoint samples and exports with its objective."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compose_config, load_script, logits_atol, sum_atol

import train_jax
from loaders.windows import WindowDataset
from models import mdlm
from models import sample as sampling
from models.objectives import AR, MDLM
from utils.config import compose_overrides, resolve_vocab, to_dict, validate
from utils.errors import ConfigError

V = 64  # the tiny run's vocabulary: the mask id is 63, so test tokens stay below it
MASK = V - 1


@pytest.fixture(scope="module")
def model():
    """The tiny GPT (dim 32, 2 blocks, context 16, vocab 64) at its random init."""
    run = validate(compose_config("objective=mdlm"))
    return eqx.filter_jit(lambda key: train_jax.init_model(run, key))(jax.random.PRNGKey(0))


def tokens(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MASK, shape).astype(np.int32)


# ----------------------------------------------------------------------------- the corruption and the loss


def test_masking_rate_is_t_per_row_with_t_uniform_on_eps_1():
    """Per row, the fraction of tokens masked is t (binomial: within 5 standard deviations
    sqrt(t(1-t)/T)), t lies in [eps, 1) with the mean of U(eps, 1) (within 5 sd of a mean of B
    uniforms), and z is x with exactly the masked tokens replaced (NumPy on the returned arrays)."""
    B, T, eps = 512, 1024, 0.05
    x_BxT = tokens((B, T))
    keys_B = jax.random.split(jax.random.PRNGKey(1), B)
    z, masked, t = (np.asarray(a) for a in jax.jit(mdlm.corrupt, static_argnums=(3, 4))(
        keys_B, jnp.asarray(x_BxT), jnp.ones((B, T), jnp.float32), eps, MASK))
    assert t.min() >= eps and t.max() < 1.0
    assert abs(t.mean() - (1 + eps) / 2) < 5 * (1 - eps) / math.sqrt(12 * B)
    frac = masked.mean(axis=1)
    assert np.all(np.abs(frac - t) <= 5 * np.sqrt(t * (1 - t) / T) + 1 / T)
    np.testing.assert_array_equal(z, np.where(masked, MASK, x_BxT))
    np.testing.assert_array_equal(masked, z == MASK)  # x never holds the mask id


def test_zero_weight_tokens_are_never_masked():
    B, T = 64, 256
    w_BxT = (np.random.default_rng(2).random((B, T)) < 0.3).astype(np.float32)
    _, masked, _ = mdlm.corrupt(jax.random.split(jax.random.PRNGKey(3), B), jnp.asarray(tokens((B, T))),
                                jnp.asarray(w_BxT), 1e-3, MASK)
    masked = np.asarray(masked)
    assert masked.any() and not masked[w_BxT == 0].any()


def numpy_nelbo(model, batch_BxT1: np.ndarray, keys_B, eps: float) -> tuple[float, np.ndarray, np.ndarray]:
    """The loss recomputed in float64 NumPy from the masks `corrupt` draws and the bidirectional
    logits of the corrupted tokens: Σ_masked -log p(x)/t over the B·T tokens, p over every id but the
    mask; with the float32 logits of the real ids and the weights masked/t (for the tolerance)."""
    x = batch_BxT1[:, 1:]
    z, masked, t = (np.asarray(a) for a in mdlm.corrupt(keys_B, jnp.asarray(x), jnp.ones(x.shape), eps, MASK))
    logits32 = np.asarray(model(jnp.asarray(z), causal=False))[..., :MASK]
    logits = logits32.astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, x[..., None], axis=-1)[..., 0]
    weights = masked / t[:, None].astype(np.float64)
    return float((weights * nll).sum() / x.size), logits32, weights


def nelbo_sum_atol(cfg, logits, weights, value: float, margin: float = 4) -> float:
    """atol of Σ weights·nll (`value`; nll = logsumexp − logit_target over the real ids, `logits`
    one side's) computed in two float32 programs: a token's nll moves by its two logits' error
    (2·logits_atol) plus its logsumexp's own rounding, m + log Σ exp(l − m): V − 1 exps of at most 1
    summed (relative V·u, absolute after the log) and the log, the add and the subtraction
    (u·max(1, |value|) each): sum_atol(V + 2, max(1, max|logsumexp|)), times Σ weights; the sum of
    the nonnegative terms (B·T of them) adds sum_atol(B·T, value), plus 3 roundings of each term's
    weight (t = eps + (1 − eps)·u, 1/t, the product). Margin 4: two sides, times 2."""
    l64 = np.asarray(logits, np.float64)
    m = l64.max(-1, keepdims=True)
    lse = float(np.abs(m + np.log(np.exp(l64 - m).sum(-1, keepdims=True))).max())
    nll = 2 * logits_atol(cfg, logits, margin) + sum_atol(l64.shape[-1] + 3, max(1.0, lse), margin)
    return float(np.sum(weights)) * nll + sum_atol(np.size(weights) + 3, value, margin)


def test_loss_is_the_masked_cross_entropy_weighted_by_one_over_t(model):
    """The train loss against NumPy with the same masks. Tolerance: the loss is a mean of 128
    float32 log-softmaxes (each a few EPS32 relative) after a 2-block forward whose dot products
    have <= 64 terms: ≲ sqrt(128)·8 EPS32 ≈ 1e-5 relative; 1e-4 leaves 10× room, and a wrong
    weight (1 instead of 1/t, or the mask id's logit kept) is off by far more than 1%."""
    batch = tokens((8, 17), seed=4)
    key = jax.random.PRNGKey(5)
    loss, aux = eqx.filter_jit(mdlm.loss_fn)(model, jnp.asarray(batch), key, jnp.float32, 1e-3)
    keys_B, _ = mdlm.train_keys(key, 8)
    want, logits, weights = numpy_nelbo(model, batch, keys_B, 1e-3)
    # the jitted loss and the eager forward are two programs: rounding of the logits and of the mean
    np.testing.assert_allclose(float(loss), want, rtol=0, atol=nelbo_sum_atol(model.cfg, logits, weights,
                                                                            want * weights.size) / weights.size)
    assert float(aux["loss"]) == float(loss)


def test_the_one_over_t_weights_make_the_bound_unbiased():
    """A model whose logits are all 0 (every weight 0) predicts uniformly over the V-1 real ids, so
    every position's -log p is log(V-1) and the loss is log(V-1)·Σ masked/t / N: exactly that
    (float32 rounding of a 16k-term sum: 1e-5), and ≈ log(V-1) since E[masked/t] = 1 per position.
    That mean over N = B·T positions has variance (E[1/t] - 1)/N, E[1/t] = ln(1/eps)/(1-eps)
    (within a row the positions share t, but given t they are independent): 5 sd of it."""
    run = validate(compose_config("objective=mdlm"))
    zero = jax.tree.map(lambda a: jnp.zeros_like(a) if eqx.is_inexact_array(a) else a,
                        train_jax.init_model(run, jax.random.PRNGKey(0)))
    B, T, eps = 1024, 16, 1e-3
    batch = tokens((B, T + 1), seed=6)
    key = jax.random.PRNGKey(7)
    loss = float(eqx.filter_jit(mdlm.loss_fn)(zero, jnp.asarray(batch), key, jnp.float32, eps)[0])
    _, masked, t = mdlm.corrupt(mdlm.train_keys(key, B)[0], jnp.asarray(batch[:, 1:]), jnp.ones((B, T)), eps, MASK)
    ratio = float((np.asarray(masked) / np.asarray(t)[:, None]).sum() / (B * T))
    # Every nll is the same float32 log(V − 1) (one rounding of the log: the logsumexp of V − 1 zeros,
    # minus 0): the loss is log(V − 1)·Σ masked/t / N up to the float32 sum of N = B·T = 16k terms,
    # Σ|terms| = loss·N: the worst case (N + 1)·u is 2e-3, so the probabilistic bound with λ = 10
    # (failure chance below 1e-15; sum_atol's lam), plus 4 roundings of each term (the log, t, 1/t,
    # the product) and the division by N. Looser than the 1e-5 this replaced (a guess at the sum's
    # error); a wrong weight is still off by far more.
    rtol = sum_atol(B * T, 1.0, lam=10) + sum_atol(5, 1.0)
    np.testing.assert_allclose(loss, math.log(V - 1) * ratio, rtol=rtol)
    sd = math.sqrt((math.log(1 / eps) / (1 - eps) - 1) / (B * T))
    assert abs(loss / math.log(V - 1) - 1) < 5 * sd


# ----------------------------------------------------------------------------- attention


def test_a_later_token_changes_earlier_logits_under_mdlm_not_under_ar(model):
    x = tokens((1, 16), seed=8)
    later = x.copy()
    later[0, 12] = (later[0, 12] + 1) % MASK
    for objective, changes in ((AR(), False), (MDLM(), True)):
        a, b = (np.asarray(model(jnp.asarray(v), causal=objective.causal)) for v in (x, later))
        assert np.array_equal(a[0, :12], b[0, :12]) != changes, objective.name
        assert not np.array_equal(a[0, 12:], b[0, 12:])


def test_bidirectional_attention_stays_inside_each_document(model):
    x = tokens((1, 16), seed=9)
    seg = jnp.asarray(np.repeat([[0, 1]], 8, axis=1))  # two documents of 8 tokens
    later = x.copy()
    later[0, 12] = (later[0, 12] + 1) % MASK
    a, b = (np.asarray(model(jnp.asarray(v), segment_ids_BxT=seg, causal=False)) for v in (x, later))
    np.testing.assert_array_equal(a[0, :8], b[0, :8])  # the first document never sees the second
    assert not np.array_equal(a[0, 8:12], b[0, 8:12])  # inside the second, both ways


# ----------------------------------------------------------------------------- loss masks and documents


def chat_rows(num_windows: int = 6, window: int = 17):
    """Rows as dataset=chat hands them over (aligned windows of a stream with a loss mask on the
    assistant's tokens and given document starts), and the stream's own mask, starts and documents."""
    rng = np.random.default_rng(10)
    n = num_windows * window
    stream = rng.integers(0, MASK, n).astype(np.uint16)
    turn = np.cumsum(rng.random(n) < 0.2)  # turns of ~5 tokens; odd ones the assistant's
    loss_mask = (turn % 2).astype(np.uint8)
    starts = (rng.random(n) < 0.1).astype(np.uint8)
    starts[::window] = 1
    ds = WindowDataset(stream, window, loss_mask=loss_mask, document_mask=True, aligned=True, doc_starts=starts)
    return ds.get(np.arange(num_windows)), loss_mask.reshape(num_windows, window), \
        starts.reshape(num_windows, window), np.cumsum(starts).reshape(num_windows, window)


def test_only_loss_masked_tokens_are_ever_masked_and_documents_line_up():
    """Masked diffusion denoises window positions 1..T: a masked token is always one whose stream
    loss mask is 1 (an assistant's), never a document's first token, and the segment ids say which
    document each position belongs to. The last position's own start is not in the row (the ids
    belong to the AR inputs): when its weight is 0 it may start a document, so it is put alone."""
    rows, mask_NxW, starts_NxW, doc_NxW = chat_rows()
    x, w, seg, _ = (None if a is None else np.asarray(a) for a in mdlm.sequences(jax.tree.map(jnp.asarray, rows)))
    np.testing.assert_array_equal(x, rows["tokens"][:, 1:])
    np.testing.assert_array_equal(w, mask_NxW[:, 1:] * (1 - starts_NxW[:, 1:]))
    same_doc = doc_NxW[:, 1:, None] == doc_NxW[:, None, 1:]
    alone = w[:, -1] == 0
    assert np.any(alone & (starts_NxW[:, -1] == 0)) and np.any(~alone)  # both cases occur
    same_doc[alone, -1, :-1] = same_doc[alone, :-1, -1] = False
    np.testing.assert_array_equal(seg[:, :, None] == seg[:, None, :], same_doc)
    for i in range(20):
        keys = jax.random.split(jax.random.PRNGKey(100 + i), len(x))
        _, masked, _ = mdlm.corrupt(keys, jnp.asarray(x), jnp.asarray(w), 1e-3, MASK)
        masked = np.asarray(masked)
        assert masked.any() and np.all(mask_NxW[:, 1:][masked] == 1) and not np.any(starts_NxW[:, 1:][masked])


# ----------------------------------------------------------------------------- validation


def test_validation_masks_depend_on_the_window_alone(model):
    """eval_sums gives the same sums twice, and with the rows in another order (a window keeps its
    t and mask whatever its batch and place); a padding row (weight 0) adds nothing."""
    step = eqx.filter_jit(MDLM().eval_sums)
    batch = tokens((8, 17), seed=11)
    ones = jnp.ones(8)
    first = [float(s) for s in step(model, jnp.asarray(batch), ones, jnp.float32)]
    assert first == [float(s) for s in step(model, jnp.asarray(batch), ones, jnp.float32)]
    perm = np.random.default_rng(12).permutation(8)
    permuted = [float(s) for s in step(model, jnp.asarray(batch[perm]), ones, jnp.float32)]
    # Rows elsewhere in the batch are not the same computation (a row's place can pick another
    # kernel path), and the sums add the rows in another order: the forward pass's rounding bound.
    nelbo, logits, weights = numpy_nelbo(model, batch, mdlm.row_keys(jnp.asarray(batch[:, 1:])), 1e-3)
    np.testing.assert_allclose(nelbo * weights.size, first[0], rtol=0,  # the masks are the row_keys ones
                               atol=nelbo_sum_atol(model.cfg, logits, weights, first[0]))
    np.testing.assert_allclose(permuted[0], first[0], rtol=0, atol=nelbo_sum_atol(model.cfg, logits, weights, first[0]))
    # The 1/t-weighted hits: the same hits (no top-2 logits at a masked position closer than the two
    # sides' error, checked here), summed in another order; the count of tokens is exact.
    top2 = np.sort(logits[weights > 0], -1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * logits_atol(model.cfg, logits)  # the premise
    np.testing.assert_allclose(permuted[1], first[1], rtol=0, atol=sum_atol(weights.size + 3, first[1], 4))
    assert permuted[2] == first[2]
    padded = batch.copy()
    padded[7] = tokens((17,), seed=13)
    weights = jnp.asarray([1.0] * 7 + [0.0])
    seven = [float(s) for s in step(model, jnp.asarray(batch), weights, jnp.float32)]
    assert seven == [float(s) for s in step(model, jnp.asarray(padded), weights, jnp.float32)]
    assert seven[2] == 7 * 16 and first[0] > seven[0] > 0


# ----------------------------------------------------------------------------- sampling


def test_reveal_counts_fill_every_mask_in_n_steps():
    for masks, steps in ((8, 4), (5, 3), (2, 5), (16, 1), (0, 3)):
        counts = sampling.reveal_counts(masks, steps)
        assert len(counts) == steps and sum(counts) == masks and min(counts) >= 0
        assert max(counts) - min(counts) <= math.ceil(masks / steps)
    assert sampling.reveal_counts(8, 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("remasking", ["confidence", "random"])
def test_unmasking_fills_every_mask_in_n_steps(model, monkeypatch, remasking):
    """Each model call reveals exactly its share of the masks; after the N steps none is left, the
    prompt is untouched, and nothing is ever the mask id."""
    calls = []
    step = sampling._unmask_step

    def spy(model, canvas, open_T, count, *rest):
        out = step(model, canvas, open_T, count, *rest)
        calls.append((int(np.sum(np.asarray(canvas) == MASK) - np.sum(np.asarray(out) == MASK)), int(count)))
        return out

    monkeypatch.setattr(sampling, "_unmask_step", spy)
    prompt = [5, 6, 7]
    out = sampling.unmask(model, np.asarray(prompt), 9, jax.random.PRNGKey(0), 0.8, steps=4, remasking=remasking)
    assert len(calls) == 4 and all(revealed == count for revealed, count in calls)
    assert [c for _, c in calls] == sampling.reveal_counts(9, 4)
    assert list(out[:3]) == prompt and len(out) == 12 and not np.any(out == MASK)


def test_unmasking_stops_at_the_stop_id_and_keeps_within_the_context(model):
    greedy = sampling.unmask(model, np.asarray([1, 2]), 6, jax.random.PRNGKey(0), 0.0, steps=3)
    stopped = sampling.unmask(model, np.asarray([1, 2]), 6, jax.random.PRNGKey(0), 0.0, steps=3,
                              stop_id=int(greedy[2]))
    assert list(stopped) == [1, 2]
    long = sampling.unmask(model, np.arange(40) % MASK, 100, jax.random.PRNGKey(0), 0.8, steps=2)
    assert len(long) == 16 and long[0] == 39 % MASK  # context 16: 15 new ids after the prompt's last


# ----------------------------------------------------------------------------- bad input


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_an_unknown_objective_is_one_line():
    with pytest.raises(ConfigError) as e:
        compose_overrides(["objective=ebm"], job_name="test")
    assert "choose one of ar, mdlm" in one_line(e)
    cfg = to_dict(compose_config())
    cfg["objective"] = {"name": "ebm"}
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert one_line(e) == "objective.name='ebm' is unknown: choose one of ar, mdlm"


@pytest.mark.parametrize("override, knob", [("objective.eps=0", "objective.eps=0"),
                                            ("objective.eps=1.5", "objective.eps=1.5"),
                                            ("objective.sample_steps=0", "objective.sample_steps=0"),
                                            ("objective.remasking=lowest", "objective.remasking='lowest'"),
                                            ("+objective.schedule=cosine", "unknown knob objective.schedule"),
                                            ("model.attn_block_size=8", "model.attn_block_size=8")])
def test_bad_mdlm_knobs_are_one_line(override, knob):
    with pytest.raises(ConfigError) as e:
        validate(compose_config("objective=mdlm", override))
    assert one_line(e).startswith(knob)


def test_mdlm_needs_a_free_id_for_the_mask():
    """With model.vocab_size null the padding makes room (256 ids pad to 320 for mdlm, stay 256
    for ar); an explicit vocabulary the tokenizer fills is one line naming the knob and the fix."""
    run = validate(compose_config("objective=mdlm", "model.vocab_size=null"))
    assert resolve_vocab(run, 256).model.vocab_size == 320 and resolve_vocab(run, 257).model.vocab_size == 320
    assert resolve_vocab(validate(compose_config("model.vocab_size=null")), 256).model.vocab_size == 256
    assert resolve_vocab(run, 63).model.vocab_size == 64
    with pytest.raises(ConfigError) as e:
        resolve_vocab(validate(compose_config("objective=mdlm")), 64)  # vocab_size=64 explicit: no room
    assert re.search(r"objective=mdlm .*model\.vocab_size=64 has no room: set model\.vocab_size=65", one_line(e))
    with pytest.raises(ConfigError) as e:
        train_jax.build_trainer(validate(compose_config("objective=mdlm", "model.vocab_size=257")))
    assert "model.vocab_size=257 has no room" in one_line(e)


# ----------------------------------------------------------------------------- a whole run


RUN = ("objective=mdlm", "model.vocab_size=null", "train.max_steps=12", "logging.log_every=1", "train.val_freq=6",
       "train.max_val_steps=4", "optimizer/lr_config=constant", "optimizer.lr_config.lr=3e-3",
       "train.sample_tokens=0", "checkpoint.save=true")


def records(run_dir: Path, name: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[name] for r in lines if name in r}


@pytest.mark.slow
def test_an_mdlm_run_lowers_its_bound_resumes_exactly_and_its_checkpoint_samples(tmp_path, monkeypatch, capsys):
    """12 steps on the default data: val/loss (the bound) falls by more than 10% (from ~log 319),
    a run stopped at step 5 and resumed logs the same train/loss at every step and the same
    val/loss bit for bit (the masks come from the state's key and the windows), and
    scripts/sample.py and export_model.py read the objective from the checkpoint."""
    monkeypatch.chdir(tmp_path)

    def train(name: str, *overrides: str) -> Path:
        (tmp_path / name).mkdir()
        train_jax.train(compose_config(*RUN, *overrides), str(tmp_path / name))
        return tmp_path / name

    full = train("full", "checkpoint.save_path=ckpt/full")
    first = train("first", "checkpoint.save_path=ckpt/seg", "checkpoint.num_steps=5")
    second = train("second", "checkpoint.save_path=ckpt/seg", "checkpoint.resume=auto")
    val = records(full, "val/loss")
    assert sorted(val) == [0, 6, 12] and val[12] < 0.9 * val[0]
    for name in ("train/loss", "val/loss"):
        assert {**records(first, name), **records(second, name)} == records(full, name), name

    capsys.readouterr()
    assert load_script("sample").main(["ckpt/full", "--tokens", "8", "--steps", "4", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert load_script("export_model").main(["ckpt/full", "--out", "exported"]) == 0
    config = json.loads(Path("exported/config.json").read_text())
    assert config["objective"] == {"name": "mdlm", "eps": 0.001, "sample_steps": 64, "remasking": "confidence"}
