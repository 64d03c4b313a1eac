#!/usr/bin/env bash
# What a session on one NVIDIA GPU runs, in two phases that each fit a short lease, every step
# limited in time and logged to its own file under OUT (default ./gpu_logs), so a step that fails
# or runs out of time still leaves the others' figures:
#
#   bash bench/gpu_session.sh tests     # versions, the GPU tier (pytest -m gpu and the attention tests)
#   bash bench/gpu_session.sh speed     # step speed and MFU: GPT-2 124M against PyTorch, Llama 124M and 1B
#   bash bench/gpu_session.sh costs     # the optimizer cost table, async checkpoints
#   bash bench/gpu_session.sh optimizers  # the optimizer cost table alone
#   bash bench/gpu_session.sh quick     # the quick set (pytest -m "not slow") on the GPU
#   bash bench/gpu_session.sh profile   # where GPT-2 124M's step spends its time (kernels, GPU idle), trace kept
#   bash bench/gpu_session.sh variants  # GPT-2 124M's step under each execution knob (remat, scan, XLA flags)
#
# OPTIMIZERS=sgdm,muon limits the optimizer table to those; COSTS_LIMIT and QUICK_LIMIT (seconds)
# bound it and the quick set.
#
# Where the machine lacks our dependencies (a GPU image with JAX and PyTorch but not hydra-core, say),
# put their wheels in .whl/ (bench/gpu_wheels.txt lists them and the command that fetches them) and
# they are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 EQTRAIN_FAST_COMPILE=0 HF_HUB_OFFLINE=1 WANDB_MODE=disabled EQTRAIN_CACHE=/tmp/eqtrain_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
. scripts/xla_gpu_flags.sh && eqtrain_xla_gpu_flags  # the flags scripts/train_lm.sh gives a GPU run
GPT2=(model=gpt2_124m tokenizer=byte model.vocab_size=50304 train.compute_dtype=bfloat16)  # GPT-2's padded vocab

step() {  # step NAME SECONDS COMMAND...: run it, log to OUT/NAME.log, say how it ended and how long it took
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

for phase in "${@:-tests}"; do case $phase in
  tests)
    step env 60 bash -c 'nvidia-smi -L; echo "XLA_FLAGS=$XLA_FLAGS"; python3 -c "
import jax, jaxlib, optax, equinox, orbax.checkpoint as o, torch, transformers, hydra
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"optax\", optax.__version__, \"equinox\", equinox.__version__,
      \"orbax\", o.__version__, \"torch\", torch.__version__, \"transformers\", transformers.__version__, \"hydra\", hydra.__version__)
print(jax.devices(), jax.devices()[0].device_kind, getattr(jax.devices()[0], \"compute_capability\", None))
import jax.numpy as jnp
a = jax.random.normal(jax.random.key(0), (1024, 1024)); b = a @ a
print(\"f32 matmul default precision rel err vs highest:\", float(jnp.abs(b - jnp.matmul(a, a, precision=\"highest\")).max() / jnp.abs(b).max()))
"'
    step gpu_tier 120 python3 -m pytest -p no:cacheprovider -q -s tests/test_gpu.py tests/test_gpu_lowering.py tests/test_attention.py
    ;;
  speed)  # JAX takes 75% of the GPU at start unless told otherwise; the PyTorch side of the pairs needs room
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 step gpt2_pairs 200 python3 bench/step_speed.py "${GPT2[@]}" \
      dataset.batch_size=16 --pairs 3 --k 5
    step gpt2_b32 90 python3 bench/step_speed.py "${GPT2[@]}" dataset.batch_size=32 --data synthetic --steps 10
    step llama_124m 90 python3 bench/step_speed.py model=llama_124m tokenizer=byte train.compute_dtype=bfloat16 \
      model.vocab_size=32768 dataset.batch_size=32 --data synthetic --steps 10
    step llama_1b 100 python3 bench/step_speed.py model=llama_1b tokenizer=byte train.compute_dtype=bfloat16 \
      model.vocab_size=32768 dataset.batch_size=8 --data synthetic --steps 6
    ;;
  costs|optimizers)  # optimizers: the optimizer table alone
    step optimizer_cost "${COSTS_LIMIT:-200}" python3 bench/optimizer_cost.py "${GPT2[@]}" dataset.batch_size=16 \
      --steps 5 ${OPTIMIZERS:+--optimizers "$OPTIMIZERS"}
    [ "$phase" = costs ] && step checkpoint 100 python3 bench/checkpoint_speed.py "${GPT2[@]}" dataset.batch_size=16 dataset.context_length=1024
    ;;
  attention)  # the attention tests alone (float32 ones at full precision, CPU-only ones skipped)
    step attention 90 python3 -m pytest -p no:cacheprovider -q tests/test_attention.py
    ;;
  quick)  # the quick set on the GPU (float32 tests run at full float32 precision: tests/conftest.py);
    # -v: each test's result is in the log as it ends, so a run cut short still says what passed
    per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=120)  # where pytest-timeout is installed
    XLA_PYTHON_CLIENT_PREALLOCATE=false step quick_set "${QUICK_LIMIT:-300}" python3 -m pytest -p no:cacheprovider \
      -v -m "not slow" -n "${QUICK_WORKERS:-12}" --maxfail=100 $per_test
    grep -E "(FAILED|ERROR) " "$OUT/quick_set.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort | uniq | head -80
    ;;
  profile)  # the kernels of GPT-2 124M's plain step, by kind, source line and speed; trace and HLO kept
    step profile_gpt2 150 python3 bench/step_profile.py "${GPT2[@]}" dataset.batch_size=16 --steps 3 --top 30 \
      --save "$OUT/profile_gpt2"
    ;;
  variants)  # one process per variant, synthetic batches, 10 timed steps each; a table at the end
    variant() {  # variant NAME [XLA flag] -- OVERRIDES...
      local name=$1 flags=$2; shift 3
      XLA_FLAGS="$XLA_FLAGS $flags" step "variant_$name" 75 python3 bench/step_speed.py "${GPT2[@]}" \
        --data synthetic --steps 10 "$@"
    }
    variant base "" -- dataset.batch_size=16
    variant remat_none "" -- dataset.batch_size=16 model.remat=none
    variant unrolled "" -- dataset.batch_size=16 model.scan_blocks=false
    variant unrolled_remat_none "" -- dataset.batch_size=16 model.scan_blocks=false model.remat=none
    variant triton_gemm_any --xla_gpu_triton_gemm_any=true -- dataset.batch_size=16
    variant remat_none_b32 "" -- dataset.batch_size=32 model.remat=none
    echo "=== variants (GPT-2 124M, bf16, T=1024):"
    for f in "$OUT"/variant_*.log; do
      printf '%-28s %s\n' "$(basename "$f" .log)" "$(grep -E 'synthetic:|compile \(first' "$f" | tr '\n' ' ')"
    done
    ;;
  *) echo "usage: bash bench/gpu_session.sh [tests] [speed] [costs] [optimizers] [attention] [quick] [profile] [variants]" >&2
     exit 2 ;;
esac; done
