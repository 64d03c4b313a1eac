"""Errors a user can act on.

Every message names the knob or file at fault and the fix; `train_jax.main` prints it as one
line and exits non-zero, so a bad run never ends in a JAX traceback.
"""


class EqtrainError(Exception):
    """Base class: an error caused by input the user controls."""


class ConfigError(EqtrainError):
    """A config knob has a bad value or a bad combination with another knob."""


class DataError(EqtrainError):
    """A dataset path, file or tokenizer cannot produce the training data asked for."""


class CheckpointError(EqtrainError):
    """A checkpoint is missing, incomplete or does not match the run."""


class TrainingError(EqtrainError):
    """Training cannot usefully go on (the loss became NaN or infinite)."""
