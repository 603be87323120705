"""The trainer's parts from the config: the process layout, the pipeline plan, the model (and this
pipeline rank's part of it), the ZeRO engine, the device and the precision a forward runs in.

Plain functions of the config, so tests and other drivers use them without the loop. They take a
config ``checks.check_config`` accepts (the loop runs it between ``build_layout`` and the rest);
what only they can check (the pipeline plan, the layout sizes, the model's and the optimizer's
values) they check themselves, naming the keys.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from omegaconf import DictConfig

import zero
from experiments.training.checks import offload_mode
from experiments.training.hf_init import check_upcycle, init_layers, load_init_from, resolve_init_from
from experiments.training.optim import optimizer_factory
from experiments.training.schema import model_config
from moe.model import Transformer
from zero.pipeline import PipelinePlan, plan_pipeline


def build_layout(pcfg, num_experts: int | None = None) -> zero.Layout:
    """The single process, or, under torchrun, the groups the ``parallel`` config asks for; sizes are
    validated (naming the numbers) before any collective."""
    node_size = pcfg.get("node_size", None)
    if zero.init_distributed(timeout_s=float(pcfg.timeout_s)):
        if node_size is not None:  # before any group exists; torchrun's LOCAL_WORLD_SIZE is checked by Layout.build
            zero.validate_node_size(dist.get_world_size(), node_size, "parallel.node_size")
        return zero.Layout.build(
            ep=int(pcfg.ep),
            pp=int(pcfg.pp),
            num_experts=num_experts,
            timeout_s=float(pcfg.timeout_s),
            node_size=None if node_size is None else int(node_size),
            ep_dispatch=str(pcfg.get("ep_dispatch", "flat")),
        )
    zero.validate_layout(1, int(pcfg.pp), int(pcfg.ep), num_experts)  # names the numbers when ep > 1 on one process
    if node_size is not None:
        zero.validate_node_size(1, node_size, "parallel.node_size")
    zero.validate_ep_dispatch(pcfg.get("ep_dispatch", "flat"), int(pcfg.ep), node_size or 1, "parallel.ep_dispatch")
    return zero.Layout.single()


def build_plan(cfg: DictConfig) -> PipelinePlan | None:
    """The pipeline stages of ``parallel.pp*`` (None for pp=1), validated before any process group
    exists: each error names the keys and the numbers."""
    pcfg = cfg.parallel
    if pcfg.pp == 1:
        if pcfg.pp_overlap:
            raise ValueError(
                "parallel.pp_overlap=true overlaps a pipeline's forward-backward pairs, but parallel.pp=1: use "
                "parallel.pp >= 2 with parallel.pp_schedule=dualpipev, or parallel.pp_overlap=false"
            )
        return None
    v = int(pcfg.pp_virtual_stages)
    m = int(pcfg.pp_microbatches) if pcfg.pp_microbatches is not None else 2 * int(pcfg.pp) * v
    layers = None if pcfg.pp_layers is None else [int(k) for k in pcfg.pp_layers]
    try:
        return plan_pipeline(
            int(cfg.model.n_layers) + 2,
            pp=int(pcfg.pp),
            pp_schedule=str(pcfg.pp_schedule),
            pp_microbatches=m,
            pp_virtual_stages=v,
            pp_layers=layers,
            pp_overlap=pcfg.pp_overlap,
        )
    except ValueError as e:
        raise ValueError(f"parallel.{e}") from None


def split_model(model: Transformer, plan: PipelinePlan, layout: zero.Layout) -> tuple[Transformer, list[Transformer]]:
    """This pipeline rank's part of ``model``: the module holding all its layers (what the engine
    shards; parameters keep their names) and one module per stage it runs."""
    ranges = [plan.ranges[s] for s in plan.stages_of(layout.pp_rank)]
    return model.keep_layers(ranges), [model.pipeline_stage(lo, hi) for lo, hi in ranges]


def build_model(cfg: DictConfig, layout: zero.Layout | None = None, plan: PipelinePlan | None = None) -> Transformer:
    """The transformer of ``cfg.model`` (+ ``cfg.moe``; see ``schema.model_config``).
    ``model.init_from``: a transformers checkpoint directory (any family ``moe.hf`` maps) whose
    config is the model's (``hf_init.resolve_init_from``, applied here unless the trainer already
    did) and whose weights replace the initial ones: with ``plan``, only the pipeline layers this
    rank runs, and in each MoE layer only this rank's experts."""
    init_from = cfg.model.get("init_from", None)
    if init_from and not cfg.model.get("hf_family", None):
        cfg = resolve_init_from(cfg)  # refuses model.upcycle.* that would do nothing first
    else:
        check_upcycle(cfg.model)
    mcfg = model_config(cfg)
    if mcfg.moe is not None and mcfg.moe.router == "expert_choice":
        print(
            "warning: moe.router=expert_choice picks tokens across the whole batch, so a causal LM sees the future "
            "through it; its validation loss is optimistic",
            file=sys.stderr,
        )
    model = Transformer(mcfg, layout=layout)
    if init_from:
        upcycle = cfg.model.get("upcycle", None)
        load_init_from(
            model, init_from, init_layers(plan, layout), upcycle is not None and upcycle.num_experts is not None
        )
    return model


