"""XLA:CPU's vmapped-gradient workaround, as a flag (no JAX import: it must be set before JAX starts).

jaxlib 0.10.2's YNNPACK reduce fusion miscomputes vmapped backward passes past 32,768 batched
elements (docs/performance.md, "Vmapped backward passes on XLA:CPU"); this flag sends reductions
back to XLA's own emitters. Packed runs (trainer/pack.py) are vmapped train steps: they need it.
"""

from __future__ import annotations

from typing import Mapping

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def has_ynn_flag(environ: Mapping[str, str]) -> bool:
    return YNN_FLAG in environ.get("XLA_FLAGS", "").split()


def with_ynn_flag(environ: Mapping[str, str]) -> str:
    """XLA_FLAGS with YNN_FLAG appended (the user's flags kept before it)."""
    flags = environ.get("XLA_FLAGS", "")
    return flags if has_ynn_flag(environ) else f"{flags} {YNN_FLAG}".strip()
