# Sourced by scripts/train_lm.sh and scripts/slurm/train.sbatch: adds XLA's recommended GPU flags
# (docs/performance.md, "XLA flags on GPUs") to XLA_FLAGS when the run is on an NVIDIA GPU, never on
# a CPU: there they change nothing but XLA_FLAGS, which keys the compilation cache and the cached CPU
# peak (trainer/flops.py), so a CPU run would miss the entries of runs started without them.
#   EQTRAIN_GPU_FLAGS=auto (default: when `nvidia-smi -L` lists a GPU) | 1 (always: a GPU that
#   nvidia-smi cannot see, e.g. in some containers) | 0 (never)
# A flag already in the user's XLA_FLAGS keeps the user's value; their other flags stay as they are.

EQTRAIN_XLA_GPU_FLAGS=(
  --xla_gpu_enable_latency_hiding_scheduler=true  # overlap collectives (and async copies) with compute
)

eqtrain_xla_gpu_flags() {
  local mode=${EQTRAIN_GPU_FLAGS:-auto} flag
  case $mode in
    0) return 0 ;;
    1) ;;
    auto) nvidia-smi -L >/dev/null 2>&1 || return 0 ;;
    *) echo "EQTRAIN_GPU_FLAGS=$mode: use auto (GPU flags when nvidia-smi lists a GPU), 1 (always) or 0 (never)" >&2
       return 2 ;;
  esac
  for flag in "${EQTRAIN_XLA_GPU_FLAGS[@]}"; do
    case " ${XLA_FLAGS:-} " in
      *" ${flag%%=*}="* | *" ${flag%%=*} "*) ;;  # the user's own setting wins
      *) XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flag" ;;
    esac
  done
  export XLA_FLAGS
}