def build_engine(
    cfg: DictConfig, model: torch.nn.Module, layout: zero.Layout, chunks: list[torch.nn.Module] | None = None
) -> zero.ZeroEngine:
    """The ``zero.ZeroEngine`` for ``parallel.zero_stage`` (0-3): it owns the gradient reduction,
    clipping and the optimizer of ``optimizer_factory(cfg.optim)``, over two param groups: matrices
    decay, norm gains and other 1-D parameters do not. ``chunks``: the pipeline stages that run
    ``model``'s layers (``split_model``); ZeRO-3 then keeps each block gathered for the step.
    ``parallel.zero_offload`` (none | cpu | nvme, with ``offload_dir``) and the ZeRO++ keys
    (``zero_hpz``, ``zero_qwz``, ``zero_qgz``, ``zero_qgz_bits``, ``zero_quant_block``) go to the
    engine as they are."""
    pcfg, ocfg = cfg.parallel, cfg.optim
    offload = offload_mode(pcfg.zero_offload)  # none | cpu | nvme (false/true: none/cpu)
    factory = optimizer_factory(ocfg)  # a bad optim.* stops here, before the engine's first collective
    wd = float(ocfg.weight_decay)
    pipeline = (
        {}
        if chunks is None
        else dict(
            blocks=zero.default_blocks(model),
            entries=chunks,
            keep_gathered_across_microbatches=int(pcfg.zero_stage) == 3,
        )
    )
    return zero.ZeroEngine(
        model,
        layout,
        stage=int(pcfg.zero_stage),
        optimizer=factory,
        **pipeline,
        param_groups=lambda name, p: {"weight_decay": wd if p.dim() >= 2 else 0.0},
        max_grad_norm=float(cfg.train.grad_clip) if cfg.train.grad_clip > 0 else None,
        offload=offload,
        offload_dir=pcfg.offload_dir if offload == "nvme" else None,
        offload_sub_group_elems=pcfg.offload_sub_group_elems if offload == "nvme" else None,
        mixed_precision=str(pcfg.zero_mixed_precision),
        hpz=bool(pcfg.zero_hpz),
        qwz=bool(pcfg.zero_qwz),
        qgz=bool(pcfg.zero_qgz),
        qgz_bits=int(pcfg.zero_qgz_bits),
        quant_block=int(pcfg.zero_quant_block),
    )


def device_of(cfg: DictConfig) -> torch.device:
    """``device``: auto is this process's CUDA device when there is one, else the CPU."""
    if cfg.device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(cfg.device)


def precision_context(cfg: DictConfig, device: torch.device):
    """What a forward runs under for ``precision``: bf16 autocast, or nothing for fp32."""
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
