"""The GPU path, checked on any CPU: the programs a bfloat16 run compiles on an NVIDIA GPU (the
train step's two variants, evaluation, sampling's forward) lowered for the CUDA platform with
`model.attention=auto` resolved as on an H100, for every model family. A change that breaks the
GPU path (a cuDNN requirement, a dtype the kernel refuses, an op with no CUDA lowering) fails
here, on CI's machines, instead of on the first GPU run. tests/test_gpu.py runs them on a GPU.

Lowering needs no GPU, but JAX asks for cuDNN's version when it builds the cuDNN attention call:
the test answers for it (the version our GPU runs had), since no cuDNN library is loaded here.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo

import models
import train_jax as T
from models import attention
from utils.config import resolve_vocab
from utils.parallel import mesh as meshlib

CUDNN_CALL = "__cudnn$fmha"  # the custom call cuDNN's fused attention lowers to


@pytest.fixture
def cuda_lowering(monkeypatch):
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def lower_for_cuda(fn, *args) -> str:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def gpu_run(tiny_run, family: str, *overrides, attention_knob: str = "auto"):
    """A tiny bf16 run of `family`, its attention resolved as `resolve_vocab` resolves it on an H100."""
    run = tiny_run(f"model={family}_tiny", "model.dim=32", "model.num_heads=2", "model.num_blocks=2",
                   "model.context_length=16", "tokenizer=byte", "model.vocab_size=null",
                   "train.compute_dtype=bfloat16", "model.attention=auto", *overrides)
    run = resolve_vocab(run, 257)  # on this CPU auto picks xla; below, what an H100 picks for the knob
    m, _ = attention.resolve(dataclasses.replace(run.model, attention=attention_knob), "bfloat16",
                             run.context_length, run.dataset.document_mask, backend="gpu", compute_capability="9.0")
    assert m.attention == "cudnn"
    return dataclasses.replace(run, model=m)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("document_mask", [False, True], ids=["causal", "documents"])
def test_train_step_lowers_for_cuda_with_cudnn_attention(tiny_run, cuda_lowering, family, document_mask):
    # auto keeps XLA's attention for document masks; an explicit cudnn takes them (as a dense bias)
    run = gpu_run(tiny_run, family, "logging.log_callback_data=true",  # two variants: plain and logging
                  f"dataset.document_mask={str(document_mask).lower()}",
                  attention_knob="cudnn" if document_mask else "auto")
    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = T.init_training(run, mesh)
    assert step.plain is not step.logging
    batch = jax.ShapeDtypeStruct((1, run.dataset.batch_size, run.context_length + 1), jnp.int32)
    if document_mask:  # what loaders/windows.py yields with dataset.document_mask
        per_target = (1, run.dataset.batch_size, run.context_length)
        batch = {"tokens": batch, "segment_ids": jax.ShapeDtypeStruct(per_target, jnp.int32),
                 "loss_mask": jax.ShapeDtypeStruct(per_target, jnp.float32)}
    for variant in (step.plain, step.logging):
        text = lower_for_cuda(variant, state, batch, step.args)
        assert CUDNN_CALL in text and "Backward" in text  # the kernel's forward and backward calls


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_evaluation_and_sampling_lower_for_cuda(tiny_run, cuda_lowering, family):
    """Evaluation runs in the compute dtype (cuDNN's kernel); sampling's forward runs in float32,
    which cuDNN refuses, so there the model must fall back to XLA's attention, not fail."""
    run = gpu_run(tiny_run, family)
    model = models.build(run.model, jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tokens = jax.ShapeDtypeStruct((run.dataset.batch_size, run.context_length + 1), jnp.int32)
    weights = jax.ShapeDtypeStruct((run.dataset.batch_size,), jnp.float32)
    evaluate = jax.jit(lambda p, b, w: run.objective.eval_sums(eqx.combine(p, static), b, w,
                                                               compute_dtype=run.train.compute_dtype))
    assert CUDNN_CALL in lower_for_cuda(evaluate, params, tokens, weights)
    window = jax.ShapeDtypeStruct((1, run.context_length), jnp.int32)
    forward = jax.jit(lambda p, w: eqx.combine(p, static)(w))  # what models/sample.py's _next_token runs
    text = lower_for_cuda(forward, params, window)
    assert CUDNN_CALL not in text
