"""``model.init_from=<transformers checkpoint directory>``: the run's model config taken from the
checkpoint (``resolve_init_from``), and this rank's weights read from it (``load_init_from``).

Any family ``moe.hf`` maps (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) is read; its
``config.json`` decides every architecture field of ``model.*`` and ``moe.*`` (no ``model=``
choice is needed), and ``model.hf_family`` records the family, so the run's checkpoints (their
``config.yaml``) remember it and ``export-hf`` writes it back. The run keeps its training settings:
``model.max_seq_len``, ``model.checkpoint_activations`` and the MoEConfig training fields
(``moe.aux_loss_coef``, ``moe.capacity_factor``, ... ``moe.hf.arch.TRAINING_MOE_FIELDS``).

``model.upcycle.num_experts=E`` (``model.upcycle.top_k=k``) with a dense Llama or Qwen3 checkpoint
upcycles it (``moe.hf.upcycle``): every block MoE, each expert a copy of the block's FFN, or with
``model.upcycle.granularity=G`` a 1/G slice of it (E/G copies of the G slices, top-k a multiple of
G, ``moe.route_scale=G``); the run is then the Mixtral / Qwen3-MoE model of that config
(``model.hf_family``; with G > 1 ``export-hf`` refuses it, as neither family carries a routing
scale).

Refused, naming both values: an explicit override (a ``model.x=`` / ``moe.x=`` on the command
line) whose value changes what the checkpoint's weights compute, and a byte-level run (data
sources ``stdlib``, ``text``) whose vocabulary differs from the checkpoint's.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moe import MoEConfig
from moe.model import TransformerConfig

BYTE_SOURCES = ("stdlib", "text")
# the run's own model keys: not the checkpoint's business
RUN_MODEL_FIELDS = ("max_seq_len", "checkpoint_activations")


def explicit_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides (``key=value`` strings): the composed config's own
    ``hydra.overrides.task`` (``compose(..., return_hydra_config=True)``), else the running Hydra
    app's, else none."""
    task = OmegaConf.select(cfg, "hydra.overrides.task", default=None)
    if task is not None:
        return list(task)
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _override_keys(overrides: list[str]) -> list[str]:
    keys = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith(("model.", "moe.")) and "=" in o:
            keys.append(key)
    return keys


def _conflict(ours: TransformerConfig, key: str, value) -> bool:
    """Whether setting ``key`` (``model.x`` / ``moe.x``) to ``value`` in the checkpoint's config changes
    what its weights compute."""
    from moe.hf.arch import architecture

    group, name = key.split(".", 1)
    try:
        if group == "model":
            other = dataclasses.replace(ours, **{name: value})
        else:
            other = dataclasses.replace(ours, moe=dataclasses.replace(ours.moe, **{name: value}))
    except (TypeError, ValueError):
        return True
    return architecture(other) != architecture(ours)


def check_upcycle(mcfg) -> None:
    """``model.upcycle.*`` where it would do nothing: a ``granularity`` or ``top_k`` other than its
    default without ``num_experts`` (null: no upcycling), or ``num_experts`` without ``init_from``;
    a ValueError naming the key, its value and what would be valid."""
    from experiments.training.schema import UpcycleConfig

    upcycle = mcfg.get("upcycle", None)
    if upcycle is None:
        return
    num_experts, default = upcycle.get("num_experts", None), UpcycleConfig()
    if num_experts is None:
        for name, valid in (("granularity", "a multiple of {v}"), ("top_k", "at least {v}")):
            value, unset = upcycle.get(name, getattr(default, name)), getattr(default, name)
            if value != unset:
                raise ValueError(
                    f"model.upcycle.{name}={value!r} does nothing without model.upcycle.num_experts (null: no "
                    f"upcycling): set model.upcycle.num_experts ({valid.format(v=value)}) to upcycle a dense "
                    f"model.init_from, or leave model.upcycle.{name} at its default {unset}"
                )
    elif not mcfg.get("init_from", None):
        raise ValueError(
            f"model.upcycle.num_experts={num_experts!r} upcycles model.init_from, which is null: set "
            f"model.init_from=<a dense Llama or Qwen3 checkpoint directory>, or model.upcycle.num_experts=null"
        )


