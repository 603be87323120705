"""Benchmark: a training step of transformers MoE models, stock against ``moe.hf.patch``ed, and for
Mixtral also our own ``moe.model.Transformer`` with the same weights, side by side in one run.

    python -m experiments.bench_hf [--archs mixtral qwen3_moe olmoe deepseek_v3] [--reps 5]
        [--batch 8] [--seq 512] [--layers 2] [--device cpu|cuda] [--precision fp32|bf16]
        [--threads N] [--cpu-time] [--moe-share]

"Stock" is the model as transformers builds it, with its default experts implementation (in
transformers 5.24 ``grouped_mm``: torch's grouped matmul, which has a CPU kernel; the arch column
names it). A step is forward, the causal-LM loss (labels = inputs, shifted inside the model; ours is given the
same shifted targets), backward and a torch AdamW step (foreach) over every parameter. Every model
of an architecture starts from the same weights (the patched one is a deep copy of the stock model;
ours gets the stock Mixtral's weights through ``moe.hf_mixtral``'s table) and sees the same batch;
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

# arch -> (D, F, E, K) of the benchmark size
SIZES = {
    "mixtral": (512, 1024, 8, 2),
    "qwen3_moe": (512, 256, 64, 6),
    "olmoe": (512, 256, 64, 8),
    "deepseek_v3": (512, 256, 64, 6),
}
VOCAB, HEADS = 1024, 8


def hf_model(arch: str, D: int, F: int, E: int, K: int, layers: int, seq: int, vocab: int = VOCAB, heads: int = HEADS):
    """A randomly initialised transformers model (nothing downloaded), fp32, SDPA attention."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=D, num_hidden_layers=layers, num_attention_heads=heads,
                  max_position_embeddings=seq, hidden_act="silu", attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_key_value_heads=heads, intermediate_size=F, num_local_experts=E,
                                         num_experts_per_tok=K, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_key_value_heads=heads, intermediate_size=4 * F, moe_intermediate_size=F,
                                          num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, decoder_sparse_step=1,
                                          mlp_only_layers=[], head_dim=D // heads)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(**common, num_key_value_heads=heads, intermediate_size=F, num_experts=E, num_experts_per_tok=K)
        cls = transformers.OlmoeForCausalLM
    elif arch == "deepseek_v3":
        J = D // heads
        G = min(8, E // 4)  # DeepSeek-V3: 256 experts in 8 groups, 4 groups kept
        cfg = transformers.DeepseekV3Config(**common, num_key_value_heads=heads, intermediate_size=4 * F, moe_intermediate_size=F,
                                            n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=max(1, G // 2), n_shared_experts=1,
                                            first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True,
                                            q_lora_rank=D // 2, kv_lora_rank=D // 4, qk_rope_head_dim=J // 2, qk_nope_head_dim=J // 2,
                                            v_head_dim=J)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"--archs {arch!r}: expected some of {tuple(SIZES)}")
    cfg._attn_implementation = "sdpa"
    return cls(cfg).float()


def ours_for(stock):
    """Our Transformer holding the stock Mixtral's weights (the mapping table), balancing losses off."""
    from moe.hf_mixtral import import_mixtral_state_dict

    return import_mixtral_state_dict(stock.state_dict(), stock.config, max_seq_len=stock.config.max_position_embeddings,
                                     aux_loss_coef=0.0, z_loss_coef=0.0)


def models_for(arch: str, layers: int, seq: int, sizes=None, vocab: int = VOCAB, heads: int = HEADS) -> dict:
    """name -> model, every one with the same weights."""
    import moe.hf

    torch.manual_seed(0)
    stock = hf_model(arch, *(sizes or SIZES[arch]), layers=layers, seq=seq, vocab=vocab, heads=heads)
    out = {"stock": stock, "patched": moe.hf.patch(copy.deepcopy(stock))}
    if arch == "mixtral":
        out["ours"] = ours_for(stock)
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def measure(models: dict, ids_BL, reps: int, device, autocast=nullcontext, clock=time.perf_counter) -> dict:
    """'time': name -> median step seconds; 'loss': name -> first-step loss; 'ratios': name -> stock
    time / name's time, the median over repetitions of each repetition's ratio."""
    steps = {name: make_step(m.to(device).train(), ids_BL, autocast) for name, m in models.items()}
    first = {name: float(step()) for name, step in steps.items()}  # also the warm-up
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            _sync(device)
            t0 = clock()
            step()
            _sync(device)
            times[name].append(clock() - t0)
    ratios = {name: statistics.median(s / t for s, t in zip(times["stock"], times[name])) for name in steps if name != "stock"}
    return {"time": {n: statistics.median(t) for n, t in times.items()}, "loss": first, "ratios": ratios}


def moe_blocks(model) -> list:
    """The model's MoE blocks: the stock sparse-MoE modules, or the ``MoELayer`` that replaced them."""
    import moe
    import moe.hf

    names = {block for block, _ in moe.hf._BLOCKS.values()}
    return [m for m in model.modules() if isinstance(m, moe.MoELayer) or type(m).__name__ in names]


def moe_share(model, step, clock=time.perf_counter) -> float:
    """The fraction of one training step (``step()``) spent inside the model's MoE blocks, forward
    and backward. Forward: from a block's pre-hook to its hook. Backward: from the moment the
    gradient of a block's output exists to the moment its input's gradient is complete (the input
    also feeds the residual path, whose gradient is there first), so the span covers the block's own
    backward; autograd runs one node at a time on the CPU. Measured on a step of its own (the hooks
    cost a little), after the timed ones."""
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
    try:
        t0 = clock()
        step()
        total = clock() - t0
    finally:
        for h in handles:
            h.remove()
    return sum(spans) / total  # each span is a (-start, end) pair, in order


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=list(SIZES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--moe-share", action="store_true",
                   help="also print the MoE blocks' share of a step (forward + backward) of the stock and the patched model")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time: with --threads 1, what other jobs on a shared machine take is left out")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    clock = "CPU time" if args.cpu_time else "wall-clock"
    print(f"device {device}, {args.precision}, {torch.get_num_threads()} threads, {clock}, batch {args.batch} x {args.seq} tokens, "
          f"{args.layers} layers, vocabulary {VOCAB}, {args.reps} repetitions")
    print("| arch | D, F, E, k | stock s/step | patched s/step | ours s/step | stock / patched | stock / ours | first-step losses (stock, patched, ours) |")
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.archs:
        models = models_for(arch, args.layers, args.seq)
        torch.manual_seed(1)
        ids_BL = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
        r = measure(models, ids_BL, args.reps, device, autocast, time.process_time if args.cpu_time else time.perf_counter)
        t, ratio, loss = r["time"], r["ratios"], r["loss"]
        cell = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"  # noqa: E731
        impl = getattr(models["stock"].config, "_experts_implementation", None)  # transformers' own choice for the stock experts
        print(f"| {arch} ({impl}) | {', '.join(map(str, SIZES[arch]))} | {t['stock']:.3f} | {t['patched']:.3f} | {cell(t, 'ours', '.3f')} | "
              f"{ratio['patched']:.2f}x | {cell(ratio, 'ours', '.2f')}{'x' if 'ours' in ratio else ''} | "
              f"{', '.join(f'{loss[n]:.5f}' for n in loss)} |", flush=True)
        if args.moe_share:
            shares = {n: moe_share(models[n], make_step(models[n], ids_BL, autocast), clock=time.process_time if args.cpu_time else time.perf_counter)
                      for n in ("stock", "patched")}
            print(f"  {arch}: MoE blocks' share of a step: stock {shares['stock']:.0%}, patched {shares['patched']:.0%}", flush=True)
        del models


if __name__ == "__main__":
    main()
