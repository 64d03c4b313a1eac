"""What the tests share besides fixtures: the tiny run overrides, a subprocess environment, the
config composer and the scripts loader. `from helpers import ...` (tests/ is on sys.path:
pyproject's [tool.pytest.ini_options] pythonpath; tests/sharded_step_check.py inserts it).

Importing this module sets the process's BLAS and XLA flags (below); tests/conftest.py imports it
first, so that happens before anything in the session imports jax.
"""

import copy
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

# NumPy references in tests call BLAS; on a 2-core machine its threads fight XLA's for cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The tests' tiny models spend their time compiling, not running. LLVM's optimisation of the CPU
# kernels XLA emits does not change what the programs compute (the HLO, its SPMD partitioning and
# its fusions are the same; golden losses agree well inside their tolerance), and at level 0 the
# suite's CPU time falls by about a third. XLA's newer MLIR fusion emitters cost most of what is
# left: every one of the hundreds of small programs a test compiles (eager ops, model inits, steps)
# pays their set-up. The classic emitters, with the module compiled in one piece (not split for
# parallel codegen, which on two busy cores only adds threads), compile the same fused HLO to
# kernels that compute the same bits: `python tests/test_golden.py` prints the default's table
# exactly, in 17 s of CPU instead of 45 s; and a gradient compiled in another program still equals
# the train step's bit for bit, which tests that recompute a step's values outside it rely on
# (with the split left on, both drift by an ulp). Benchmarks (bench/) and real runs keep the defaults.
# EQTRAIN_FAST_COMPILE=0 leaves XLA's defaults: a GPU session (bench/gpu_session.sh) runs another
# jaxlib, whose XLA may no longer know these CPU flags (an unknown flag aborts the process).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
                " --xla_cpu_parallel_codegen_split_count=1") if os.environ.get("EQTRAIN_FAST_COMPILE") != "0" else ""
# On a GPU, XLA's scatter-adds (an embedding's gradient) and some reductions use atomics: two runs of
# one program differ in the last bits, and the tests that compare runs bit for bit (a resume against
# the uninterrupted run, a precompiled step against a lazily compiled twin) failed on an H100
# (2026-11-27). Deterministic ops make them exact, as docs/checkpoints.md tells users to.
ON_CUDA = any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))
GPU_DETERMINISM = "--xla_gpu_deterministic_ops=true"
# The suite's XLA flags, this process's and every subprocess run's (helpers.offline_env).
SUITE_XLA_FLAGS = GPU_DETERMINISM if ON_CUDA else FAST_COMPILE
if SUITE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()

# float32's machine epsilon (np.finfo(np.float32).eps): one rounding errs by at most EPS32/2 of its result.
# Every numeric tolerance of the suite is a multiple of it at the compared values' scale.
EPS32 = 2.0**-23

# The optimizers whose per-optimizer cases the quick set (`pytest -m "not slow"`) runs: one of the
# Adam family and one matrix method. Every other optimizer's case is marked slow: the whole suite
# (CI's `.ci/run`) still runs each of them, with the same assertions.
QUICK_OPTIMIZERS = ("adamw", "muon")


def per_optimizer(cases) -> list:
    """pytest params of a per-optimizer test, each case an optimizer name or a tuple starting with
    one; marked slow unless that optimizer is in QUICK_OPTIMIZERS."""
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, marks=() if values[0] in QUICK_OPTIMIZERS else pytest.mark.slow))
    return params


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")

# A model small enough to compile and step in well under a second on a CPU core.
TINY_OVERRIDES = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=16",
    "model.vocab_size=64",
    "dataset.batch_size=8",
    "train.max_steps=20",
    "train.sample_tokens=0",
    "logging.sample_prompts=[]",
    "logging.log_callback_data=false",  # diagnostics double the compile time; their tests switch them on
    "logging.progress_bar=false",
)

# The model of end-to-end runs through `python train_jax.py` (byte tokens: vocab 257 -> 320).
CLI_TINY = (
    "model.dim=32",
    "model.num_heads=2",
    "model.num_blocks=2",
    "model.context_length=32",
    "dataset.batch_size=8",
    "train.max_val_steps=2",
    "logging.log_callback_data=false",  # compiled once, not twice; train_lm.sh's smoke run keeps them on
)


