"""The GPU tier (`pytest -m gpu`): what only an NVIDIA GPU can check. cuDNN's flash attention
against XLA's within a derived bfloat16 bound (forward and gradients, with and without document
masks), and a bfloat16 and a float16 train step (the sharded program, on a one-device mesh) that
learn on the device. Every test here skips, with the reason, where JAX's backend is not a GPU (CI's machines);
tests/test_gpu_lowering.py checks on any CPU that the same programs still lower for CUDA.

Bounds: bfloat16 keeps 8 significant bits, so one rounding errs by at most U_BF16 = 2^-9 of its
value (half the spacing 2^-8). The reference is XLA's attention computed in float32 from the
same bfloat16 inputs, so only the kernel's own roundings count (derivation at `ATTN_RTOL`).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.layers import causal_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    """Asked when the test runs, not at collection: starting JAX's backend then would come before
    the session's fixtures set its flags."""
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs an NVIDIA GPU (JAX's backend here is {jax.default_backend()})")

U_BF16 = 2.0**-9  # unit roundoff of bfloat16: 8 significant bits, round to nearest
# cuDNN's kernel rounds the probabilities P to bfloat16 before P·V (error <= U_BF16 of each weight,
# and the weights sum to 1, so <= U_BF16 · max|v| on each output), accumulates in float32 (T terms:
# T·EPS32 of the scale, 1e-4 at T=256, negligible) and rounds the output to bfloat16 (U_BF16 of
# |out| <= max|v|). Two roundings of at most U_BF16 · max|v| each, times a 2x margin.
ATTN_RTOL = 2 * 2 * U_BF16
# Gradients pass three more bfloat16 roundings (dP, dS and the result) before their matmuls sum
# them; measured as a norm relative to the reference's norm, each adds at most U_BF16: five in all,
# times a 2x margin.
GRAD_RTOL = 2 * 5 * U_BF16


def cfg(impl: str):
    return types.SimpleNamespace(attention=impl, attn_block_size=None)


def qkv(seed: int, shape=(2, 4, 256, 64)):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys]


def reference(q, k, v, segment_ids_BxT=None):
    """XLA's attention in float32 from the same bfloat16 inputs: exact but for float32 rounding."""
    up = [a.astype(jnp.float32) for a in (q, k, v)]
    return causal_attention(*up, segment_ids_BxT=segment_ids_BxT)


def documents(B: int, T: int, seed: int) -> jax.Array:
    """Segment ids of packed documents: a few random cuts per row."""
    rng = np.random.default_rng(seed)
    cuts = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts[b, rng.choice(np.arange(1, T), size=3, replace=False)] = 1
    return jnp.asarray(np.cumsum(cuts, axis=1))


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_cudnn_attention_equals_xla_within_the_bf16_bound(masked):
    q, k, v = qkv(0)
    seg = documents(q.shape[0], q.shape[2], 1) if masked else None
    out = attention.attend(cfg("cudnn"), q, k, v, segment_ids_BxT=seg).astype(jnp.float32)
    ref = reference(q, k, v, seg)
    scale = float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    err = float(jnp.max(jnp.abs(out - ref)))
    print(f"cudnn vs float32 reference: max error {err:.3e} = {err / (ATTN_RTOL * scale):.2f} of the bound")
    assert err <= ATTN_RTOL * scale
    # The kernel really ran: XLA's bf16 attention rounds differently, so the two are not the same bits.
    assert "cudnn" in jax.jit(lambda *a: attention.attend(cfg("cudnn"), *a)).lower(q, k, v).as_text()


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_cudnn_attention_gradients_equal_xla_within_the_bf16_bound(masked):
    q, k, v = qkv(2)
    seg = documents(q.shape[0], q.shape[2], 3) if masked else None
    w = jax.random.normal(jax.random.key(4), q.shape, jnp.float32)  # a cotangent that is not all ones

    def loss(fn, *a):
        return jnp.sum(fn(*a).astype(jnp.float32) * w)

    cudnn = jax.grad(lambda *a: loss(lambda *b: attention.attend(cfg("cudnn"), *b, segment_ids_BxT=seg), *a),
                     argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: loss(lambda *b: reference(*b, seg), *a), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", cudnn, ref):
        rel = float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        print(f"d{name}: relative error {rel:.3e} = {rel / GRAD_RTOL:.2f} of the bound")
        assert rel <= GRAD_RTOL


def tiny_gpu_run(tiny_run, *overrides):
    """gpt_tiny's shape with a head dim cuDNN takes (32 / 2 heads = 16, a multiple of 8)."""
    from utils.config import resolve_vocab

    return resolve_vocab(tiny_run("tokenizer=byte", "model.vocab_size=null", *overrides), 257)


def memorise(run, steps: int = 40):
    """Train on one fixed batch (a model can memorise it): the losses of every step."""
    import train_jax as T
    from utils.parallel import mesh as meshlib

    mesh = meshlib.make_mesh(run.parallel.data, run.parallel.fsdp, run.dataset.batch_size)
    _, _, state, step = T.init_training(run, mesh)
    rng = np.random.default_rng(0)
    batch = meshlib.put_batch(rng.integers(0, 257, (1, run.dataset.batch_size, run.context_length + 1),
                                           dtype=np.int32), meshlib.batch_sharding(mesh, 1))
    losses = []
    for _ in range(steps):
        state, metrics = step.plain(state, batch, step.args)
        losses.append(float(metrics["train/loss"]))
    return losses, state


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_step_learns_on_the_gpu(tiny_run, dtype):
    """The step users train with on a GPU: half-precision compute, cuDNN attention chosen by auto
    (float16 also scales its loss, trainer/loss_scale.py), memorises a fixed batch."""
    run = tiny_gpu_run(tiny_run, f"train.compute_dtype={dtype}", "optimizer.lr_config.lr=0.01",
                       "optimizer.lr_config.warmup=0")
    assert run.model.attention == "cudnn", run.notes
    losses, state = memorise(run)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses  # memorising 8 windows: the loss at least halves in 40 steps
    if dtype == "float16":
        assert state.loss_scale is not None


def test_first_loss_in_bf16_equals_float32_within_the_bf16_bound(tiny_run):
    """The loss of the first step (before any update) in bfloat16 and in float32 on the same weights
    and batch. The loss is a mean of log-softmax values of size ~log(vocab) = 5.5; the logits pass
    the blocks' bfloat16 matmuls, each output rounded (U_BF16 relative) and 2 blocks x (attention,
    MLP) + the head = 5 rounded layers, with a residual stream that carries them: 5·U_BF16 relative
    error of the logits' scale (~1 at init), times a 4x margin for the norms and softmax."""
    bf16 = memorise(tiny_gpu_run(tiny_run, "train.compute_dtype=bfloat16"), steps=1)[0][0]
    f32 = memorise(tiny_gpu_run(tiny_run, "train.compute_dtype=float32"), steps=1)[0][0]
    assert abs(bf16 - f32) <= 4 * 5 * U_BF16 * max(1.0, abs(f32) / 5.5), (bf16, f32)

