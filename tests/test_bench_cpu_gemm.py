"""bench/cpu_gemm.py times the three products of a training step's matmul: its forward and the two
gradients that JAX's own autodiff computes for it (checked here against jax.vjp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import load_script

cpu_gemm = load_script("cpu_gemm", "bench")


def test_products_are_the_forward_and_its_two_gradients():
    m, k, n = 8, 4, 6  # distinct sizes, so each operand's shape names it
    rng = np.random.default_rng(0)
    arrays = {(m, k): rng.standard_normal((m, k)), (k, n): rng.standard_normal((k, n)),
              (m, n): rng.standard_normal((m, n))}
    x_MxK, w_KxN, dy_MxN = arrays[(m, k)], arrays[(k, n)], arrays[(m, n)]
    y, vjp = jax.vjp(lambda x, w: x @ w, jnp.float32(x_MxK), jnp.float32(w_KxN))
    dx, dw = vjp(jnp.float32(dy_MxN))
    for product, want in zip(cpu_gemm.PRODUCTS, (y, dx, dw)):
        a, b, f = cpu_gemm._operands(m, k, n, product, lambda *shape: arrays[shape])
        # The bench's products in float64 against JAX's float32 ones: f32 eps 1.2e-7 × ≤ 6 accumulated
        # terms of magnitude ≤ ~10 (standard normals' products summed) × margin 10 ≈ 1e-4 absolute.
        np.testing.assert_allclose(f(a, b), np.asarray(want), atol=1e-4, err_msg=product)
