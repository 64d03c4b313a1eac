"""`logging.*`'s flags of the aux-state hook (trainer/aux_state.py computes what they ask for).
Plain configuration, so the logging config that holds it (utils/logging/sinks) needs nothing
from the trainer above it."""

from __future__ import annotations

from dataclasses import dataclass

from utils.errors import ConfigError


@dataclass(frozen=True)
class AuxConfig:
    """The `logging.*` flags of the aux-state hook (trainit's names for them)."""

    log_callback_data: bool = True  # false: no diagnostics, no buffers
    store_last_params: bool = True  # keep x(n-1): 1 parameter copy
    store_last_grads: bool = True  # keep g(n-1): 1 parameter copy
    store_past_grads: bool = True  # keep the sum of g(1..n-1): 1 parameter copy
    compute_last_loss: bool = False  # f(x(n-1), z(n)): one extra forward per step
    compute_last_grads: bool = False  # grad f(x(n-1), z(n)): one extra forward and backward per step
    per_layer: bool = False  # norms per block (logging steps only)
    optim_diagnostics: bool = True  # the optimizer's own optim/<group>/... metrics (logging steps only)

    def check(self, prefix: str) -> None:
        if not self.log_callback_data:
            return  # every flag below is moot: nothing is computed
        for flag in ("compute_last_loss", "compute_last_grads"):
            if getattr(self, flag) and not self.store_last_params:
                raise ConfigError(f"{prefix}.{flag}=true evaluates at x(n-1), which only {prefix}.store_last_params "
                                  f"keeps: set {prefix}.store_last_params=true or {prefix}.{flag}=false")

    @property
    def on(self) -> bool:
        return self.log_callback_data

    @property
    def needs_last_point(self) -> bool:
        """The step evaluates the loss at x(n-1) on this step's batch."""
        return self.on and (self.compute_last_loss or self.compute_last_grads)

    @property
    def sum_names(self) -> tuple[str, ...]:
        names: list[str] = []
        if self.store_last_params:
            names += ["update/<gn, xn-x(n-1)>_sum", "update/<gn, Delta(n)>_sum"]
            if self.store_last_grads:
                names.append("update/<g(n-1), Delta(n)>_sum")
            if self.compute_last_loss or self.compute_last_grads:
                names.append("loss/fn-f(n-1)_sum")
        return tuple(names) if self.on else ()

    def buffer_copies(self) -> int:
        """Parameter-sized buffers the state carries (docs/metrics.md's memory figure)."""
        return (self.store_last_params + self.store_last_grads + self.store_past_grads) if self.on else 0