def offline_env(cache_dir) -> dict[str, str]:
    """os.environ for a subprocess run of train_jax.py: offline, W&B off, the session's caches
    (what conftest's _offline_env gives a test; a background run starts outside any test)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYDRA_FULL_ERROR", "SMOKE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", EQTRAIN_CACHE=str(cache_dir),
               XLA_FLAGS=SUITE_XLA_FLAGS)  # no forced device count: each run says how many devices it wants
    return env


def compose_config(*overrides: str):
    """conf/config.yaml composed with TINY_OVERRIDES then `overrides` (later ones win); a copy of
    its own, which the caller may change."""
    return copy.deepcopy(_composed(overrides))


@functools.cache
def _composed(overrides: tuple[str, ...]):
    """Hydra's composition takes ~0.1 s (it parses and merges every yaml again) and many tests ask
    for the same overrides; conf/ does not change during a session. Interpolations stay unresolved
    in the composed config (resolved when validated), so the test's environment still applies."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[*TINY_OVERRIDES, *overrides])


def load_script(name: str, folder: str = "scripts"):
    """<folder>/<name>.py (scripts/ or bench/: scripts, not packages) imported as a module, to call
    its functions and main(argv) in-process. Registered in sys.modules before it runs: its
    dataclasses look their module up while built. A bench script imports its neighbours by name."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(CONF_DIR), folder, f"{name}.py")
    if folder == "bench" and os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(f"_{folder}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def docs_command(page: str, start: str) -> list[str]:
    """The argv after `python scripts/X.py` of the one command in docs/<page> starting with `start`
    (its comment taken off), for a test that runs a documented command as typed."""
    import shlex

    with open(os.path.join(os.path.dirname(CONF_DIR), "docs", page), encoding="utf-8") as f:
        lines = [line.split(" # ")[0] for line in f.read().splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"docs/{page}: {len(lines)} commands start with {start!r} (the docs changed)"
    return shlex.split(lines[0])[2:]


def restore_item(path, target=None):
    """One orbax item of a checkpoint read back as saved (or laid out like `target`), its
    checkpointer closed at once: one left to the garbage collector tears down orbax's async machinery
    whenever that runs, inside whichever test."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        args = () if target is None else (target,)
        return checkpointer.restore(os.fspath(path), *args)


