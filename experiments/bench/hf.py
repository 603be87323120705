"""Benchmark: a training step of transformers MoE models, stock against ``moe.hf.patch``ed and
against our own ``moe.model.Transformer`` imported with the same weights (the "imported" model,
column "ours"), side by side in one run, for every family.

    python -m experiments.bench.hf [--archs mixtral qwen3_moe olmoe deepseek_v3] [--reps 10] [--warmup 4]
        [--batch 8] [--seq 512] [--layers 2] [--device cpu|cuda] [--precision fp32|bf16]
        [--threads N] [--cpu-time] [--moe-share] [--layer-floor]

"Stock" is the model as transformers builds it, with its default experts implementation (in
transformers 5.24 ``grouped_mm``: torch's grouped matmul, which has a CPU kernel; the arch column
names it). A step is forward, the causal-LM loss (labels = inputs, shifted inside the model; ours is given the
same shifted targets), backward and a torch AdamW step (foreach) over every parameter. Every model
of an architecture starts from the same weights (the patched one is a deep copy of the stock model;
ours gets the stock model's weights through its family's table, ``moe.hf.import_state_dict``) and sees the same batch;
the first step's losses are printed beside the times so that can be checked. Balancing losses are
off in every model (transformers computes its balancing loss only when asked for router logits),
so each computes the same thing.

The machine is shared, so each repetition steps every model once, in turn, and the table shows the
median step time of each model and the median of the per-repetition ratios (a neighbour's load
that slows one repetition slows each model in it alike); ``--threads 1 --cpu-time`` counts only this
process's CPU time, which leaves out what other jobs take from it. Sizes are chosen so the MoE blocks
dominate a step: Mixtral-like coarse experts (D=512, F=1024, E=8, k=2) and fine-grained ones
(D=512, F=256, E=64, k=6, OLMoE k=8); the vocabulary is small (1024) so the LM head does not.

``--moe-share`` also prints the fraction of a step (forward and backward) spent inside the MoE
blocks of the stock and of the patched model, measured on one more step with hooks: the rest of the
step (attention, norms, the LM head, AdamW) is the same code in both, so it bounds what a faster
MoE block can give (stock / patched <= 1 / (1 - share of the stock step)).

``--layer-floor`` times one MoE block alone (forward and backward of the sum of its output), stock
and patched, and beside them the patched block's expert matmuls alone (9 per expert, at the counts
its router chose, nothing else): the floor a CPU expert path at this matmul rate cannot go under.

``--device cuda --precision bf16`` runs the same comparison on a GPU under bf16 autocast (fp32
weights and optimizer state), synchronising before each clock reading.
Shapes follow the project's legend (docs/design.md).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as nnf

from experiments.bench.timing import sync

# arch -> (D, F, E, K) of the benchmark size
SIZES = {
    "mixtral": (512, 1024, 8, 2),
    "qwen3_moe": (512, 256, 64, 6),
    "olmoe": (512, 256, 64, 8),
    "deepseek_v3": (512, 256, 64, 6),
}
VOCAB, HEADS = 1024, 8
# untimed steps before the timed ones. The stock models' first steps are slow while the C heap
# settles (measured, 2 threads: DeepSeek-V3's stock step 3.6, 2.2, 2.0 s, then 1.8-1.9 s from the
# fourth on; the patched one is steady from its second), so fewer would inflate the ratios
WARMUP = 4


def hf_model(arch: str, D: int, F: int, E: int, K: int, layers: int, seq: int, vocab: int = VOCAB, heads: int = HEADS):
    """A randomly initialised transformers model (nothing downloaded), fp32, SDPA attention."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=D,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=seq,
        hidden_act="silu",
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(
            **common,
            num_key_value_heads=heads,
            intermediate_size=F,
            num_local_experts=E,
            num_experts_per_tok=K,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=heads,
            intermediate_size=4 * F,
            moe_intermediate_size=F,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=D // heads,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(
            **common, num_key_value_heads=heads, intermediate_size=F, num_experts=E, num_experts_per_tok=K
        )
        cls = transformers.OlmoeForCausalLM
    elif arch == "deepseek_v3":
        J = D // heads
        G = min(8, E // 4)  # DeepSeek-V3: 256 experts in 8 groups, 4 groups kept
        cfg = transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=heads,
            intermediate_size=4 * F,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_group=G,
            topk_group=max(1, G // 2),
            n_shared_experts=1,
            first_k_dense_replace=0,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=D // 2,
            kv_lora_rank=D // 4,
            qk_rope_head_dim=J // 2,
            qk_nope_head_dim=J // 2,
            v_head_dim=J,
        )
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"--archs {arch!r}: expected some of {tuple(SIZES)}")
    cfg._attn_implementation = "sdpa"
    return cls(cfg).float()


def ours_for(stock):
    """Our Transformer holding the stock model's weights (its family's mapping table,
    ``moe.hf.import_state_dict``), balancing losses off."""
    from moe.hf import import_state_dict

    return import_state_dict(
        stock.state_dict(),
        stock.config,
        max_seq_len=stock.config.max_position_embeddings,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )


