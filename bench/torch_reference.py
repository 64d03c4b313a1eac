"""PyTorch eager reference for bench/step_speed.py: the same GPT as `model=gpt_bench`, hand-written.

    pip install -e ".[dev,parity]"           # or torch==2.13.0 numpy alone: nothing from this repo is imported
    python bench/torch_reference.py [--steps 10] [--warmup 2] [--compile]

`build_step` is what `bench/step_speed.py --pairs N` imports to alternate this step with eqtrain's
in one process (any GPT shape; CUDA when the tensors go there).

GPT-2 style: vocab 512, context 256, dim 384, 6 heads, 6 blocks, MLP x4, tanh GELU, pre-LayerNorm,
biases, learned positions, tied head, no dropout, GPT-2 init. One step = forward + cross-entropy +
backward + clip_grad_norm_(1.0) + AdamW (decay on block matrices only, as eqtrain), float32,
batch 16 x 257 random tokens. The peak for MFU is a float32 2048x2048 torch.mm (best of 5) measured
just before, as eqtrain measures its CPU peak with XLA. MFU(6N): N = every parameter (eqtrain's
count_params); MFU(6N+attn): eqtrain's flops_per_token. torch eager on CPU is synchronous, so
wall-clock around each step is the step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, T, D, H, L, MLP, B = 512, 256, 384, 6, 6, 4, 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """The GPT's shape and batch; the defaults are `model=gpt_bench dataset.batch_size=16`."""

    vocab: int = V
    context: int = T
    dim: int = D
    heads: int = H
    blocks: int = L
    mlp: int = MLP
    batch: int = B


class Block(nn.Module):
    def __init__(self, s: Shape = Shape()):
        super().__init__()
        self.heads = s.heads
        self.ln1, self.ln2 = nn.LayerNorm(s.dim), nn.LayerNorm(s.dim)
        self.qkv, self.proj = nn.Linear(s.dim, 3 * s.dim), nn.Linear(s.dim, s.dim)
        self.fc, self.out = nn.Linear(s.dim, s.mlp * s.dim), nn.Linear(s.mlp * s.dim, s.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, s: Shape = Shape()):
        super().__init__()
        self.wte = nn.Parameter(torch.empty(s.vocab, s.dim))
        self.wpe = nn.Parameter(torch.empty(s.context, s.dim))
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.blocks))
        self.ln_f = nn.LayerNorm(s.dim)
        for name, p in self.named_parameters():  # GPT-2 init; LayerNorm stays ones/zeros
            if p.dim() == 2:
                resid = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * s.blocks) if resid else 0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens):
        x = self.wte[tokens] + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.T  # tied head


def flops_per_step(s: Shape) -> float:
    """eqtrain's flops_per_token (6N of the matmuls + attention) times the tokens of one step."""
    per_token = 6.0 * (s.blocks * 12 * s.dim * s.dim + s.dim * s.vocab) + 12.0 * s.blocks * s.dim * s.context
    return per_token * s.batch * s.context


AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16}  # eqtrain's train.compute_dtype -> torch's autocast


def build_step(s: Shape = Shape(), compile: bool = False, device: str = "cpu", dtype: str = "float32"):
    """(step, n_params): `step()` runs one full training step on a fixed random batch and returns
    the loss as a Python float, which waits for the device (the step's end on CUDA too).

    `dtype` is the compute dtype, as eqtrain's `train.compute_dtype`: "bfloat16" runs the forward
    and the loss under torch.autocast (matmuls and attention in bf16, weights, gradients and AdamW
    in float32), the usual mixed precision to compare eqtrain's bf16 step with on a GPU."""
    if dtype not in AUTOCAST:
        raise ValueError(f"dtype={dtype!r}: the PyTorch reference runs {' or '.join(AUTOCAST)} "
                         "(float16 would need a GradScaler, as eqtrain's loss scale)")
    torch.manual_seed(0)
    model = GPT(s).to(device)
    decay = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if not (n.startswith("blocks") and p.dim() == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)  # fused: ~2x foreach on CPU
    forward = torch.compile(model) if compile else model
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, s.vocab, (s.batch, s.context + 1), generator=gen, dtype=torch.int64).to(device)

    def step():
        with torch.autocast(device_type=device, dtype=AUTOCAST[dtype] or torch.float32, enabled=bool(AUTOCAST[dtype])):
            logits = forward(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, s.vocab).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    return step, sum(p.numel() for p in model.parameters())


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    a = torch.ones(n, n)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (inductor, CPU)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    shape = Shape()
    step, n_params = build_step(shape, compile=args.compile)
    tokens = shape.batch * shape.context
    flops_6n = 6 * n_params * tokens
    flops_full = flops_per_step(shape)
    peak = matmul_peak()
    print(f"devices: 1 x cpu ({os.cpu_count()} threads) | peak {peak / 1e9:,.0f} GFLOP/s (torch.mm 2048) "
          f"| params {n_params / 1e6:.2f}M | tokens/step {tokens:,} | float32 | torch {torch.__version__} "
          f"{'compile' if args.compile else 'eager'}")

    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    compile_txt = f"{first_s:6.2f} s" if args.compile else "   n/a  "
    print(f"synthetic: compile {compile_txt} | step {med * 1e3:8.1f} ms (min {min(times) * 1e3:.1f}) | "
          f"{tokens / med:10,.0f} tokens/s | MFU(6N) {flops_6n / med / peak:6.1%} | "
          f"MFU(6N+attn) {flops_full / med / peak:6.1%} | loss {loss:.3f}")


if __name__ == "__main__":
    main()