def item_metadata(path):
    """The saved tree's metadata (shapes, dtypes) of one orbax item, the checkpointer closed at once."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.metadata(os.fspath(path)).item_metadata


def adam_sqrt_v_rtol(b2: float, count) -> float:
    """rtol of Adam's bias-corrected √(ν/(1 − b2^t)) in float32 against float64 on the same ν. The
    correction 1 − b2^t subtracts from 1 a float32 b2^t off by t times b2's own rounding plus ~1 ulp
    (EPS32/2 below 1): a large part of 1 − b2^t ≈ t·(1 − b2) (b2 = 0.999: up to 7e-5 of it), halved by
    the square root. Plus the division and the square root (2 roundings, EPS32 together); 2x margin."""
    import numpy as np

    t = int(count)
    b2_rounding = abs(float(np.float32(b2)) - b2)
    return 2 * ((t * b2_rounding + EPS32 / 2) / (1 - b2**t) / 2 + EPS32)


def rounding_rtol(roundings: int, margin: float = 2) -> float:
    """rtol of a float32 result `roundings` elementwise operations deep (a product, a quotient, an
    exp, a conversion from float64: each a correctly rounded or ~1-ulp operation) against float64:
    each rounding errs by at most EPS32/2 relative and first-order errors add; times `margin`."""
    return margin * roundings * EPS32 / 2


def sum_atol(n: int, scale, margin: float = 2, lam: float | None = None):
    """atol of a float32 sum (or dot product) of `n` terms against float64, `scale` the sum of the
    terms' magnitudes (Σ|xᵢ·yᵢ|; n·max|term| bounds it): recursive summation in any order errs by at
    most γ_(n-1) ≈ (n − 1)·u·Σ|terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    eq. 3.5; u = EPS32/2 the unit roundoff), a dot product's products add one rounding each, and the
    float32 inputs' own rounding (if made from float64) another: (n + 1)·u·scale; times `margin`.
    Any summation order (pairwise, blocked, another CPU's vector width) stays inside it.

    `lam`: the probabilistic bound instead, for long sums where the worst case says nothing: with
    rounding errors independent and mean-zero, |error| <= λ·√n·u·Σ|terms| (to first order) with
    probability at least 1 − 2n·exp(−λ²(1 − u)²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019,
    Theorem 2.4); λ = 10: a failure chance below 1e-15 for n up to 1e6."""
    if lam is not None:
        return margin * lam * (n + 1) ** 0.5 * EPS32 / 2 * scale
    return margin * (n + 1) * EPS32 / 2 * scale


def orthogonality_atol(n: int, cond=1.0, margin: float = 2):
    """atol of the entries of QᵀQ − I for a float32 Q with n rows from Householder QR or a symmetric
    eigensolver: both return columns orthonormal to working precision, ~p(n)·EPS32 with p(n) a
    modest function of n (Golub & Van Loan, Matrix Computations, 4th ed., §5.2.2; LAPACK Users'
    Guide §4.7.1); p(n) = n here (the inner products and the reflector applications sum n terms).
    Columns computed from others through a matrix of condition number `cond` (a QR or solve against
    it, a projection onto its span) lose orthogonality to the rest by that factor: first-order
    perturbation theory, an error δ in the matrix moves its Q by ~δ·cond. Times `margin`."""
    return margin * n * EPS32 * cond


def eigvalsh_atol(n: int, norm, margin: float = 2):
    """atol of the eigenvalues from a float32 symmetric eigensolver of an n×n matrix of 2-norm `norm`
    (its largest |λ|), against float64 on the same float32 matrix: the solver is backward stable (the
    exact eigenvalues of S + E, ‖E‖ <= p(n)·EPS32·‖S‖: LAPACK Users' Guide §4.7.1), so by Weyl's
    inequality each eigenvalue moves by at most ‖E‖, however close they are; p(n) = n as in
    orthogonality_atol. Times `margin`."""
    return margin * n * EPS32 * norm


def optimizer_update(tx, grads, state, params, hparams=None):
    """`tx.update(grads, state, params)` of an optimizer built from `hparams` (make_optimizer), for
    tests that step one without an objective. An optimizer whose update reads a Hessian-diagonal
    estimate (`hparams.hessian_due(state)` not None: Sophia; the train step computes it from the
    loss, trainer/step.py) gets `hessian_diag=|grads|`: a stand-in, >= 0 and different per
    coordinate, so a group reading another's leaves would show, passed on every step (the update
    reads it only on the steps hessian_due says, as it reads the step's)."""
    import jax
    import jax.numpy as jnp

    if hparams is None or hparams.hessian_due(state) is None:
        return tx.update(grads, state, params)
    return tx.update(grads, state, params, hessian_diag=jax.tree.map(jnp.abs, grads))


def run_updates(tx, grads_seq):
    """An optax transform's jitted init + updates over a list of gradient trees -> (the updates as
    NumPy, the states after each update): the optimizer tests' way of stepping one on its own."""
    import jax
    import numpy as np

    state = jax.jit(tx.init)(grads_seq[0])
    update = jax.jit(tx.update)
    outs, states = [], []
    for g in grads_seq:
        u, state = update(g, state)
        outs.append(jax.tree.map(np.asarray, u))
        states.append(state)
    return outs, states


def trained_params(tx, params, grads_seq):
    """`params` after tx's init and one update per gradient tree of `grads_seq`, in one jitted
    program, as NumPy: the parity tests' way of stepping ours beside a reference."""
    import jax
    import numpy as np
    import optax

    @jax.jit
    def run(p, grads):
        state = tx.init(p)
        for g in grads:
            u, state = tx.update(g, state, p)
            p = optax.apply_updates(p, u)
        return p

    return jax.tree.map(np.asarray, run(params, grads_seq))


def random_grads(shapes: dict, steps: int, seed=0):
    """`steps` gradient trees {name: float32 normal array of shape}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BackgroundProcess:
    """A background set-up's handle (tests/background.py) over one subprocess `self.proc` (None: nothing started)."""

    proc: subprocess.Popen | None = None

    def wait(self) -> None:
        if self.proc is not None:
            self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ShardedCheck(BackgroundProcess):
    """tests/sharded_step_check.py (with `args`: its --moe / --model modes) started as a background
    set-up (tests/background.py): its half minute and more of XLA compiling overlaps the in-process
    tests instead of following them. `result()` is its JSON line."""

    def __init__(self, where, cache_dir, args: tuple[str, ...] = ()):
        self._out, self._err = where / "sharded.stdout", where / "sharded.stderr"
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",  # the script adds level 0
               "JAX_PLATFORMS": "cpu",
               "EQTRAIN_CACHE": str(cache_dir)}
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "sharded_step_check.py"), *args],
                                         cwd=REPO, env=env, stdout=out, stderr=err, text=True)

    def result(self) -> dict:
        try:
            code = self.proc.wait(600)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail("tests/sharded_step_check.py did not finish within 600 s")
        assert code == 0, self._err.read_text()[-4000:]
        return json.loads(self._out.read_text().strip().splitlines()[-1])