def models_for(arch: str, layers: int, seq: int, sizes=None, vocab: int = VOCAB, heads: int = HEADS) -> dict:
    """name -> model, every one with the same weights."""
    import moe.hf

    torch.manual_seed(0)
    stock = hf_model(arch, *(sizes or SIZES[arch]), layers=layers, seq=seq, vocab=vocab, heads=heads)
    return {"stock": stock, "patched": moe.hf.patch(copy.deepcopy(stock)), "ours": ours_for(stock)}


def make_step(model, ids_BL, autocast):
    """One training step; returns its loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    hf = hasattr(model, "config")

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            if hf:
                loss = model(ids_BL, labels=ids_BL).loss
            else:  # the same shifted targets transformers' loss uses
                logits_BLV = model(ids_BL)
                loss = nnf.cross_entropy(logits_BLV[:, :-1].float().flatten(0, 1), ids_BL[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def measure(
    models: dict, ids_BL, reps: int, device, autocast=nullcontext, clock=time.perf_counter, warmup: int = WARMUP
) -> dict:
    """'time': name -> median step seconds; 'loss': name -> first-step loss; 'ratios': name -> stock
    time / name's time, the median over repetitions of each repetition's ratio; 'spread': name ->
    (lowest, highest) of those ratios. ``warmup`` untimed steps of every model come first (at least
    one: it gives the first-step loss)."""
    steps = {name: make_step(m.to(device).train(), ids_BL, autocast) for name, m in models.items()}
    first = {name: float(step()) for name, step in steps.items()}
    for _ in range(warmup - 1):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            sync(device)
            t0 = clock()
            step()
            sync(device)
            times[name].append(clock() - t0)
    per_rep = {name: [s / t for s, t in zip(times["stock"], times[name])] for name in steps if name != "stock"}
    return {
        "time": {n: statistics.median(t) for n, t in times.items()},
        "loss": first,
        "ratios": {n: statistics.median(r) for n, r in per_rep.items()},
        "spread": {n: (min(r), max(r)) for n, r in per_rep.items()},
    }


def moe_blocks(model) -> list:
    """The model's MoE blocks: the stock sparse-MoE modules, or the ``MoELayer`` that replaced them."""
    import moe
    import moe.hf

    names = {block for block, _ in moe.hf._BLOCKS.values()}
    return [m for m in model.modules() if isinstance(m, moe.MoELayer) or type(m).__name__ in names]


def moe_share(model, step, clock=time.perf_counter, reps: int = 3) -> float:
    """The fraction of one training step (``step()``) spent inside the model's MoE blocks, forward
    and backward. Forward: from a block's pre-hook to its hook. Backward: from the moment the
    gradient of a block's output exists to the moment its input's gradient is complete (the input
    also feeds the residual path, whose gradient is there first), so the span covers the block's own
    backward; autograd runs one node at a time on the CPU. Measured on steps of their own (the hooks
    cost a little), after the timed ones: the median of ``reps``."""
    spans, handles = [], []

    def pre(module, args):
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda g: spans.append(clock()) or None)  # backward: end
        spans.append(-clock())  # forward: start

    def post(module, args, out):
        spans.append(clock())  # forward: end
        y = out[0] if isinstance(out, tuple) else out
        if y.requires_grad:
            y.register_hook(lambda g: spans.append(-clock()) or None)  # backward: start

    for block in moe_blocks(model):
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    shares = []
    try:
        for _ in range(reps):
            spans.clear()
            t0 = clock()
            step()
            shares.append(sum(spans) / (clock() - t0))  # each span is a (-start, end) pair, in order
    finally:
        for h in handles:
            h.remove()
    return statistics.median(shares)


def expert_matmuls(experts, counts: list[int]):
    """A function running the 9 matmuls per expert that a SwiGLU expert layer's forward and backward
    need (x w1, x w3, a w2; g w2^T, dh1 w1^T, dh3 w3^T; a^T g, x^T dh1, x^T dh3) on ``counts[e]``
    rows each, and nothing else: the floor under the layer's time at this matmul rate."""
    w1, w3, w2 = experts.w1.detach(), experts.w3.detach(), experts.w2.detach()
    S, D, F = sum(counts), w1.shape[1], w1.shape[2]
    x, h, g = torch.randn(S, D), torch.randn(S, F), torch.randn(S, D)
    out_F, out_D, out_DF, out_FD = (
        torch.empty(max(counts), F),
        torch.empty(max(counts), D),
        torch.empty(D, F),
        torch.empty(F, D),
    )

    def run():
        a = 0
        for e, n in enumerate(counts):
            xe, he, ge = x[a : a + n], h[a : a + n], g[a : a + n]
            a += n
            torch.mm(xe, w1[e], out=out_F[:n]), torch.mm(xe, w3[e], out=out_F[:n]), torch.mm(he, w2[e], out=out_D[:n])
            (
                torch.mm(ge, w2[e].t(), out=out_F[:n]),
                torch.mm(he, w1[e].t(), out=out_D[:n]),
                torch.mm(he, w3[e].t(), out=out_D[:n]),
            )
            torch.mm(he.t(), ge, out=out_FD), torch.mm(xe.t(), he, out=out_DF), torch.mm(xe.t(), he, out=out_DF)

    return run


