"""The NVMe offload tests' runs (tests/zero/test_nvme.py), at module level so spawned ranks and
subprocesses can import them: the small nets of ``zero_nets`` trained under a named optimizer with
the state in memory or in files, the rank functions of the 2-rank tests, and the scripts of the
memory and kill -9 tests (``python -m tests.support.nvme_cases <what> ...``)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import scale_aux_losses
from tests.support.zero_nets import B_PER_RANK, CLIP, batches, sharded_net
from zero import Layout, ZeroEngine
from zero import checkpoint as zc

STEPS = 10
SUB_GROUP = 4096  # the smallest sub-group: the tiny nets then span several, and the buffer sets rotate
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, eps=1e-4, weight_decay=0.1),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.1),
    "fused": None,  # the engine's default, routing_kernels.FusedAdamW (fuses the scale and the bf16 copy)
    # builds its state in its constructor (the offload moves it to the files), not in its first step
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, initial_accumulator_value=0.1),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.9, centered=True),  # 3 states
}


def build(layout: Layout, stage: int, opt: str, offload="none", offload_dir=None, **kw) -> ZeroEngine:
    net = sharded_net(layout)
    scale_aux_losses(net, 0.5)  # two micro-batches
    extra = dict(offload_dir=offload_dir, offload_sub_group_elems=SUB_GROUP) if offload == "nvme" else {}
    factory = OPTIMIZERS[opt]
    opt_kw = dict(optimizer=factory) if factory is not None else dict(lr=1e-2, weight_decay=0.1)
    return ZeroEngine(
        net,
        layout,
        stage=stage,
        max_grad_norm=CLIP,
        offload=offload,
        param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
        **opt_kw,
        **extra,
        **kw,
    )


def train(engine: ZeroEngine, start: int, stop: int) -> list[float]:
    """Steps ``start..stop-1`` of two micro-batches each; the dp-mean loss of each."""
    layout = engine.layout
    x, y = batches(2, layout.dp)
    rows = slice(layout.dp_rank * B_PER_RANK, (layout.dp_rank + 1) * B_PER_RANK)
    losses = []
    for s in range(start, stop):
        total = torch.zeros(())
        for m in range(2):
            ctx = engine.no_sync() if m == 0 else _Null()
            with ctx:
                loss = ((engine(x[s, m, rows]) - y[s, m, rows]) ** 2).mean() / 2
                engine.backward(loss)
            total += loss.detach()
        engine.step()
        if layout.dp_group is not None:
            dist.all_reduce(total, group=layout.dp_group)
        losses.append(total.item() / layout.dp)
    return losses


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def run(layout, stage, opt, offload="none", offload_dir=None, steps=STEPS, **kw) -> dict:
    engine = build(layout, stage, opt, offload, offload_dir, **kw)
    losses = train(engine, 0, steps)
    return {"losses": losses, "weights": engine.full_parameters(), "engine": engine}


def same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


def shards_in_files(engine: ZeroEngine) -> bool:
    """Stage 3 under NVMe offload: no flat holds its parameter shard in memory, and the shards were
    read from the files (through the engine's pool of slots) for the gathers."""
    pool = engine._nvme.shards
    return (
        all(f.shard_C is None and f.params_in_files for f in engine.flats)
        and pool is not None
        and pool.stats["reads"] > 0
        and all(s.flat is None for s in pool.slots)  # nothing held between steps
    )


# ----- 2 gloo ranks -------------------------------------------------------------------------------
def ep2_rank(rank, world, offload_root, ckpt_root):
    """dp=2 x ep=2: every optimizer and stage 1-3 in memory and in files (bit for bit), a resume of
    an NVMe checkpoint in memory and back, and one rank's bad offload_dir stopping both."""
    torch.set_num_threads(1)
    layout = Layout.build(ep=2, num_experts=4)
    mine = os.path.join(offload_root, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    out = {}
    for opt in ("adamw", "sgd", "fused"):
        for stage in (1, 2, 3):
            a = run(layout, stage, opt)
            b = run(layout, stage, opt, "nvme", mine)
            out[("same", opt, stage)] = same(a, b)
            if stage == 3:  # the parameter shards were in the files, read through the pool
                out[("shards in files", opt)] = shards_in_files(b["engine"])
    # stage 3 with a pool of one slot: a unit's dense and expert shards cannot both be held, so
    # the first gather is completed before the second shard is read (the all-gathers are async)
    from zero.nvme import shards as nvme_shards

    slots, nvme_shards._SLOTS = nvme_shards._SLOTS, 1
    try:
        for mp in ("fp32", "bf16"):
            a = run(layout, 3, "adamw", mixed_precision=mp)
            b = run(layout, 3, "adamw", "nvme", mine, mixed_precision=mp)
            pool = b["engine"]._nvme.shards
            out[("one slot", mp)] = same(a, b) and len(pool.slots) == 1 and pool.stats["waited_gathers"] > 0
    finally:
        nvme_shards._SLOTS = slots
    # resume: NVMe saves after 4 steps, memory resumes (and the other way), against 10 uninterrupted
    for src, dst in (("nvme", "none"), ("none", "nvme")):
        full = run(layout, 3, "adamw", src, mine)
        e = build(layout, 3, "adamw", src, mine)
        train(e, 0, 4)
        path = os.path.join(ckpt_root, f"{src}-{dst}")
        zc.save(e, path, group=None)
        r = build(layout, 3, "adamw", dst, mine)
        zc.load(r, path)
        resumed = {"losses": full["losses"][:4] + train(r, 4, STEPS), "weights": r.full_parameters()}
        out[("resume", src, dst)] = same(full, resumed)
    # rank 1's offload_dir has no parent: both ranks stop at construction, each with its message
    bad = mine if rank == 0 else os.path.join(offload_root, "missing", "offload")
    try:
        build(layout, 3, "adamw", "nvme", bad)
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    return out


def pp2_rank(rank, world, offload_dir):
    """Two pipeline stages (1F1B, 2 micro-batches) of a small transformer under ZeRO-3: the same
    rank trains in memory, then in files, with AdamW and with SGD (momentum); each pair must match
    bit for bit."""
    import torch.nn.functional as nnf

    import moe
    from moe.model import Transformer, TransformerConfig
    from zero.pipeline import Pipeline, plan_pipeline
    from zero.units import default_blocks

    torch.set_num_threads(1)
    layout = Layout.build(pp=2)
    results = {}
    for opt, offload in itertools.product(("adamw", "sgd"), ("none", "nvme")):
        moe_cfg = moe.MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2, aux_loss_coef=0.01)
        cfg = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8, moe=moe_cfg)
        torch.manual_seed(0)
        model = Transformer(cfg)
        plan = plan_pipeline(model.num_pipeline_layers, pp=2, pp_schedule="1f1b", pp_microbatches=2)
        ranges = [plan.ranges[s] for s in plan.stages_of(layout.pp_rank)]
        held = model.keep_layers(ranges)
        chunks = [model.pipeline_stage(lo, hi) for lo, hi in ranges]
        extra = dict(offload_dir=offload_dir, offload_sub_group_elems=SUB_GROUP) if offload == "nvme" else {}
        engine = ZeroEngine(
            held,
            layout,
            stage=3,
            blocks=default_blocks(held),
            entries=chunks,
            keep_gathered_across_microbatches=True,
            optimizer=OPTIMIZERS[opt],
            offload=offload,
            **extra,
        )
        pipe = Pipeline(
            chunks, plan, layout, engine, loss_fn=lambda out, y: nnf.cross_entropy(out.flatten(0, 1), y.flatten())
        )
        pipe.loss_scale = 0.5
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(STEPS):
            tokens = torch.randint(0, 32, (4, 9), generator=g)
            out = pipe.step(tokens[:, :-1], tokens[:, 1:])
            engine.step()
            losses.append([v.item() for v in out])
        results[opt, offload] = {"losses": losses, "weights": engine.full_parameters()}
        if offload == "nvme" and not shards_in_files(engine):
            return False
    same = []
    for opt in ("adamw", "sgd"):
        a, b = results[opt, "none"], results[opt, "nvme"]
        same.append(
            a["losses"] == b["losses"] and all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        )
    return all(same)


