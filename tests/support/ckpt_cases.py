"""Rank functions of the checkpoint tests (module level, so spawned ranks can import them).

One small model (an input projection, a dense block, an MoE block with aux-loss-free expert biases,
a head) trained with torch's AdamW under a named layout on a fixed global batch per step; each rank
takes its rows. ``run`` trains from scratch or from a checkpoint and returns the dp-mean loss of
every step, the whole model's final weights (this rank's experts at their global rows) and buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoEConfig, MoELayer, update_expert_biases
from routing_kernels.runtime import expert_shard
from zero import Layout, ZeroEngine
from zero import checkpoint as zc
from zero.checkpoint import integrity

D, F, E, ROWS, SEQ = 16, 24, 4, 4, 3  # ROWS: global sequences per step (divisible by dp = 1, 2, 4)
STEPS, SAVE_AT = 6, 3
# name -> (world, ep, stage, offload): the reshard matrix (each saves; each loads every other)
LAYOUTS = {
    "single": (1, 1, 0, False),
    "dp2_z1_offload": (2, 1, 1, True),
    "ep2_z3": (4, 2, 3, False),
    "ep4_z2": (4, 4, 2, False),
}
# stage 0 on 2 ranks: every parameter replicated (saved, and loaded by one process, besides the matrix)
REPLICATED = {"dp2_z0": (2, 1, 0, False)}
LAYOUTS_ALL = {**LAYOUTS, **REPLICATED}


class Net(nn.Module):
    def __init__(self, layout: Layout):
        super().__init__()
        cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, expert_bias=True, bias_update_rate=1e-2)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.LayerNorm(D), nn.Linear(D, F), nn.GELU(), nn.Linear(F, D)),
                MoELayer(cfg, ep_group=layout.ep_group, dp_group=layout.dp_group),
            ]
        )
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def build(layout: Layout, stage: int, offload: bool) -> ZeroEngine:
    """The same initial model on every layout: built whole, then this rank's experts copied in."""
    torch.manual_seed(0)
    whole = dict(Net(Layout.single()).named_parameters())
    net = Net(layout)
    with torch.no_grad():
        for n, p in net.named_parameters():
            mark = expert_shard(p)
            src = whole[n] if mark is None else whole[n][mark.offset : mark.offset + p.shape[0]]
            p.copy_(src)
    # eps 1e-4: Adam would forgive a wrongly scaled state at the usual 1e-8 (docs/design.md)
    return ZeroEngine(
        net,
        layout,
        stage=stage,
        offload=offload,
        max_grad_norm=0.5,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2, eps=1e-4, weight_decay=0.1, foreach=True),
    )


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS, SEQ, D, generator=g)
    return x, torch.tanh(x[..., :4].sum(-1, keepdim=True))  # a fixed teacher: something to learn