def logits_atol(cfg, logits, margin: float = 4) -> float:
    """atol of a GPT's (or Llama's) float32 logits computed in two programs (other shapes, fusions,
    summation orders, or rows elsewhere in a batch): the longest sums feeding a logit are the MLP's
    (mlp_ratio·dim terms; a Llama's SwiGLU width, `mlp_width`), once per block and once more in the
    head; counted as one sum of n = width·(num_blocks + 1) terms at the logits' scale, each side errs
    by at most (n + 1)·u·max|logits| (sum_atol's worst case, u = EPS32/2). Margin 4: the two sides, times 2."""
    import numpy as np

    width = cfg.mlp_width if hasattr(cfg, "mlp_width") else cfg.mlp_ratio * cfg.dim
    n = width * (cfg.num_blocks + 1)
    return sum_atol(n, float(np.abs(logits).max()), margin)


def mean_loss_atol(cfg, logits, loss: float, count: int, margin: float = 4) -> float:
    """atol of the mean of `count` tokens' losses logsumexp(logits) − logit_target (`loss` its value,
    `logits` one side's) computed in two float32 programs: a token's loss moves by its two logits'
    error (2·logits_atol) plus its logsumexp's own rounding, m + log Σ exp(l − m): V exps of at most 1
    summed (a relative error of (V + 1)·u, absolute after the log) and the log, the add and the
    subtraction (u·max(1, |value|) each): sum_atol(V + 3, max(1, max|logsumexp|)); the mean of `count`
    nonnegative losses in one float32 sum (sum_atol(count, loss)). Margin 4: two sides, times 2."""
    import numpy as np

    l64 = np.asarray(logits, np.float64)
    m = l64.max(-1, keepdims=True)
    lse = float(np.abs(m + np.log(np.exp(l64 - m).sum(-1, keepdims=True))).max())
    return (2 * logits_atol(cfg, logits, margin) + sum_atol(l64.shape[-1] + 3, max(1.0, lse), margin)
            + sum_atol(count, loss, margin))


def evaluated_steps(train_cfg, start: int = 0) -> list[int]:
    """The steps after `start` at which train_jax evaluates a run of `train_cfg` (the composed
    `train` section): every val_freq steps, each of val_at, and max_steps. Stand-in trainers log there."""
    t = train_cfg
    steps = {*range(t.val_freq, t.max_steps + 1, t.val_freq), *t.get("val_at", ()), t.max_steps}
    return sorted(s for s in steps if s > start)


def random_hf_model(model_type: str, **config):
    """A random transformers model of `config` (eager attention, float32, eval mode), every parameter
    then moved by 0.2·N(0, 1) (torch seed 0), so no weight keeps its init's special value (zero biases,
    unit norm gains) and a tensor mapped to the wrong place changes the logits. Needs torch."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def hf_logits(model, tokens_BxT):
    """A transformers model's float32 logits (numpy) for integer tokens (B, T)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(tokens_BxT, dtype=torch.long)).logits.float().numpy()