# ----- subprocess scripts ------------------------------------------------------------------------
def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """VmHWM := VmRSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class WideNet(nn.Module):
    """Three wide layers: a state of several MiB in few tensors, trained on a small batch."""

    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def memory_script(offload: str, offload_dir: str, width: int, sub_group: int) -> dict:
    """Peak resident memory of AdamW steps on ``WideNet(width)`` (the state several times the buffers)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = WideNet(width)
    x = torch.randn(4, width)
    extra = dict(offload_dir=offload_dir, offload_sub_group_elems=sub_group) if offload == "nvme" else {}
    engine = ZeroEngine(net, None, stage=1, offload=offload, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), **extra)
    params = sum(f.shard_numel for f in engine.flats)
    rise = 0
    for _ in range(3):  # the first step creates the state, the next ones read and write it
        # the backward's transient parameter gradients (2.4 MiB each here) are not the step's
        engine.backward(engine(x).pow(2).mean())
        before = _status("VmRSS")
        _reset_peak()
        engine.step()
        rise = max(rise, _status("VmHWM") - before)
    buffers = 0
    if engine._nvme is not None:
        # bytes: the slot buffers are uint8, the gradient buffer fp32
        buffers = sum(sum(r.numel() for r in s.raw) + s.grad.numel() * 4 for s in engine._nvme.sets)
    # a checkpoint saved from the state and loaded back into it: the rise of each
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        ck = zc.Checkpointer(engine, root)
        before = _status("VmRSS")
        _reset_peak()
        path = ck.save(3)
        save_rise = _status("VmHWM") - before
        before = _status("VmRSS")
        _reset_peak()
        ck.load(path)
        load_rise = _status("VmHWM") - before
        ck.close()
    return {
        "state_bytes": params * 4 * 3,  # master + exp_avg + exp_avg_sq
        "buffer_bytes": buffers,
        "step_peak_bytes": rise,
        "save_peak_bytes": save_rise,
        "load_peak_bytes": load_rise,
        "files_left": os.listdir(offload_dir) if offload_dir else [],
    }