def train_steps(engine: ZeroEngine, layout: Layout, start: int, stop: int, save=None) -> list[float]:
    """Steps ``start..stop-1``; ``save=(path, after, group)`` saves once ``after`` steps are done."""
    losses = []
    rows = slice(layout.dp_rank * ROWS // layout.dp, (layout.dp_rank + 1) * ROWS // layout.dp)
    for s in range(start, stop):
        x, y = batch(s)
        loss = ((engine(x[rows]) - y[rows]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        update_expert_biases(engine.module)
        total = loss.detach().clone()
        if layout.dp_group is not None:
            dist.all_reduce(total, group=layout.dp_group)
        losses.append(total.item() / layout.dp)
        if save is not None and s + 1 == save[1]:
            path, _, group = save
            zc.save(engine, path, step=s + 1, group=group)
    return losses


def final_state(engine: ZeroEngine) -> dict:
    """Weights (experts: this rank's slice with its global offset) and buffers."""
    weights = {}
    for n, w in engine.full_parameters().items():
        p = dict(engine.module.named_parameters())[n]
        mark = expert_shard(p)
        weights[n] = (None if mark is None else mark.offset, w)
    return {"weights": weights, "buffers": {n: b.clone() for n, b in engine.module.named_buffers()}}


_layouts: dict = {}


def layout_of(name: str) -> Layout | None:
    """The layout ``name`` on this spawn's ranks; a 2-rank layout inside a 4-rank spawn runs on
    ranks 0-1 over a subgroup, with the groups ``Layout.build`` makes on 2 processes (None on ranks
    2-3, which sit that job out)."""
    world, ep, _, _ = LAYOUTS_ALL[name]
    if world == 1:
        return Layout.single()
    if name not in _layouts:
        if world == dist.get_world_size():
            _layouts[name] = Layout.build(ep=ep, num_experts=E)
        else:
            assert world == 2 and ep == 1, name
            group = dist.new_group([0, 1])  # every rank creates it, members or not
            rank = dist.get_rank()
            _layouts[name] = (
                Layout(world=2, rank=rank, dp=2, ep=1, dp_group=group, edp_group=group) if rank < 2 else None
            )
    return _layouts[name]


def run(name: str, load: str | None = None, save: str | None = None) -> dict | None:
    """Layout ``name``: from scratch (saving after SAVE_AT steps into ``save``) or from the
    checkpoint ``load`` (steps SAVE_AT..STEPS). None on a rank outside the layout."""
    _, _, stage, offload = LAYOUTS_ALL[name]
    layout = layout_of(name)
    if layout is None:
        return None
    engine = build(layout, stage, offload)
    group = layout.dp_group if layout.world != (dist.get_world_size() if dist.is_initialized() else 1) else None
    start = 0
    if load is not None:
        meta = zc.load(engine, load, group=group)
        start = meta["step"]
    losses = train_steps(engine, layout, start, STEPS, save=None if save is None else (save, SAVE_AT, group))
    return dict(final_state(engine), losses=losses, step_count=engine.step_count)


def matrix_rank(rank, world, jobs):
    """Each ``(name, load, save)`` of ``jobs`` in order, every rank waiting for the job to finish
    everywhere (a later job may load what it saved)."""
    torch.set_num_threads(1)
    out = []
    for name, load, save in jobs:
        out.append(run(name, load, save))
        dist.barrier()
    return out


# ----- the trainer ---------------------------------------------------------------------------
TRAIN = [
    "model=tiny",
    "logger=none",
    "train.progress=false",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.eval_batches=1",
    "optim.warmup_steps=2",
    "train.steps=6",
    "train.log_every=1",
    "train.eval_every=3",
    "train.checkpoint.every=3",
    "moe.expert_bias=true",
    # AdamW's eps well above gradient rounding, as the engine cases above (eps=1e-4): at 1e-8 a
    # gradient that cancels to ~1e-10 on one layout and to the other sign on another moves its
    # weight by up to lr x |g| / eps, so runs on two layouts differed by 2e-5 on one expert weight
    # with this machine's corpus (1.7e-6 on another's); at 1e-4 they differ by 1.2e-7 at most
    "optim.eps=1e-4",
]


def train_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from experiments.training import schema  # noqa: F401  (registers the schema)

    conf = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return compose("train", overrides=[*TRAIN, *overrides])


def signal_at(step: int, signum: int):
    """Patch this process's batch drawing to send ``signum`` to itself while drawing the training
    batch of step index ``step`` (so that step runs to its end with the signal pending)."""
    import os

    from experiments.training.data import LMData

    original = LMData.get_batch

    def get_batch(self, split, s, *args, **kw):
        if split == "train" and s == step:
            os.kill(os.getpid(), signum)
        return original(self, split, s, *args, **kw)

    LMData.get_batch = get_batch
    return lambda: setattr(LMData, "get_batch", original)


PP = ["parallel=pp2", "parallel.pp_microbatches=2"]  # trains like one process with train.grad_accum=2


def trainer_rank(rank, world, root, single_ckpt, single_ga2_ckpt):
    """On 2 ranks (ep2, ZeRO-3): the uninterrupted run (async saves); a run SIGTERMed (rank 0 only) while drawing
    step index 3's batch, which must save after step 4 and stop; its resumption (train.resume=auto,
    same dir); and a resumption of the single-process checkpoint ``single_ckpt``. Then 2 pipeline
    stages: a run SIGTERMed on the last stage only while drawing step index 1's batch (saves after
    step 2 on both and stops), a run from scratch (its checkpoints for one process to load) and a resumption of
    ``single_ga2_ckpt``."""
    import functools
    import signal

    from experiments.train import train as train_on
    from experiments.training.data import build_data

    torch.set_num_threads(1)
    cfg = train_cfg()
    train = functools.partial(train_on, data=build_data(cfg.data, seed=cfg.seed))  # the corpus read once
    layout = ["parallel=ep2", "parallel.zero_stage=3"]
    # saved asynchronously: the training it overlaps must not change, and its checkpoints must be complete
    out = {
        "full": train(train_cfg(*layout, "train.checkpoint.async_save=true"), run_dir=f"{root}/full", keep_weights=True)
    }
    undo = signal_at(3, signal.SIGTERM) if rank == 0 else (lambda: None)
    try:
        out["preempted"] = train(train_cfg(*layout), run_dir=f"{root}/pre")
    finally:
        undo()
    out["resumed"] = train(train_cfg(*layout), run_dir=f"{root}/pre", keep_weights=True)
    out["from_single"] = train(
        train_cfg(*layout, f"train.resume={single_ckpt}"), run_dir=f"{root}/from_single", keep_weights=True
    )
    # a signal on the last stage only: the flag crosses the pipeline group in the gradient norm's
    # all-reduce, and both stages save after step 2 and stop
    undo = signal_at(1, signal.SIGTERM) if rank == 1 else (lambda: None)
    try:
        out["pp_preempted"] = train(train_cfg(*PP), run_dir=f"{root}/pp_pre")
    finally:
        undo()
    out["pp"] = train(train_cfg(*PP), run_dir=f"{root}/pp")
    out["pp_from_single"] = train(
        train_cfg(*PP, f"train.resume={single_ga2_ckpt}"), run_dir=f"{root}/pp_from_single", keep_weights=True
    )
    return out


def shared_verification_rank(rank, world, root):
    """2 ranks (dp2, ZeRO-1) save two checkpoints; rank 0 then flips a byte of the file that falls in
    rank 1's share of the newer one. ``Checkpointer.latest`` must skip it on both ranks and agree on
    the older one. Returns what each rank found, warned and re-read (``(dir, file)`` per digest)."""
    import json
    import warnings
    from pathlib import Path

    torch.set_num_threads(1)
    layout = Layout.build(ep=1, num_experts=E)
    engine = build(layout, 1, False)
    ck = zc.Checkpointer(engine, root, keep_last=3)
    for step in (1, 2):
        train_steps(engine, layout, step - 1, step)
        ck.save(step)
    newest = zc.step_dir(root, 2)
    files = json.loads((newest / zc.MANIFEST).read_text())["files"]
    victim = sorted(files, key=lambda n: (-files[n]["size"], n))[1]  # dealt second: rank 1's
    if rank == 0:
        raw = bytearray((newest / victim).read_bytes())
        raw[len(raw) // 2] ^= 0x10
        (newest / victim).write_bytes(bytes(raw))
    dist.barrier()
    read, digest = [], integrity.file_digest

    def spy(path, algorithm="xxh3_128"):
        read.append((Path(path).parent.name, Path(path).name))
        return digest(path, algorithm)

    # verify() looks file_digest up in its own module: patched there, not on the package's re-export
    integrity.file_digest = spy
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = ck.latest()
    finally:
        integrity.file_digest = digest
    return {
        "found": found.name,
        "victim": victim,
        "read": read,
        "warned": [str(w.message) for w in caught],
        "files": {
            p.name: sorted(json.loads((p / zc.MANIFEST).read_text())["files"]) for _, p in zc.list_checkpoints(root)
        },
    }


class SubmititJob:
    """A submitit job's callable, as Hydra's submitit launcher is one (pickled into the job folder,
    run by ``python -m submitit.core._submit <folder>``): trains ``train_cfg(*overrides)`` into
    ``run_dir`` on one process, and in its first attempt sends itself submitit's preemption signal
    (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default) while drawing the batch of step index
    ``signal_step``. ``checkpoint()`` is what submitit's signal handler calls before it requeues
    the job: it records what exists at that moment into ``run_dir/handed_over_<attempt>.json`` (the
    complete checkpoints, summary.json) and returns the next attempt, which resumes (train.resume=auto)."""

    def __init__(self, run_dir: str, overrides: list[str], signal_step: int, attempt: int = 0):
        self.run_dir, self.overrides, self.signal_step, self.attempt = run_dir, list(overrides), signal_step, attempt

    def __call__(self) -> dict:
        import os
        import signal

        from experiments.train import train

        torch.set_num_threads(1)
        signum = getattr(signal, "SIG" + (os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"))
        undo = signal_at(self.signal_step, signum) if self.attempt == 0 else (lambda: None)
        try:
            return train(train_cfg(*self.overrides), run_dir=self.run_dir)
        finally:
            undo()

    def checkpoint(self):
        import json
        from pathlib import Path

        import submitit

        run_dir = Path(self.run_dir)
        complete = [s for s, p in zc.list_checkpoints(run_dir / "checkpoints") if zc.verify(p) is None]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else None
        (run_dir / f"handed_over_{self.attempt}.json").write_text(
            json.dumps({"complete": complete, "summary": summary})
        )
        return submitit.helpers.DelayedSubmission(
            SubmititJob(self.run_dir, self.overrides, self.signal_step, self.attempt + 1)
        )