def resolve_init_from(cfg: DictConfig, overrides: list[str] | None = None) -> DictConfig:
    """``cfg`` with ``model.*``/``moe.*`` set from ``model.init_from``'s checkpoint (a copy; ``cfg``
    itself when there is no ``init_from``). ``overrides``: the explicit ``key=value`` overrides
    (default ``explicit_overrides(cfg)``). Reads only ``config.json``; ``model.upcycle.*`` that would
    do nothing is refused first (``check_upcycle``)."""
    check_upcycle(cfg.model)
    path = cfg.model.get("init_from", None)
    if not path:
        return cfg
    from moe.hf import read_config
    from moe.hf.arch import NOT_ARCHITECTURE, TRAINING_MOE_FIELDS
    from moe.hf.dense import MOE_OF  # the dense families, and the MoE family each upcycles to

    adapter, hf_cfg = read_config(path)
    run_moe = OmegaConf.to_container(cfg.moe, resolve=True) if "moe" in cfg else {}
    training = {k: run_moe[k] for k in TRAINING_MOE_FIELDS if k in run_moe}
    upcycle = cfg.model.get("upcycle", None)
    family = adapter.model_type
    if upcycle is not None and upcycle.num_experts is not None:  # a dense checkpoint as an MoE model
        from moe.hf.upcycle import upcycled_config

        if family not in MOE_OF:
            raise ValueError(
                f"model.upcycle.num_experts={upcycle.num_experts}: model.init_from={path} is a {adapter.name} "
                f"checkpoint; upcycling starts from a dense one ({sorted(MOE_OF)})"
            )
        dense = adapter.transformer_config(hf_cfg, max_seq_len=int(cfg.model.max_seq_len))
        granularity = upcycle.get("granularity", 1)
        ckpt = upcycled_config(dense, upcycle.num_experts, upcycle.top_k, granularity, **training)
        family = MOE_OF[family]
    elif family in MOE_OF:  # its config has no MoE layer to take
        raise ValueError(
            f"model.init_from={path} is a dense {adapter.name} checkpoint, which the trainer starts from by "
            f"upcycling: set model.upcycle.num_experts=E (and model.upcycle.top_k=k) for a {MOE_OF[family]} model "
            "of E copies of each FFN, or use an MoE checkpoint"
        )
    else:
        ckpt = adapter.transformer_config(hf_cfg, max_seq_len=int(cfg.model.max_seq_len), **training)

    vocab = int(cfg.model.vocab_size)
    if cfg.data.source in BYTE_SOURCES and vocab != ckpt.vocab_size:
        raise ValueError(
            f"model.init_from={path}: the run's byte-level vocabulary (data.source={cfg.data.source}, "
            f"model.vocab_size={vocab}) differs from the checkpoint's vocab_size={ckpt.vocab_size}; a checkpoint "
            "trained on another tokenizer reads bytes as other tokens (use data.source=tokens with its tokenizer)"
        )
    run = OmegaConf.to_container(cfg.model, resolve=True)
    for key in _override_keys(explicit_overrides(cfg) if overrides is None else overrides):
        group, name = key.split(".", 1)
        if name in (*RUN_MODEL_FIELDS, *NOT_ARCHITECTURE, *TRAINING_MOE_FIELDS, "init_from", "hf_family") or (
            name.startswith("upcycle.")
        ):
            continue
        value = run.get(name) if group == "model" else run_moe.get(name)
        if _conflict(ckpt, key, value):
            mine = getattr(ckpt, name) if group == "model" else getattr(ckpt.moe, name)
            raise ValueError(
                f"{key}={value!r} conflicts with the checkpoint: model.init_from={path} has {key}={mine!r} "
                f"({adapter.name} {adapter.their_name(key)}); the checkpoint decides the architecture; drop it"
            )

    out = copy.deepcopy(cfg)
    for f in dataclasses.fields(TransformerConfig):
        if f.name != "moe" and f.name not in RUN_MODEL_FIELDS:
            out.model[f.name] = getattr(ckpt, f.name)
    for f in dataclasses.fields(MoEConfig):
        if f.name not in TRAINING_MOE_FIELDS:
            out.moe[f.name] = getattr(ckpt.moe, f.name)
    out.model.hf_family = family
    out.model.init_from = str(Path(path))
    return out


def init_layers(plan, layout) -> set[int] | None:
    """The pipeline layers this rank runs (None: all, one stage)."""
    if plan is None or layout is None:
        return None
    return {k for s in plan.stages_of(layout.pp_rank) for k in range(*plan.ranges[s])}


def load_init_from(model, path: str, layers: set[int] | None = None, upcycle: bool = False) -> None:
    """Read ``path``'s weights into ``model`` (built from ``resolve_init_from``'s config): only the
    pipeline ``layers`` this rank runs and, in each MoE layer, only its experts (safetensors reads
    single tensors lazily; a fused file is sliced on read). ``upcycle``: ``path`` is the dense
    checkpoint ``model`` upcycles (``moe.hf.upcycle.load_upcycled``)."""
    from moe.hf import import_model, read_config
    from moe.hf.safetensors_io import SafetensorsFiles
    from moe.hf.upcycle import load_upcycled

    if upcycle:
        adapter, hf_cfg = read_config(path)
        load_upcycled(model, adapter, hf_cfg, SafetensorsFiles(path), layers)
    else:
        import_model(path, next(model.parameters()).dtype, model=model, layers=layers)
