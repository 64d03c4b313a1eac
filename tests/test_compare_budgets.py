"""budget_unit=tokens|chinchilla (compare/budgets.py): budgets turned into each workload's steps from its
tokens per step and parameter count, the count checked against a built model's, and the plan's runs."""

import math

import jax
import pytest
from helpers import TINY_OVERRIDES

import models
from compare.budgets import TOKENS_PER_PARAM, to_steps, workload_scale
from compare.plan import compare_config, make_plan, with_steps
from utils.config import compose_overrides, resolve_vocab, validate
from utils.errors import ConfigError

RUN = tuple(o for o in TINY_OVERRIDES if not o.startswith("train.max_steps"))  # vocab 64: no tokenizer to build


def test_budgets_in_tokens_and_chinchilla_multiples_round_to_the_nearest_step():
    assert to_steps((1000.0, 2000.0), "tokens", 128, None) == (8, 16)  # 7.8 -> 8, 15.6 -> 16
    assert to_steps((0.5, 1.0, 2.0), "chinchilla", 1000, 10_000) == (100, 200, 400)  # 20 tokens per parameter
    assert to_steps((10.0,), "tokens", 1000, None) == (1,)  # never below one step
    assert to_steps((100, 200), "steps", 7, 5) == (100, 200)


def test_the_scale_is_the_runs_tokens_per_step_and_the_built_models_parameter_count():
    tokens, params = workload_scale((*RUN, "dataset.total_batch_size=16"), need_params=True)
    run = validate(compose_overrides([*RUN, "dataset.total_batch_size=16"], job_name="test"))
    assert tokens == 16 * run.context_length  # dataset.batch_size=8, two micro-batches per step
    model = models.build(resolve_vocab(run, 64).model, jax.random.PRNGKey(0))
    assert params == models.count_params(model)  # what the run's header and model/params say
    assert workload_scale(RUN, need_params=False) == (8 * run.context_length, None)


def test_each_workload_gets_its_own_steps_and_the_plan_uses_them():
    knobs = compare_config({"optimizers": ["adamw"], "budgets": [1, 2], "budget_unit": "chinchilla", "warmup": 2,
                            "lr": {"points": 1},
                            "workloads": {"small": "model.dim=16", "big": "model.dim=32"}})
    converted, lines = with_steps(knobs, RUN)
    per = dict(converted.workload_budgets)
    for name, dim in (("small", 16), ("big", 32)):
        tokens, params = workload_scale((*RUN, f"model.dim={dim}"), need_params=True)
        want = tuple(math.floor(m * TOKENS_PER_PARAM * params / tokens + 0.5) for m in (1, 2))  # the nearest step
        assert per[name] == want and converted.budgets_of(name) == want
        assert any(line.startswith(f"workload {name}: {params:,} params, {tokens:,} tokens/step: budgets 1, 2 "
                                   f"x Chinchilla = {want[0]}, {want[1]} steps") for line in lines)
    assert per["big"][0] > per["small"][0]  # the larger model trains longer
    plan = make_plan(converted, RUN, {"small": {"adamw": 1e-3}, "big": {"adamw": 1e-3}})
    for name in per:
        assert sorted(r.budget for r in plan.runs if r.workload == name and r.kind == "branch") == list(per[name])
    assert with_steps(compare_config({"optimizers": ["adamw"], "budgets": [10, 20]}), RUN)[1] == []  # steps: as given


@pytest.mark.parametrize("knobs, message", [
    ({"budget_unit": "flops"}, "budget_unit='flops' must be one of steps, tokens, chinchilla"),
    ({"budget_unit": "tokens", "budgets": [1000, -5]}, "must be positive tokens"),
    ({"budgets": [1.5, 3]}, "budgets=1.5 must be an integer"),
])
def test_bad_budget_units_are_one_line(knobs, message):
    with pytest.raises(ConfigError) as e:
        compare_config({"optimizers": ["adamw"], "budgets": [100, 200], "warmup": 2, **knobs})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_budgets_that_round_to_too_few_steps_are_refused_naming_the_workload():
    knobs = compare_config({"optimizers": ["adamw"], "budgets": [100, 101], "budget_unit": "tokens", "warmup": 2,
                            "workloads": {"small": "model.dim=16", "big": "model.dim=32"}})
    with pytest.raises(ConfigError, match=r"budgets \(tokens\) of workload big round to \[1, 1\] steps"):
        with_steps(knobs, RUN)