def learnable_losses(run, steps: int = 30, weights: list | None = None) -> tuple[list[float], dict]:
    """(train/loss per step, the last step's metrics) of `run` (a validated RunConfig) trained
    `steps` steps on one fixed batch with a learnable pattern (the next token is the current one
    plus one, vocab 64, 8 rows of 17), on one device: the every-optimizer "it learns" check.
    `weights`: a list to which the model's arrays before the first step and after the last are
    appended (as NumPy: the step donates its input)."""
    import equinox as eqx
    import jax
    import numpy as np

    import train_jax
    from utils.parallel import mesh as meshlib

    mesh = meshlib.make_mesh(1, 1, run.dataset.batch_size, devices=jax.devices()[:1])
    _, _, state, step = train_jax.init_training(run, mesh)
    batch = np.random.default_rng(0).integers(0, 64, (1, 8, 17), dtype=np.int32)
    batch[..., 1:] = (batch[..., :1] + np.arange(1, 17)) % 64
    placed = meshlib.put_batch(batch, meshlib.batch_sharding(mesh, 1))
    losses = []
    snapshot = lambda: jax.tree.map(np.array, eqx.filter(state.model, eqx.is_array))  # copies: the step donates
    if weights is not None:
        weights.append(snapshot())
    for _ in range(steps):
        state, metrics = step(state, placed)
        losses.append(float(metrics["train/loss"]))
    if weights is not None:
        weights.append(snapshot())
    return losses, metrics


def perturbed(model, scale: float = 0.2, seed: int = 1):
    """`model` with every float array moved by scale·N(0, 1) (float32): no gain or bias keeps a value
    (1, 0) that a lower precision holds exactly, and a zero-initialised factor becomes nonzero."""
    import equinox as eqx
    import jax
    import numpy as np

    arrays, rest = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(arrays)
    rng = np.random.default_rng(seed)
    moved = [np.asarray(x) + np.float32(scale) * rng.standard_normal(x.shape, np.float32) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, moved), rest)


def check_bool_knob(tiny_run, knob: str, optimizer: str) -> None:
    """A boolean optimizer knob (optimizer.<knob>): off by default, on when set, a non-bool refused in one
    line naming it, and a checkpoint's config saved before it existed reading it as off."""
    from utils.config import to_dict, validate
    from utils.errors import ConfigError

    assert getattr(tiny_run().optimizer, knob) is False
    assert getattr(tiny_run(f"optimizer={optimizer}", f"optimizer.{knob}=true").optimizer, knob) is True
    with pytest.raises(ConfigError, match=rf"optimizer\.{knob}='often' must be .*bool"):
        tiny_run(f"optimizer.{knob}=often")
    raw = to_dict(compose_config())
    del raw["optimizer"][knob]  # a checkpoint's config saved before the knob existed
    assert getattr(validate(raw).optimizer, knob) is False


def with_old_names(config: dict) -> dict:
    """`config` (a plain config dict) as an eqtrain from before optimizer/renames.py's renames saved it:
    its optimizer's knobs (and group overrides) under their old names, and a knob split off a shared
    one (FILLS: MARS's adam_eps) absent. Derived from the table, so a new rename is covered at once."""
    from optimizer.renames import FILLS, renamed_pairs

    node = copy.deepcopy(config["optimizer"])
    name = node["name"]
    for new in FILLS.get(name, {}):
        node.pop(new, None)
    for group, old, new in renamed_pairs(name):
        if group is None and new in node:
            node[old] = node.pop(new)
        for g, knobs in (node.get("groups") or {}).items():
            if knobs and new in knobs and group in (None, g):
                knobs[old] = knobs.pop(new)
    return {**config, "optimizer": node}


def train_on_own_source(tmp, cache_dir, *overrides: str) -> None:
    """Train `overrides` (which set checkpoint.save_path, relative) in-process in the folder `tmp`, on a
    corpus of this repo's models/*.py (one .jsonl line per 8 non-blank lines: tokenizing the stdlib
    default would cost more than the tests that use it), with the session's tokenized-corpus cache:
    the tiny checkpoint the export tests read. A module fixture's own environment (_offline_env is per test)."""
    import train_jax  # here: helpers is imported before jax's flags are set

    lines = [line for f in sorted(Path(REPO, "models").glob("*.py")) for line in f.read_text().splitlines()
             if line.strip()]
    (Path(tmp) / "corpus.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 8])}) + "\n"
                                                    for i in range(0, len(lines), 8)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EQTRAIN_CACHE", str(cache_dir))
        mp.setenv("WANDB_MODE", "disabled")
        mp.chdir(tmp)  # paths relative to the working directory, as the docs write them
        (Path(tmp) / "run").mkdir()
        train_jax.train(compose_config(*overrides, "dataset.paths=[corpus.jsonl]"), str(Path(tmp) / "run"))
