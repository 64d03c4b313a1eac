"""The model family of docs/extending.md ("A model family"), as a module that runs: the page's block
is copied verbatim from here; tests/test_model_contract.py registers it as `tiny` and runs it through
every family's matrix, and tests/test_docs_examples.py checks the copy.

GPT-2's module under a Config of its own (the shared knobs inherited, biases off by default): the
least a family declares. A real one (models/gpt.py, models/llama.py) defines its own Model too.
"""

from __future__ import annotations

from dataclasses import dataclass

from models import gpt
from models.contract import ModelConfig
from utils.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TinyConfig(ModelConfig):                 # model.name=tiny: the shared knobs, inherited
    mlp_ratio: int = 4                         # its own knobs: the MLP's width / dim
    bias: bool = False                         # and biases (GPT-2's blocks read both)
    name: str = "tiny"                         # the registry key: MODELS["tiny"]

    def check_family(self, prefix: str) -> None:
        if self.mlp_ratio <= 0:
            raise ConfigError(f"{prefix}.mlp_ratio={self.mlp_ratio} must be a positive integer")
        if self.dim % self.num_heads:
            raise ConfigError(f"{prefix}.dim={self.dim} is not divisible by {prefix}.num_heads={self.num_heads}: "
                              "pick a head count that divides dim")


Config, Model = TinyConfig, gpt.GPT            # Model(cfg, key), called as models.contract.ModelCall
param_labels, param_axes, PARAM_AXES = gpt.param_labels, gpt.param_axes, gpt.PARAM_AXES
flops_per_token = gpt.flops_per_token
