"""A comparison process composes conf/'s groups once per selection and applies each run's values
(utils/config.compose_reusing): every run's config equals Hydra's own composition of its overrides."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from compare import launch
from compare.plan import compare_config, make_plan
from trainer import process_cache
from utils.config import compose_overrides, compose_reusing, split_overrides
from utils.errors import ConfigError

# The docstring comparison of bench/compare_speed.py, with workloads, a variant (value overrides
# of its own), trunks and branches (their lr_config groups differ), a sweep and groups the user chose.
KNOBS = {"optimizers": ["adamw", "muon", "sgdm"], "budgets": [15, 30], "lr": {"points": 2}, "seeds": 1, "warmup": 5,
         "sweep": {"adamw": {"weight_decay": [0.0, 0.1]}},
         "variants": {"adamw_ema": "adamw train.weight_average=ema optimizer.b2=0.99"},
         "workloads": {"small": "model.dim=32", "llama": ["model=llama_tiny", "dataset.batch_size=8"]}}
RUN = ("dataset.batch_size=16", "train.max_val_steps=4", "logging.log_callback_data=false", "model=gpt_tiny",
       "++train.val_freq=7", "logging.log_every=5", "tokenizer=byte", "train.sample_prompt='a b=c'")


def containers(cfg) -> tuple:
    return OmegaConf.to_container(cfg, resolve=False), OmegaConf.to_container(cfg, resolve=True)


def plan_overrides(tmp_path) -> list[list[str]]:
    k = compare_config(KNOBS)
    plan = make_plan(k, RUN, {o: 0.01 for o in k.optimizers})
    return [launch.run_overrides(run, str(tmp_path)) for run in plan.runs]


def test_the_overrides_split_into_group_selections_and_values():
    groups, values = split_overrides(["model=gpt_tiny", "optimizer/lr_config=wsd", "optimizer.lr_config.lr=0.1",
                                      "+train.val_at=[3]", "model.dim=8"])
    assert groups == ("model=gpt_tiny", "optimizer/lr_config=wsd")
    assert [v.input_line for v in values] == ["optimizer.lr_config.lr=0.1", "+train.val_at=[3]", "model.dim=8"]
    for whole in (["~train.val_at"], ["hydra.job.name=x"], ["model@foo=gpt_tiny"], ["model.dim=8,16"]):
        assert split_overrides(whole) is None  # composed whole by Hydra


@pytest.mark.slow
def test_every_run_of_a_plan_composes_as_hydra_composes_it(tmp_path):
    """Every run of a plan with workloads, a variant, a sweep, group selections and added keys."""
    runs = plan_overrides(tmp_path)
    assert len(runs) >= 40 and len({tuple(split_overrides(o)[0]) for o in runs}) >= 4
    with process_cache.sharing():
        before = process_cache.stats().get("composed/miss", 0)
        for overrides in runs:
            assert containers(compose_reusing(overrides, "compare")) == containers(compose_overrides(overrides, "t"))
        assert process_cache.stats()["composed/miss"] - before == len({split_overrides(o)[0] for o in runs})


def test_runs_compose_as_hydra_does_and_a_bad_value_fails_alike(tmp_path):
    runs = plan_overrides(tmp_path)
    picked = [runs[1], next(o for o in runs if "train.weight_average=ema" in o and "model=llama_tiny" in o)]
    with process_cache.sharing():
        for overrides in picked:  # each twice: the second from the table, which the first left unchanged
            for _ in range(2):
                assert containers(compose_reusing(overrides, "c")) == containers(compose_overrides(overrides, "c"))
        for bad in (["model.nope=1"], ["model=nope"]):  # a value Hydra refuses, an unknown group option
            with pytest.raises(ConfigError) as reused:
                compose_reusing([*runs[0], *bad], "c")
            with pytest.raises(ConfigError) as composed:
                compose_overrides([*runs[0], *bad], "c")
            assert str(reused.value) == str(composed.value)
