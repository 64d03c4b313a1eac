"""Training objectives (`objective=ar|mdlm`): how a batch becomes a loss, whether attention is
causal, how the model is evaluated and sampled.

Each objective is a frozen config dataclass (its yaml's knobs, `check(prefix)`) that hands the run
its functions, all with the signatures the rest of the pipeline already uses:

    loss_fn(model, batch, key, compute_dtype) -> (loss, aux)      the train step's (trainer/step.py)
    eval_sums(model, batch, weights_B, compute_dtype) -> 3 sums   the evaluation's (trainer/hooks.py)
    generate(model, prompt_ids, num_tokens, key, temperature, stop_id, context_length) -> ids

plus `causal` (the attention mask the model runs with: a static flag, so any model takes it),
`needs_key` (the loss draws randomness: the train step hands it the state's key every step, so a
resumed run draws what an unbroken one would) and `extra_ids` (ids it needs past the tokenizer's).
Adding one: a dataclass here and a line in OBJECTIVES, a yaml in conf/objective/.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Callable, ClassVar

from models import losses, mdlm
from models import sample as sampling
from utils.errors import ConfigError

REMASKING = ("confidence", "random")


@dataclass(frozen=True)
class AR:
    """Next-token prediction with causal attention: the loss, evaluation and sampling as they always were."""

    name: ClassVar[str] = "ar"
    causal: ClassVar[bool] = True
    needs_key: ClassVar[bool] = False
    extra_ids: ClassVar[int] = 0

    def check(self, prefix: str) -> None:
        pass

    @property
    def loss_fn(self) -> Callable:
        return losses.loss_fn

    @property
    def eval_sums(self) -> Callable:
        return losses.eval_sums

    @property
    def generate(self) -> Callable:
        return sampling.generate


@dataclass(frozen=True)
class MDLM:
    """Masked diffusion (models/mdlm.py): bidirectional attention, the 1/t-weighted masked
    cross-entropy (a bound on the per-token NLL), sampling by iterative unmasking."""

    name: ClassVar[str] = "mdlm"
    causal: ClassVar[bool] = False
    needs_key: ClassVar[bool] = True
    extra_ids: ClassVar[int] = 1  # the mask id

    eps: float = 1e-3  # lowest masking rate: t ~ U(eps, 1); the 1/t weight is at most 1/eps
    sample_steps: int = 64  # unmasking steps of a sample (each reveals an equal share of the masks)
    remasking: str = "confidence"  # which masks a sampling step reveals: confidence | random

    def check(self, prefix: str) -> None:
        if not 0.0 < self.eps < 1.0:
            raise ConfigError(f"{prefix}.eps={self.eps} must be in (0, 1): the lowest masking rate, e.g. 1e-3")
        if self.sample_steps <= 0:
            raise ConfigError(f"{prefix}.sample_steps={self.sample_steps} must be a positive integer")
        if self.remasking not in REMASKING:
            raise ConfigError(f"{prefix}.remasking={self.remasking!r} must be one of {', '.join(REMASKING)}")

    @property
    def loss_fn(self) -> Callable:
        return functools.partial(mdlm.loss_fn, eps=self.eps)

    @property
    def eval_sums(self) -> Callable:
        return functools.partial(mdlm.eval_sums, eps=self.eps)

    @property
    def generate(self) -> Callable:
        return functools.partial(sampling.unmask, steps=self.sample_steps, remasking=self.remasking)


OBJECTIVES = {"ar": AR, "mdlm": MDLM}


def check_vocab(objective, model_vocab: int, tokenizer_vocab: int) -> None:
    """An objective that needs ids past the tokenizer's (mdlm: the mask id, the vocabulary's last)
    finds room for them in the model's padded vocabulary, or a one-line ConfigError says how."""
    need = tokenizer_vocab + objective.extra_ids
    if model_vocab < need:
        raise ConfigError(f"objective={objective.name} needs {objective.extra_ids} id(s) past the tokenizer's "
                          f"{tokenizer_vocab} for [MASK], but model.vocab_size={model_vocab} has no room: set "
                          f"model.vocab_size={need} or more, or null (the tokenizer's ids padded to "
                          "model.vocab_multiple, with room)")


def as_dict(objective) -> dict:
    """The objective as its yaml writes it (`name` and knobs): what an export's config.json records."""
    return {"name": objective.name, **asdict(objective)}
