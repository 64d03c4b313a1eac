#!/usr/bin/env bash
# The documented example: GPT-2 124M + AdamW + cosine schedule. Edit the knobs below or append
# more Hydra overrides on the command line:  bash scripts/train_lm.sh train.max_steps=100
# SMOKE=1 bash scripts/train_lm.sh   runs the same recipe on a tiny model for a few steps (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

model=gpt2_124m
tokenizer=byte             # tokenizer=hf tokenizer.name_or_path=gpt2 for GPT-2's own (needs its files)
batch_size=8               # per micro-batch, all devices together
total_batch_size=32        # per optimizer step: gradient accumulation = total / batch
lr=6e-4
warmup=200
max_steps=5000
compute_dtype=bfloat16     # float32 on CPU (bf16 is not faster there)
scan_blocks=false          # blocks unrolled, nothing recomputed in the backward: GPT-2 124M's H100 step
remat=none                 # took 48.9 ms against 58.3 ms with scan + remat=dots (docs/performance.md)
log_every=10
val_freq=500
save=true                  # checkpoints every save_steps; rerunning this script continues the run
save_path=ckpt/gpt2_124m   # (checkpoint.resume=auto); SLURM: requeue when it exits with code 3
save_steps=1000
resume=auto

if [[ "${SMOKE:-0}" == "1" ]]; then
  model=gpt_tiny; batch_size=8; total_batch_size=16; warmup=5; max_steps=20; compute_dtype=float32; val_freq=10
  save=false; resume=null
elif ! python -c "import jax,sys; sys.exit(jax.devices()[0].platform == 'cpu')"; then
  compute_dtype=float32
fi
source scripts/xla_gpu_flags.sh  # XLA's recommended GPU flags, on an NVIDIA GPU only (docs/performance.md)
eqtrain_xla_gpu_flags            # EQTRAIN_GPU_FLAGS=0 leaves XLA_FLAGS alone; your own XLA_FLAGS are kept

# exec: python replaces this shell, so the signal SLURM sends the batch shell before a time limit
# (#SBATCH --signal=B:USR1@120) reaches the trainer, which saves and exits 3 (requeue it).
exec python train_jax.py \
  model=$model \
  model.scan_blocks=$scan_blocks \
  model.remat=$remat \
  tokenizer=$tokenizer \
  optimizer=adamw \
  optimizer/lr_config=cosine \
  optimizer.lr_config.lr=$lr \
  optimizer.lr_config.warmup=$warmup \
  optimizer.lr_config.max_steps=null \
  optimizer.weight_decay=0.1 \
  train.max_steps=$max_steps \
  train.gradient_clip_val=1.0 \
  train.compute_dtype=$compute_dtype \
  train.val_freq=$val_freq \
  dataset.batch_size=$batch_size \
  dataset.total_batch_size=$total_batch_size \
  logging.log_every=$log_every \
  checkpoint.save=$save \
  checkpoint.save_path=$save_path \
  checkpoint.save_steps=$save_steps \
  checkpoint.resume=$resume \
  "$@"
