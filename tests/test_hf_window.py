"""The training window of a run from a Hugging Face directory (`model.init_from`), and the memory
estimate that refuses a window no device could hold (trainer/memory.py).

A directory's config.json gives the model's maximum (max_position_embeddings: 131072 for some
llamas, 32768 for Qwen2.5-0.5B): that stays the model's limit (model.context_length), but the run
trains on dataset.context_length, whose null now means the model yaml's window (capped by the
maximum), said in the run header. Asked for a window the estimate cannot fit, the run refuses in
one line naming dataset.context_length and the largest window that fits, before the data is read
or anything compiles.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import compose_config

import models
import train_jax
from models import hf
from trainer import memory
from utils.config import validate
from utils.errors import ConfigError
from utils.parallel import mesh as meshlib

MAXIMUM = 131072  # a long-context llama's max_position_embeddings
YAML_WINDOW = 16  # helpers.TINY_OVERRIDES' model.context_length
H100 = 80 * memory.GiB  # a fixed device, so the refusal does not depend on the machine running the test


@pytest.fixture
def long_dir(tmp_path):
    """A tiny llama directory whose config.json allows 131072 positions (rotary: no position table)."""
    cfg = models.config_from_dict({"name": "llama", "dim": 32, "num_heads": 2, "num_kv_heads": 2, "num_blocks": 2,
                                   "context_length": MAXIMUM, "vocab_size": 320})
    path = str(tmp_path / "long")
    hf.save_hf(path, models.build(cfg, jax.random.PRNGKey(0)))
    return path


def test_an_imported_model_trains_on_the_yaml_window_not_its_maximum(long_dir):
    run = validate(compose_config("model=llama_tiny", f"model.init_from={long_dir}",
                                  f"model.context_length={YAML_WINDOW}"))
    assert run.model.context_length == MAXIMUM  # the model's limit is the directory's
    assert run.context_length == YAML_WINDOW  # the window the data is cut into
    header = [n for n in run.notes if n.startswith("window:")]
    assert len(header) == 1 and f"{YAML_WINDOW} tokens" in header[0] and "dataset.context_length" in header[0]
    explicit = validate(compose_config("model=llama_tiny", f"model.init_from={long_dir}", "dataset.context_length=64"))
    assert explicit.context_length == 64  # a set window is the run's own, no note
    assert not [n for n in explicit.notes if n.startswith("window:")]


def test_a_window_that_cannot_fit_is_refused_before_the_data_is_read(long_dir, monkeypatch):
    """dataset.context_length=131072 at batch 8: XLA's attention scores alone are 2·131072²·4 bytes
    = 128 GiB per window. The refusal comes from build_trainer before init_data (which would
    tokenize the corpus) and before any compilation; the window it suggests fits, twice it does not."""
    monkeypatch.setattr(memory, "device_memory", lambda device=None: (H100, "a test's 80 GiB GPU"))

    def reached(*args, **kwargs):
        raise AssertionError("the data was read before the window was checked")

    monkeypatch.setattr(train_jax, "init_data", reached)
    monkeypatch.setattr(train_jax, "init_training", reached)
    cfg = compose_config("model=llama_tiny", f"model.init_from={long_dir}", f"dataset.context_length={MAXIMUM}")
    with pytest.raises(ConfigError) as err:
        train_jax.build_trainer(validate(cfg))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"dataset.context_length={MAXIMUM}:")
    fits = int(re.search(r"set dataset\.context_length=(\d+) or less", line).group(1))
    assert 0 < fits < MAXIMUM
    for window, ok in ((fits, True), (2 * fits, False)):
        sized = validate(compose_config("model=llama_tiny", f"model.init_from={long_dir}",
                                        f"dataset.context_length={window}"))
        sized = train_jax.resolve_vocab(sized, 320)
        state = memory.state_bytes(*_state(sized))
        assert (memory.estimate(sized, state, window, jax.device_count()).total <= H100) is ok, window


def _state(run):
    """(weights, optimizer state, trained weights) of `run`, abstract: train_jax.check_memory's."""
    model = jax.eval_shape(lambda: train_jax.init_model(run, jax.random.PRNGKey(0)))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    assert len(jax.tree.leaves(params)) == len(jax.tree.leaves(model))  # every weight counted
    tx = train_jax.init_optimizer(run, train_jax.init_scheduler(run), models.param_labels(model))
    return params, jax.eval_shape(tx.init, params), params


def test_a_state_too_large_for_the_device_is_refused_before_anything_is_read(monkeypatch):
    """The estimate counts the weights, the optimizer state and a gradient (AdamW: 4 copies of the
    weights): a device a little smaller than that refuses the run in one line, whatever the window.
    (Before: the abstract model's weights were filtered out as non-arrays and the state counted 0.)"""
    run = train_jax.resolve_vocab(validate(compose_config("optimizer=adamw")), 64)
    params = 4 * 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(models.abstract(run.model)))
    monkeypatch.setattr(memory, "device_memory", lambda device=None: (params * 0.9, "a small test device"))
    with pytest.raises(ConfigError) as err:
        train_jax.check_memory(run, meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1]))
    assert "\n" not in str(err.value) and "the weights and optimizer state alone do not fit" in str(err.value)