class DeepNet(nn.Module):
    """Many narrow layers: stage 3's shards, one unit per layer, many times the pool's few slots."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _nbytes(t) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def shard_memory_script(offload: str, offload_dir: str, width: int, depth: int, sub_group: int) -> dict:
    """Resident memory that stage 3 training of ``DeepNet(width, depth)`` leaves behind, from
    before the model was built to after three AdamW steps, and its peak over the steps: run with
    ``MALLOC_MMAP_THRESHOLD_`` fixed, so that a freed tensor's pages return to the system."""
    import gc

    torch.set_num_threads(1)
    extra = dict(offload_dir=offload_dir, offload_sub_group_elems=sub_group) if offload == "nvme" else {}

    def engine_of(net):
        return ZeroEngine(
            net, None, stage=3, offload=offload, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), **extra
        )

    # the same code on a small net first: what torch's first use of each path leaves resident
    # (code pages, thread stacks, allocator arenas) is not the state's
    warm = engine_of(DeepNet(64, 2))
    for _ in range(2):
        warm.backward(warm(torch.randn(4, 64)).pow(2).mean())
        warm.step()
    del warm
    gc.collect()
    torch.manual_seed(0)
    x = torch.randn(4, width)
    before = _status("VmRSS")
    engine = engine_of(DeepNet(width, depth))
    gc.collect()
    _reset_peak()
    for _ in range(3):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    peak = _status("VmHWM")
    gc.collect()
    held = _status("VmRSS") - before
    buffers = 0
    if engine._nvme is not None:  # bytes: the step's buffer sets and the shard pool's slots
        buffers = sum(sum(r.numel() for r in s.raw) + s.grad.numel() * 4 for s in engine._nvme.sets)
        buffers += sum(s.raw.numel() + _nbytes(s.shard) for s in engine._nvme.shards.slots)
    return {
        "shard_bytes": sum(f.shard_numel * 4 for f in engine.flats),
        # one step's gradients (in memory either way): one rank, so each flat's whole buffer,
        # which the step consumes and frees
        "grad_bytes": sum(f.padded * 4 for f in engine.flats),
        "grad_held_bytes": sum(_nbytes(f.grad_shard_C) + _nbytes(f.grad_full_P) for f in engine.flats),
        "buffer_bytes": buffers,
        "held_bytes": held,
        "peak_bytes": peak - before,
        "files_left": os.listdir(offload_dir) if offload_dir else [],
    }


def kill_script(offload_dir: str, root: str, marker: str) -> None:
    """Train under NVMe offload, save at step 2, then stop forever inside step 3's update of its
    second sub-group (after the first was written back), telling ``marker``: the test kills -9."""
    from zero import nvme

    torch.set_num_threads(1)
    layout = Layout.single()
    engine = build(layout, 3, "adamw", "nvme", offload_dir)
    ck = zc.Checkpointer(engine, root, keep_last=2)
    train(engine, 0, 2)
    ck.save(2)
    torch.save(engine.full_parameters(), os.path.join(root, "weights_at_2.pt"))
    update, calls = nvme.NvmeOffload._update, [0]

    def stuck(self, sg, bs, grad_scale, zero_grads):
        calls[0] += 1
        update(self, sg, bs, grad_scale, zero_grads)
        if calls[0] == 2:
            Path(marker).write_text(str(os.getpid()))
            while True:
                time.sleep(1)

    nvme.NvmeOffload._update = stuck
    train(engine, 2, 3)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "memory":
        print(json.dumps(memory_script(args[0], args[1], int(args[2]), int(args[3]))))
    elif what == "shards":
        print(json.dumps(shard_memory_script(args[0], args[1], *map(int, args[2:5]))))
    elif what == "kill":
        kill_script(*args)
        os.kill(os.getpid(), signal.SIGKILL)  # never reached: the test kills first
