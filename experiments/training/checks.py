"""What the schema cannot check in the trainer's own keys: ranges and cross-field rules, each
section in one function here, all run once by ``check_config`` as soon as the layout exists and
before the ranks compare their configs, so every rank stops with the same message naming the key.

The other sections are checked once each where they are turned into objects, since only that code
knows its rules:

- ``model.*``, ``moe.*``: ``moe.model.TransformerConfig`` and ``moe.MoEConfig`` (``schema.model_config``);
- ``parallel.pp*``: ``zero.pipeline.plan_pipeline`` (``build.build_plan`` names the keys);
- ``parallel.ep`` and ``parallel.pp`` against the world size: ``zero.Layout`` (``build.build_layout``);
- ``optim.*``: ``optim.optimizer_factory``;
- ``data.*``: ``data.build_data`` and its loaders; ``logger.*``: ``tracking.make_tracker``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

import zero
from experiments.training import schema
from experiments.training.preemption import preemption_signals
from zero.pipeline import PipelinePlan

RESUME_CHOICES = ("auto", "none")
PRECISIONS = ("fp32", "bf16")
_POSITIVE_TRAIN_KEYS = (
    "steps",
    "batch_size",
    "seq_len",
    "grad_accum",
    "log_every",
    "eval_every",
    "eval_batches",
    "max_bad_steps",
)


def check_config(cfg: DictConfig, layout: zero.Layout, plan: PipelinePlan | None = None) -> None:
    """Every check of the trainer's own keys (the root, ``parallel``'s ZeRO keys and its ``pp``
    against ``layout``, ``train.*``, ``train.checkpoint.*`` and ``train.resume``); ``plan``: the
    pipeline of ``build_plan(cfg)``, whose micro-batches the batch must divide into."""
    schema.check_keys(cfg)  # a key added with +key=value that no schema has
    check_parallel(cfg.parallel, layout)
    check_train(cfg.train, layout, plan)
    check_checkpoint(cfg.train)
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision={cfg.precision!r} is invalid: expected 'fp32' or 'bf16'")


def check_parallel(pcfg, layout: zero.Layout) -> None:
    """``parallel.zero_*``, and ``parallel.pp`` against a layout a driver may have built itself."""
    if pcfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage={pcfg.zero_stage!r} is invalid: expected 0, 1, 2 or 3")
    if int(pcfg.zero_stage) == 0 and pcfg.zero_offload:
        raise ValueError("parallel.zero_offload=true needs parallel.zero_stage >= 1")
    if layout.pp != pcfg.pp:
        raise ValueError(f"parallel.pp={pcfg.pp} but the layout has pp={layout.pp}")


def check_train(t, layout: zero.Layout, plan: PipelinePlan | None = None) -> None:
    """``train.*`` but its checkpoint keys: positive counts, and a batch that splits evenly over
    the dp ranks, the micro-batches and the pipeline's micro-batches."""
    for key in _POSITIVE_TRAIN_KEYS:
        if not isinstance(t[key], int) or t[key] < 1:
            raise ValueError(f"train.{key}={t[key]!r} is invalid: expected a positive integer")
    if t.batch_size % (layout.dp * t.grad_accum):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be divisible by dp={layout.dp} x train.grad_accum={t.grad_accum}"
        )
    if plan is not None and t.batch_size % (layout.dp * t.grad_accum * plan.microbatches):
        raise ValueError(
            f"train.batch_size={t.batch_size} must be divisible by dp={layout.dp} x train.grad_accum={t.grad_accum} "
            f"x parallel.pp_microbatches={plan.microbatches}: every micro-batch of the pipeline has the same rows"
        )
    if t.grad_clip < 0:
        raise ValueError(f"train.grad_clip={t.grad_clip} is invalid: expected >= 0 (0 disables clipping)")


def check_checkpoint(t) -> None:
    """``train.checkpoint.*`` and ``train.resume``, and the environment a preemption relies on."""
    c, resume = t.checkpoint, str(t.resume)
    if not isinstance(c.every, int) or c.every < 0:
        raise ValueError(f"train.checkpoint.every={c.every!r} is invalid: expected an integer >= 0 (0: no checkpoints)")
    if not isinstance(c.keep_last, int) or c.keep_last < 2:
        raise ValueError(
            f"train.checkpoint.keep_last={c.keep_last!r} is invalid: expected an integer >= 2 (the "
            f"newest checkpoint is complete only once written; an older one must survive meanwhile)"
        )
    if resume not in RESUME_CHOICES and not Path(resume).is_dir():
        raise ValueError(f"train.resume={resume!r} is neither auto, none nor an existing checkpoint directory")
    preemption_signals()  # a bad SUBMITIT_PREEMPT_SIGNAL stops here, before any collective
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("RANK", "0") == "0"
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        # torchrun shares its rendezvous store with the workers, and a restarted group then reads
        # the previous attempt's addresses and fails to connect (seen with torch 2.13, gloo)
        print(
            "warning: torchrun --max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment, "
            "or a restarted group fails to connect",
            file=sys.stderr,
            flush=True,
        )
