"""What the schema cannot check in the trainer's own keys: ranges and cross-field rules, each
section in one function here, all run once by ``check_config`` as soon as the layout exists and
before the ranks compare their configs, so every rank stops with the same message naming the key.

The other sections are checked once each where they are turned into objects, since only that code
knows its rules:

- ``model.*``, ``moe.*``: ``moe.model.TransformerConfig`` and ``moe.MoEConfig`` (``schema.model_config``);
- ``model.upcycle.*`` and ``model.init_from``: ``hf_init.resolve_init_from``, the first thing the trainer does;
- ``parallel.pp*``: ``zero.pipeline.plan_pipeline`` (``build.build_plan`` names the keys);
- ``parallel.ep`` and ``parallel.pp`` against the world size: ``zero.Layout`` (``build.build_layout``),
  and ``parallel.node_size`` there too (``build.build_layout`` names the key);
- whether ``parallel.offload_dir`` can hold the state, and whether the dp and edp groups split
  evenly over the nodes (hpZ, qgZ): the engine, before its first collective, naming the directory
  and the bytes, or ``node_size``;
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
from zero.nvme import check_arguments as check_offload_arguments
from zero.pipeline import PipelinePlan

RESUME_CHOICES = ("auto", "none")
OFFLOAD_CHOICES = ("none", "cpu", "nvme")
_LEGACY_OFFLOAD = {"false": "none", "true": "cpu"}  # parallel.zero_offload was a bool
QGZ_BITS = (4, 8)
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


def offload_mode(value) -> str:
    """``parallel.zero_offload`` as ``none``, ``cpu`` or ``nvme``: the old boolean key's ``false`` and
    ``true`` mean ``none`` and ``cpu`` (the schema's str field holds them as ``'False'``/``'True'``);
    anything else is a ValueError naming the value."""
    text = str(value)
    mode = _LEGACY_OFFLOAD.get(text.lower(), text)
    if mode not in OFFLOAD_CHOICES:
        raise ValueError(
            f"parallel.zero_offload={value!r} is invalid: expected none, cpu or nvme (or false/true, meaning none/cpu)"
        )
    return mode


def check_parallel(pcfg, layout: zero.Layout) -> None:
    """``parallel.zero_*``, the offload and ZeRO++ keys, and ``parallel.pp`` and ``parallel.node_size``
    against a layout a driver may have built itself."""
    stage = pcfg.zero_stage
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage={stage!r} is invalid: expected 0, 1, 2 or 3")
    check_offload(pcfg)
    check_zeropp(pcfg)
    if layout.pp != pcfg.pp:
        raise ValueError(f"parallel.pp={pcfg.pp} but the layout has pp={layout.pp}")
    node_size = pcfg.get("node_size", None)
    if node_size is not None and layout.world > 1 and layout.node_size != node_size:
        raise ValueError(f"parallel.node_size={node_size} but the layout has node_size={layout.node_size}")


def check_offload(pcfg) -> None:
    """``parallel.zero_offload``, ``parallel.offload_dir`` (required with nvme, refused without it) and
    ``parallel.offload_sub_group_elems``."""
    mode, stage = offload_mode(pcfg.zero_offload), int(pcfg.zero_stage)
    shown = str(pcfg.zero_offload).lower() if str(pcfg.zero_offload).lower() in _LEGACY_OFFLOAD else mode
    if mode != "none" and stage == 0:
        raise ValueError(
            f"parallel.zero_offload={shown} needs parallel.zero_stage >= 1 (it offloads the sharded optimizer "
            f"state), got parallel.zero_stage=0"
        )
    offload_dir, sub_group = pcfg.get("offload_dir", None), pcfg.get("offload_sub_group_elems", None)
    if mode == "nvme" and not offload_dir:
        raise ValueError(
            f"parallel.zero_offload=nvme needs parallel.offload_dir=<a directory on a local fast disk>, got "
            f"parallel.offload_dir={offload_dir!r}"
        )
    for key, value in (("offload_dir", offload_dir), ("offload_sub_group_elems", sub_group)):
        if mode != "nvme" and value is not None:
            raise ValueError(
                f"parallel.{key}={value!r} only applies to parallel.zero_offload=nvme; "
                f"it is parallel.zero_offload={shown}"
            )
    if mode == "nvme":
        try:
            check_offload_arguments("nvme", offload_dir, sub_group)
        except ValueError as e:
            raise ValueError(f"parallel.{e}") from None


def check_zeropp(pcfg) -> None:
    """``parallel.zero_hpz``, ``zero_qwz`` (stage 3), ``zero_qgz`` (stages 1-3), ``zero_qgz_bits``
    and ``zero_quant_block``; the node split of the groups is the engine's check (it names
    ``node_size``)."""
    stage = int(pcfg.zero_stage)
    for key, what in (
        ("zero_hpz", "partitions stage 3's sharded weights a second time"),
        ("zero_qwz", "quantizes stage 3's weight all-gathers"),
    ):
        if pcfg.get(key, False) and stage != 3:
            raise ValueError(
                f"parallel.{key}=true needs parallel.zero_stage=3 (it {what}), got parallel.zero_stage={stage}"
            )
    if pcfg.get("zero_qgz", False) and stage == 0:
        raise ValueError(
            "parallel.zero_qgz=true needs parallel.zero_stage 1, 2 or 3 (it replaces the gradients' reduce-scatter), "
            "got parallel.zero_stage=0, which all-reduces them"
        )
    bits, block = pcfg.get("zero_qgz_bits", 4), pcfg.get("zero_quant_block", 256)
    if bits not in QGZ_BITS:
        raise ValueError(f"parallel.zero_qgz_bits={bits!r} is invalid: expected 4 or 8 (int4 or int8 gradients)")
    if not isinstance(block, int) or block < 1:
        raise ValueError(
            f"parallel.zero_quant_block={block!r} is invalid: expected a positive integer (elements sharing one scale)"
        )


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
