"""Host memory of a run's start from a Hugging Face directory (`model.init_from`, models/hf.py).

The directory is read inside the init program's pure_callbacks, one tensor at a time, in the run's
train.param_dtype, and each host array is dropped once its callback has handed it over: the peak
is about one host copy of the model, and nothing stays once the model is freed (it used to be
cached, in float32, for the life of the process). Measured with tracemalloc in numpy's own domain
(`np.lib.tracemalloc_domain`: the arrays' data, not Python's objects) around the compiled init
program's execution alone: jit's trace and compilation read nothing (the callbacks run only when
the program runs) and would add Python allocations of their own. bench/import_memory.py measures
the resident memory of a 125M-parameter directory.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import models
from models import hf

SHAPE = {"name": "llama", "dim": 128, "num_heads": 2, "num_kv_heads": 2, "num_blocks": 2, "context_length": 32,
         "vocab_size": 4096, "tie_embeddings": False}  # ~2.7 MB in bfloat16: the embedding and head are 1 MB each


@pytest.fixture
def bf16_dir(tmp_path):
    """(a llama directory in bfloat16, as downloaded checkpoints are; its weights file's bytes; its model).
    A new one per test: a loader that caches by path would otherwise serve one test from another's read."""
    path = str(tmp_path)
    cfg = models.config_from_dict(SHAPE)
    model = models.build(cfg, jax.random.PRNGKey(0), "bfloat16")
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(ml_dtypes.bfloat16))
               for k, v in models.family(model).hf_tensors(model).items()}
    save_file(tensors, os.path.join(path, hf.WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
        json.dump({**hf.hf_dir_config(model), "torch_dtype": "bfloat16", "dtype": "bfloat16"}, f)
    return path, os.path.getsize(os.path.join(path, hf.WEIGHTS_FILE)), model


def init_program(path: str, param_dtype: str):
    """The run's init of the model (`models.build` under jit with model.init_from), compiled: nothing read yet."""
    cfg = dataclasses.replace(models.config_from_dict(SHAPE), init_from=path)
    return jax.jit(lambda: models.build(cfg, jax.random.PRNGKey(0), param_dtype)).lower().compile()


def numpy_bytes() -> int:
    """The bytes numpy's arrays hold now, of those allocated since tracemalloc started."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(s.size for s in snap.statistics("filename"))


def test_reading_a_directory_peaks_at_one_host_copy_in_the_training_dtype(bf16_dir):
    """bfloat16 weights into a bfloat16 run: the peak of host allocations while the init program
    runs stays under 1.5x the checkpoint plus the model in its training dtype (issue 33's bound:
    the reader's one tensor and its stacked leaf are the 0.5x, the host model handed to XLA the
    rest). The float32 dict of the whole directory, its stacked float32 copy and the cache the
    loader kept came to ~4x the checkpoint. The arrays are the directory's, bit for bit."""
    path, size, want = bf16_dir
    program = init_program(path, "bfloat16")
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(want))  # bfloat16: the checkpoint's size, give or take
    tracemalloc.start()
    try:
        model = program()
        jax.block_until_ready(model)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 1.5 * size + model_bytes, (peak, size, model_bytes)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = program()  # a second run of the same program reads the directory again
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_nothing_of_the_directory_stays_in_host_memory(bf16_dir, param_dtype):
    """Once the init program has run, no host copy of the weights is kept: with the model alive (its
    arrays are XLA's, outside numpy's domain) and after it is freed. The bound: any copy of the
    weights holds the embedding at least (1 MB in bfloat16), so half of it leaves room for
    incidental arrays and none for a copy. The loader's lru_cache kept all of them, in float32."""
    path, _, want = bf16_dir
    program = init_program(path, param_dtype)
    smallest_copy = want.embed_VxD.size * 2  # the embedding in bfloat16, the smaller of the two dtypes
    tracemalloc.start()
    try:
        model = program()
        jax.block_until_ready(model)
        gc.collect()
        alive = numpy_bytes()
        del model
        gc.collect()
        freed = numpy_bytes()
    finally:
        tracemalloc.stop()
    assert alive < smallest_copy / 2, alive
    assert freed < smallest_copy / 2, freed