def layer_floor(
    arch: str, batch: int, seq: int, reps: int, clock=time.perf_counter, sizes=None, heads: int = HEADS
) -> dict:
    """One MoE block, forward + backward of ``sum(output)`` on the same ``[batch, seq, D]`` input:
    the stock block, the patched one, and the patched block's expert matmuls alone
    (``expert_matmuls`` at the counts the patched router chose); medians over ``reps``, interleaved."""
    sizes = sizes or SIZES[arch]
    models = models_for(arch, 1, seq, sizes=sizes, heads=heads)
    stock, patched = moe_blocks(models["stock"])[0], moe_blocks(models["patched"])[0]
    torch.manual_seed(2)
    x = torch.randn(batch, seq, sizes[0], requires_grad=True)
    patched(x)
    floor = expert_matmuls(patched.experts, patched.stats.tokens_per_expert.tolist())

    def fwd_bwd(block):
        def run():
            block.zero_grad(set_to_none=True)
            out = block(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()

        return run

    runs = {"stock": fwd_bwd(stock), "patched": fwd_bwd(patched), "expert matmuls": floor}
    times = {name: [] for name in runs}
    for rep in range(WARMUP + reps):
        for name, run in runs.items():
            t0 = clock()
            run()
            if rep >= WARMUP:
                times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=list(SIZES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--warmup", type=int, default=WARMUP, help="untimed steps of every model before the timed ones (at least 1)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument(
        "--moe-share",
        action="store_true",
        help="also print the MoE blocks' share of a step (forward + backward) of the stock and the patched model",
    )
    p.add_argument(
        "--layer-floor",
        action="store_true",
        help="also time one MoE block alone (forward + backward), stock and patched, against its expert matmuls alone",
    )
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this process's CPU time: with --threads 1, what other jobs on a shared machine take is "
        "left out",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    clock = "CPU time" if args.cpu_time else "wall-clock"
    print(
        f"device {device}, {args.precision}, {torch.get_num_threads()} threads, {clock}, "
        f"batch {args.batch} x {args.seq} tokens, "
        f"{args.layers} layers, vocabulary {VOCAB}, {args.reps} repetitions after {max(1, args.warmup)} untimed steps; "
        "ratios: median of the repetitions' (lowest-highest)"
    )
    print(
        "| arch | D, F, E, k | stock s/step | patched s/step | ours s/step | stock / patched | stock / ours "
        "| first-step losses (stock, patched, ours) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        models = models_for(arch, args.layers, args.seq)
        torch.manual_seed(1)
        ids_BL = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
        r = measure(
            models,
            ids_BL,
            args.reps,
            device,
            autocast,
            time.process_time if args.cpu_time else time.perf_counter,
            max(1, args.warmup),
        )
        t, loss = r["time"], r["loss"]
        ratio = {n: f"{r['ratios'][n]:.2f}x ({lo:.2f}-{hi:.2f})" for n, (lo, hi) in r["spread"].items()}
        cell = lambda d, k, fmt="": format(d[k], fmt) if k in d else "-"  # noqa: E731
        impl = getattr(
            models["stock"].config, "_experts_implementation", None
        )  # transformers' own choice for the stock experts
        print(
            f"| {arch} ({impl}) | {', '.join(map(str, SIZES[arch]))} | {t['stock']:.3f} | {t['patched']:.3f} "
            f"| {cell(t, 'ours', '.3f')} | "
            f"{ratio['patched']} | {cell(ratio, 'ours')} | "
            f"{', '.join(f'{loss[n]:.5f}' for n in loss)} |",
            flush=True,
        )
        if args.moe_share:
            shares = {
                n: moe_share(
                    models[n],
                    make_step(models[n], ids_BL, autocast),
                    clock=time.process_time if args.cpu_time else time.perf_counter,
                )
                for n in ("stock", "patched")
            }
            print(
                f"  {arch}: MoE blocks' share of a step: stock {shares['stock']:.0%}, patched {shares['patched']:.0%}",
                flush=True,
            )
        del models
        if args.layer_floor:
            f = layer_floor(
                arch, args.batch, args.seq, args.reps, clock=time.process_time if args.cpu_time else time.perf_counter
            )
            print(
                f"  {arch}: one MoE block, forward + backward: stock {f['stock'] * 1e3:.0f} ms, "
                f"patched {f['patched'] * 1e3:.0f} ms "
                f"({f['stock'] / f['patched']:.2f}x), its expert matmuls alone {f['expert matmuls'] * 1e3:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
