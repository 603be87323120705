"""Expert parallelism against plain data parallelism (torch DDP), measured in one launch.

    python -m experiments.bench.ep [--world 2] [--steps 10] [--node-size N [--groups G --topk-groups TG]]

Both runs train the same MoE stack on the same global batch: DDP replicates every expert on every
rank and all-reduces all gradients; EP holds E/ep experts per rank, moves tokens by All-to-All and
reduces only dense gradients over dp (``zero.ZeroEngine`` at stage 0 with torch's AdamW). Reports
tokens/s of a full training step (forward, backward, gradient reduction, AdamW) for both and the
share of EP's step spent inside All-to-All calls. ``--node-size N``: the ranks as nodes of N
(``world / N >= 2`` of them) and a third contender, EP with ``ep_dispatch="node"``
(``moe.dispatch.NodeDispatcher``: each token crosses to a node once); for both EP runs the bytes
their All-to-Alls send to other nodes per step (rows, counts, and the node dispatch's routing ids
and weights), the busiest rank's. ``--groups/--topk-groups``: group-limited routing,
``num_groups`` / ``topk_groups`` (groups that are nodes bound the nodes a token reaches).
Runs on gloo (CPU) or NCCL (GPU) alike; imports no hydra or wandb.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from experiments.launch import init_rank, rendezvous_port


class MoEStack(nn.Module):
    def __init__(self, cfg, layers, ep_group=None, dp_group=None, ep_node_groups=None):
        super().__init__()
        from moe import MoELayer

        self.norms = nn.ModuleList(nn.LayerNorm(cfg.d_model) for _ in range(layers))
        self.moes = nn.ModuleList(
            MoELayer(cfg, ep_group=ep_group, dp_group=dp_group, ep_node_groups=ep_node_groups) for _ in range(layers)
        )
        self.head = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def _run(rank, world, port, args, out_q):
    from moe import MoEConfig
    from zero import Layout, ZeroEngine

    device = init_rank(rank, world, port, timeout_s=300)
    groups = {} if args.groups is None else dict(num_groups=args.groups, topk_groups=args.topk_groups)
    cfg = MoEConfig(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k, **groups)
    T = args.tokens_per_rank
    x = torch.randn(T, cfg.d_model, device=device)
    target = torch.randn(T, cfg.d_model, device=device)

    a2a_time = [0.0]
    off_node = [0]  # bytes the All-to-Alls sent to ranks on other nodes
    original = dist.all_to_all_single
    node_size = args.node_size or world

    def count_off_node(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        splits = input_split_sizes or [inp.shape[0] // len(ranks)] * len(ranks)
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        off_node[0] += sum(n * row for r, n in zip(ranks, splits) if r // node_size != rank // node_size)

    def timed_all_to_all(*a, **kw):
        count_off_node(*a, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = original(*a, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        a2a_time[0] += time.perf_counter() - t0
        return r

    def bench(step_fn):
        for _ in range(args.warmup):
            step_fn()
        a2a_time[0] = 0.0
        off_node[0] = 0
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        busiest = torch.tensor([off_node[0]], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        return elapsed / args.steps, a2a_time[0] / args.steps, busiest.item() / args.steps

    results = {}
    # DDP: every rank holds every expert
    torch.manual_seed(0)
    model = MoEStack(cfg, args.layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def ddp_step():
        loss = (ddp(x) - target).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    results["ddp"] = bench(ddp_step)
    ddp = model = opt = None  # freed before the next contender (not del: the step closure names them)

    dispatches = ["flat", "node"] if args.node_size else ["flat"]
    for dispatch in dispatches:
        layout = Layout.build(ep=world, num_experts=cfg.num_experts, node_size=node_size, ep_dispatch=dispatch)
        torch.manual_seed(0)
        model = MoEStack(cfg, args.layers, layout.ep_group, layout.dp_group, layout.ep_node_groups).to(device)
        engine = ZeroEngine(model, layout, stage=0, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-4))

        def ep_step():
            loss = (model(x) - target).square().mean()
            loss.backward()
            engine.step()

        dist.all_to_all_single = timed_all_to_all
        try:
            results["ep" if dispatch == "flat" else "ep_node"] = bench(ep_step)
        finally:
            dist.all_to_all_single = original
        model = engine = None
    if rank == 0:
        out_q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--node-size", type=int, default=None, help="ranks per node: adds EP with ep_dispatch=node")
    p.add_argument("--groups", type=int, default=None, help="group-limited routing: num_groups")
    p.add_argument("--topk-groups", type=int, default=None, help="group-limited routing: topk_groups")
    args = p.parse_args(argv)
    if args.node_size is not None:
        from zero import validate_ep_dispatch

        validate_ep_dispatch("node", args.world, args.node_size, "--node-size with ep_dispatch")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(
        _run, args=(args.world, rendezvous_port(), args, q), nprocs=args.world, start_method="spawn", join=True
    )
    res = q.get()
    tokens = args.world * args.tokens_per_rank
    ddp_t, _, _ = res["ddp"]
    ep_t, ep_a2a, ep_bytes = res["ep"]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(
        f"world={args.world} ({backend}), {args.layers} MoE layers, D={args.d_model} F={args.d_ff} E={args.experts} "
        f"k={args.top_k}, {args.tokens_per_rank} tokens/rank"
        + (f", groups {args.groups} top {args.topk_groups}" if args.groups else "")
        + (f", nodes of {args.node_size} ranks" if args.node_size else "")
    )
    print("| layout | step (ms) | tokens/s | vs DDP | All-to-All share | MB to other nodes per step |")
    print("|---|---|---|---|---|---|")
    print(f"| DDP (all experts on every rank) | {ddp_t * 1e3:.1f} | {tokens / ddp_t:,.0f} | 1.00x | - | - |")
    rows = [(f"EP={args.world}", res["ep"])]
    rows += [(f"EP={args.world}, ep_dispatch=node", res["ep_node"])] if "ep_node" in res else []
    for name, (t, a2a, off) in rows:
        print(
            f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {ddp_t / t:.2f}x | {a2a / t:.1%} "
            f"| {off / 1e6:.2f} ({off / ep_bytes:.2f}x) |"
            if ep_bytes
            else f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {ddp_t / t:.2f}x | {a2a / t:.1%} | - |"
        )


if __name__ == "__main__":
    main()
