"""XLA:CPU bug (jaxlib 0.10.2): a vmapped backward pass through a LayerNorm in lax.scan gives wrong rows
past 32768 batched elements (here cotangents 128..255). Pure JAX, no eqtrain. Prints the largest
|vmap - loop| (rounding, ~1e-7, where correct). XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce
fixes it (docs/performance.md, "Vmapped backward passes on XLA:CPU")."""
import jax
import jax.numpy as jnp

B, T, D, N = 2, 8, 16, 256  # N cotangents: N·B·T·D = 65536 batched elements, twice the 32768 where it breaks
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
w_1xDxD, x_BxTxD = jax.random.normal(k1, (1, D, D)) / 4, jax.random.normal(k2, (B, T, D))
gain_1xD = 1 + jax.random.normal(k3, (1, D)) / 4


def block(x, w_and_gain):  # a residual block: LayerNorm with a gain, a matmul, tanh
    w, gain = w_and_gain
    xc = x - x.mean(-1, keepdims=True)
    h = xc * jax.lax.rsqrt(jnp.square(xc).mean(-1, keepdims=True) + 1e-5) * gain
    return x + jnp.tanh(h @ w), None


y, vjp = jax.vjp(lambda x: jax.lax.scan(block, x, (w_1xDxD, gain_1xD))[0], x_BxTxD)
cotangents = jnp.eye(y.size)[:N].reshape(N, *y.shape)  # rows of the Jacobian, as jax.jacrev asks for them
batched = jax.vmap(vjp)(cotangents)[0]
looped = jnp.stack([vjp(c)[0] for c in cotangents])
bad = jnp.nonzero(jnp.abs(batched - looped).max((1, 2, 3)) > 1e-3)[0]  # far above float32 rounding of O(1) values
print(f"jax {jax.__version__}: max |vmap(vjp) - loop of vjp| = {float(jnp.abs(batched - looped).max()):.3g} "
      f"(max |grad| {float(jnp.abs(looped).max()):.3g}); wrong cotangents: {bad.tolist()[:1] + bad.tolist()[-1:]}")
