"""Benchmark: the model-FLOPs utilisation (MFU) of a training step.

    python -m experiments.bench.mfu [--device cuda] [--compile] [--batch 8] [--seq 1024] [--reps 5] [--tiny]

Times training steps of a ``model=base``-shaped transformer (``BASE``; forward, backward, AdamW;
bf16 weights on the GPU, every block compiled with ``--compile``) and reports ``model_flops`` per
step over the step time, divided by a dense matmul's rate measured in the same run (8192^3 in the
same dtype on the GPU, 2048^3 on the CPU). ``--tiny`` runs a small variant (any device): a check
that the code runs, not a figure.
"""

from __future__ import annotations

import argparse

import torch

from experiments.bench.timing import cuda_event_median, median_time
from moe import MoEConfig, Transformer, TransformerConfig

BASE = dict(
    vocab_size=50304,
    d_model=768,
    n_layers=12,
    n_heads=12,
    d_ff=2048,
    moe_every=2,
    tie_embeddings=True,
    moe=dict(num_experts=8, top_k=2),
)
TINY = dict(
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=2,
    d_ff=128,
    moe_every=2,
    tie_embeddings=True,
    moe=dict(num_experts=4, top_k=2),
)


def build_transformer(spec: dict, seq_len: int) -> Transformer:
    spec = dict(spec)
    moe_cfg = MoEConfig(d_model=spec["d_model"], d_ff=spec["d_ff"], **spec.pop("moe"))
    return Transformer(TransformerConfig(**spec, max_seq_len=seq_len, moe=moe_cfg))


def model_flops(model: Transformer, tokens: int, seq_len: int) -> float:
    """Training FLOPs of one step over ``tokens`` tokens: 6 x the parameters a token passes through
    (its top-k experts, not all; the embedding lookup is free, the tied head is counted once as a
    matmul) plus the attention scores and values, 12 x layers x d_model x seq_len per token (the
    convention of the PaLM paper's MFU, causal masking not discounted)."""
    cfg = model.cfg
    counts = model.param_counts()
    matmul_params = counts["active"] - (0 if cfg.tie_embeddings else counts["embedding"])
    return tokens * (6 * matmul_params + 12 * cfg.n_layers * cfg.d_model * seq_len)


def _timer(device: torch.device):
    if device.type == "cuda":
        return cuda_event_median
    return lambda fn, reps: median_time(fn, reps)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timer(device)(lambda: a @ b, reps)


def train_step_mfu(
    spec: dict,
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    compile_blocks: bool,
    reps: int,
    matmul_n: int,
) -> dict:
    """Median step time of forward + backward + AdamW on a fixed batch, its model FLOP/s, the dense
    matmul rate measured right after (same device and dtype) and their ratio, the MFU."""
    torch.manual_seed(0)
    model = build_transformer(spec, seq_len).to(device=device, dtype=dtype)
    if compile_blocks:
        model.compile_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, spec["vocab_size"], (batch, seq_len + 1), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()

    step()  # compiles, when compiling; the timer's own warm-up call follows
    t_step = _timer(device)(step, reps)
    flops = model_flops(model, batch * seq_len, seq_len)
    rate = matmul_rate(device, dtype, matmul_n, reps)
    return {
        "step_s": t_step,
        "model_flops": flops,
        "achieved": flops / t_step,
        "matmul_rate": rate,
        "mfu": flops / t_step / rate,
        "params": model.param_counts(),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 (GPU), float32 (CPU)"
    )
    ap.add_argument("--compile", action="store_true", help="also time the step with every block compiled")
    ap.add_argument("--tiny", action="store_true", help="a small model: a check that the code runs, not a figure")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    spec, batch, seq_len = (TINY, 2, 32) if args.tiny else (BASE, args.batch, args.seq)
    n = 8192 if device.type == "cuda" else 2048
    if args.tiny:
        n = 256
    variants = [False, True] if args.compile else [False]
    print(
        f"training step, {'tiny' if args.tiny else 'model=base'} ({batch} x {seq_len} tokens), {args.dtype} weights, "
        f"AdamW, {device}"
    )
    print("| compiled | step (ms) | model TFLOP/step | achieved TFLOP/s | dense matmul TFLOP/s | MFU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for compiled in variants:
        r = train_step_mfu(spec, batch, seq_len, device, dtype, compiled, args.reps, n)
        print(
            f"| {'yes' if compiled else 'no'} | {r['step_s'] * 1e3:.1f} | {r['model_flops'] / 1e12:.3f} "
            f"| {r['achieved'] / 1e12:.1f} | "
            f"{r['matmul_rate'] / 1e12:.1f} | {r['mfu']:.2f} |"
        )
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
