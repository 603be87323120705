"""The trainer's config schema: typed dataclasses registered in Hydra's ConfigStore.

``conf/train.yaml`` and every group file under ``conf/`` start from a schema registered here
(Hydra 1.3's "Structured Configs" pattern) and hold only what differs from its defaults::

    # conf/moe/switch.yaml
    defaults:
      - base_moe          # moe.MoEConfig: every key, its type and its default
      - _self_
    top_k: 1

Registered names: ``base_train`` (the root: ``seed``, ``device``, ``precision``, ``train.*`` and
one typed field per group) and, in each group, ``base_model``, ``base_moe``, ``base_parallel``,
``base_optim``, ``base_data``, ``base_logger``. The schema types every node, so at compose time a
mistyped key (``moe.topk=2``, a typo in a yaml) or a wrong type (``train.steps=abc``,
``moe.top_k=two``) stops Hydra with an error naming the key. Ranges and cross-field rules are not
the schema's business: ``moe.MoEConfig`` and ``moe.model.TransformerConfig`` check them in
``__post_init__`` when ``model_config`` (below) builds them, and the trainer's own keys are checked
once each, where ``experiments.training.checks`` lists.

Why the moe dataclasses serve as schema as they are (and what is derived):

- ``moe.MoEConfig`` is the moe group's schema itself. OmegaConf reads a dataclass *type* from
  ``dataclasses.fields()`` without instantiating it, so ``__post_init__`` never sees ``???`` or a
  ``${...}`` interpolation; it resolves the postponed string annotations of ``moe/config.py``
  (``from __future__ import annotations``) with ``typing.get_type_hints``, and OmegaConf 2.3 takes
  ``int | None`` as ``Optional[int]``. The required fields without default (``d_model``,
  ``d_ff``) become mandatory (``???``): each moe yaml wires them to the model with interpolations.
- The model group's schema, ``ModelConfig``, is generated from
  ``dataclasses.fields(TransformerConfig)`` and ``typing.get_type_hints(TransformerConfig)``,
  leaving out the ``moe`` field: in the trainer the MoE layer is a group of its own (``moe=``), and
  ``TransformerConfig(moe=MoEConfig | None)`` is a nested config OmegaConf would type as a second
  place to set every moe key. Generating it (rather than copying the fields) keeps
  ``moe.model.TransformerConfig`` the one source of names, types and defaults; the generated class
  has no ``__post_init__``, validation stays where it is. The trainer's own model keys
  (``MODEL_TRAINER_FIELDS``: ``init_from``, the checkpoint a run starts from, and ``hf_family``,
  its family) are appended: they are
  not architecture, so ``TransformerConfig`` does not carry them.
- ``+key=value`` is Hydra's explicit "add a key the config does not have": it opens struct mode, so
  no schema can refuse it at compose time. ``check_keys`` (called by
  ``experiments.training.checks.check_config`` before anything is built) rejects any such key that is not a
  field of its node's schema, naming it.

The trainer's own groups (``train``, ``parallel``, ``optim``, ``data``, ``logger``) are defined here;
their defaults are the values ``conf/`` used before, so a run without overrides trains exactly as
it did. Importing this module also registers the ``${div:a,b}`` resolver the yamls use. It needs
hydra and omegaconf; ``moe``, ``zero`` and ``routing_kernels`` never import it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from moe import MoEConfig
from moe.model import TransformerConfig

# integer division in configs, e.g. fine-grained experts: d_ff: ${div:${model.d_ff},4}
OmegaConf.register_new_resolver("div", lambda a, b: int(a) // int(b), replace=True)


def _schema_from(
    cls: type, name: str, exclude: tuple[str, ...] = (), extra: tuple[tuple[str, Any, Any], ...] = ()
) -> type:
    """A plain dataclass with ``cls``'s fields (names, resolved types, defaults) minus ``exclude``,
    then the ``extra`` fields ``(name, type, default)``, and none of ``cls``'s methods (no
    ``__post_init__``): a schema OmegaConf can hold ``???`` and ``${...}`` in."""
    hints = typing.get_type_hints(cls)  # the string annotations of `from __future__ import annotations`
    spec = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default=MISSING)  # required: a yaml or an override must set it
        spec.append((f.name, hints[f.name], default))
    spec += [(n, t, field(default_factory=d) if dataclasses.is_dataclass(d) else field(default=d)) for n, t, d in extra]
    schema = dataclasses.make_dataclass(name, spec)
    schema.__module__ = __name__  # pickles and prints as experiments.training.schema.<name>
    schema.__doc__ = f"{cls.__module__}.{cls.__qualname__}'s fields except {', '.join(exclude) or 'none'} (generated)."
    return schema


@dataclass
class UpcycleConfig:
    """Sparse upcycling (``moe.hf.upcycle``): with ``model.init_from`` a dense Llama or Qwen3
    checkpoint, every block becomes an MoE block of ``num_experts`` copies of its FFN, or of
    ``num_experts / granularity`` copies of its ``granularity`` slices."""

    num_experts: int | None = None  # null: no upcycling; all experts (with granularity G: copies x G)
    top_k: int = 2  # experts per token (with granularity G: a multiple of G, each slice of top_k/G copies)
    # G: split the dense FFN's width F into G slices of F/G, each an expert (fine-grained upcycling:
    # moe.d_ff=F/G, moe.route_scale=G, router rows tied per copy so step 0 is the dense model); 1: copies
    granularity: int = 1


# the model group's keys that are the trainer's, not the architecture's: (name, type, default; a
# dataclass type: its instance)
MODEL_TRAINER_FIELDS = (
    # a transformers checkpoint directory (any family moe.hf maps) whose config and weights the run
    # starts from (experiments.training.hf_init)
    ("init_from", str | None, None),
    # the model_type of that checkpoint (set from it, not by hand): what export-hf writes back
    ("hf_family", str | None, None),
    # start from a dense init_from as an MoE model of copies (or, granularity > 1, slices) of each FFN
    ("upcycle", UpcycleConfig, UpcycleConfig),
)
# the model group: TransformerConfig without its `moe` field (the moe group is separate), plus
# the trainer's own keys, which model_config takes out before building
ModelConfig = _schema_from(TransformerConfig, "ModelConfig", exclude=("moe",), extra=MODEL_TRAINER_FIELDS)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (``experiments.training.checkpointing``, ``zero.checkpoint``)."""

    every: int = 100  # save every this many steps and at the end; 0: never (no final save either)
    dir: str | None = None  # null: <run dir>/checkpoints; set it (or hydra.run.dir) for restarts to find it
    keep_last: int = 2  # complete checkpoints kept (>= 2: an older one survives while the next is written)
    # DCP async save: the loop waits only while the state is copied; files and manifest follow in a
    # background thread (a Python keyword cannot be a key, hence not `async`)
    async_save: bool = False


@dataclass
class TrainLoopConfig:
    steps: int = 400  # optimizer steps
    batch_size: int = 16  # GLOBAL sequences per optimizer step; each of dp ranks takes batch_size / dp
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size / dp / grad_accum sequences each)
    grad_clip: float = 1.0  # max global gradient 2-norm; 0 disables clipping (the norm is still logged)
    log_every: int = 10  # a metrics.jsonl row (and tracker log) every this many steps, and at the last step
    eval_every: int = 100  # validation every this many steps, and at the last step
    eval_batches: int = 8  # global batches of the validation split per evaluation (fixed: same windows every time)
    progress: bool = True  # tqdm progress bar (rank 0 only)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # auto: the newest complete checkpoint in train.checkpoint.dir, else a fresh start; none: fresh;
    # a path: that checkpoint (a step_<N> directory, or a checkpoint dir: its newest complete one)
    resume: str = "auto"
    # a step whose loss, MoE aux loss or gradient norm is non-finite on any rank is skipped on every
    # rank; after this many skipped steps in a row the run stops with an error naming the quantity
    max_bad_steps: int = 10
    # torch.compile each transformer block (its forward; the module hooks stay eager), see the README
    compile: bool = False
    # before anything is allocated: the layout's predicted peak memory per rank (zero.plan) against
    # the device's (experiments.training.preflight); false skips the check
    preflight: bool = True
    preflight_budget_bytes: float | None = None  # one rank's budget instead of the device's memory
    plan_cluster: str | None = None  # the profile (conf/cluster) preflight and parallel=auto plan with; null: by device
    memory_steps: int = 3  # CPU: optimizer steps the peak-memory meter watches after the build; 0: none


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel size: ranks that together hold all experts (divides dp)
    # flat: one All-to-All over the ep group, a row per routed slot | node: each token crosses to a
    # node at most once, then to its experts inside the node (ep a multiple of node_size, > node_size)
    ep_dispatch: str = "flat"
    pp: int = 1  # pipeline stages: world = pp x dp; each stage a run of layers (embedding, blocks, head)
    pp_schedule: str = (
        "1f1b"  # gpipe | 1f1b | interleaved_1f1b | interleaved_zb | zbv | dualpipev (torch.distributed.pipelining)
    )
    pp_microbatches: int | None = None  # micro-batches per step through the pipeline; null: 2 x pp x pp_virtual_stages
    pp_virtual_stages: int = 1  # stages per pipeline rank: 1, >= 2 for interleaved_*, 2 for zbv and dualpipev
    pp_layers: list[int] | None = None  # layers of each stage in order (sum n_layers + 2); null: as even as possible
    # dualpipev only: each overlapped forward-backward pair runs its two passes at once (the backward's
    # collectives on process groups of their own), so one pass's All-to-All waits beside the other's compute
    pp_overlap: bool = False
    zero_stage: int = 0  # 0 replicated | 1 shard optimizer state | 2 + gradients | 3 + parameters
    # none | cpu (ZeRO-Offload: optimizer state, fp32 masters and the step on the CPU) | nvme
    # (ZeRO-Infinity: the step on the CPU, masters and state in files under offload_dir, and at
    # stage 3 the parameter shards too); stages 1-3.
    # false/true (the old boolean key) mean none/cpu
    zero_offload: str = "none"
    offload_dir: str | None = None  # nvme only, and required there: a directory on a local fast disk
    offload_sub_group_elems: int | None = None  # nvme: elements per streamed sub-group; null: zero.nvme's default
    # fp32 everywhere, or bf16 compute weights/grads with fp32 master + moments (stages 1-3)
    zero_mixed_precision: str = "fp32"
    # ranks per node for the link tiers (ZeRO++, comm_bytes_intra/inter); null: torchrun's
    # LOCAL_WORLD_SIZE, else the whole world is one node
    node_size: int | None = None
    zero_hpz: bool = False  # ZeRO++ hpZ (stage 3): a node-local secondary weight partition, exact
    zero_qwz: bool = False  # ZeRO++ qwZ (stage 3): int8 weight all-gathers, fp32 scale per zero_quant_block
    zero_qgz: bool = False  # ZeRO++ qgZ (stages 1-3): hierarchical quantized gradient all-to-all
    zero_qgz_bits: int = 4  # qgZ's gradient bits: 4 or 8
    zero_quant_block: int = 256  # qwZ and qgZ: elements per fp32 scale
    timeout_s: float = 300.0  # a collective waiting longer than this (a dead rank) ends the run with an error
    auto: bool = False  # the planner's fastest layout for the world size (conf/parallel/auto.yaml)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    # adamw/adam: auto (torch's fused kernel where the device supports it, else foreach) | fused |
    # foreach | switchyard (routing_kernels.FusedAdamW)
    impl: str = "auto"
    lr: float = 3.0e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 40
    weight_decay: float = 0.1  # applied to matrices (dim >= 2) only, not to norms
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # adamw/adam
    eps: float = 1.0e-8  # adamw/adam
    momentum: float = 0.9  # sgd


@dataclass
class SourceConfig:
    """One entry of ``data.sources`` (``experiments.training.tokenized.build_mixture``)."""

    path: str = MISSING  # a prepared directory, `stdlib`, or a text file / folder / .jsonl / .parquet to prepare
    weight: float = 1.0  # the share of each batch's rows drawn from it: weight / the sum of the weights
    name: str | None = None  # in the per-source metrics (val_loss/<name>); null: the path's last part


@dataclass
class DataConfig:
    """One schema for every source; each source reads its own keys (``experiments.training.data.build_data``).
    ``path`` is mandatory (``???``) unless a source's yaml sets it: ``conf/data/stdlib.yaml`` sets
    null (a yaml cannot turn a default back into ``???``: OmegaConf's merge keeps the old value)."""

    source: str = "stdlib"  # stdlib | text | tokens | prepared (a directory written by experiments.prepare)
    path: str | None = MISSING  # text, tokens, prepared: the file or folder
    # bytes (byte-level, as before) | a tokenizer.json | a Hugging Face model folder | bpe:<N> (trained on the
    # sources' train documents, cached); anything but bytes prepares the source on first use (cached)
    tokenizer: str = "bytes"
    document_mask: bool = False  # attention stops at document boundaries; rotary positions restart in each
    sources: list[SourceConfig] = field(default_factory=list)  # a weighted mixture; non-empty: replaces the source
    text_field: str = "text"  # .jsonl, .parquet, datasets sources: the field holding the text
    prepare_workers: int | None = None  # tokenizing processes of a first-use prepare; null: one per core
    pattern: str = "**/*"  # text: files to take from a folder (binary files, i.e. containing NUL bytes, are skipped)
    vocab_size: int = 256  # bytes for stdlib and text
    val_fraction: float = (
        0.05  # held-out share: of FILES for a folder (by a hash of each relative path), else the last bytes/tokens
    )
    split_seed: int = 0  # stdlib, text
    cache_dir: str | None = None  # stdlib, text; null: $SWITCHYARD_CACHE, else ~/.cache/switchyard


@dataclass
class LoggerConfig:
    name: str = "none"  # none (metrics.jsonl only) | wandb; the keys below are wandb's
    mode: str = "offline"  # offline | online | disabled
    project: str = "switchyard"
    entity: str | None = None
    group: str | None = None  # null: one group per Hydra multirun (job name + sweep folder); none for single runs
    tags: list[str] = field(default_factory=list)
    expert_load: bool = True  # a per-MoE-layer histogram of tokens per expert at every logged step


@dataclass
class TrainConfig:
    """The root (``conf/train.yaml``); each group's node is filled by the group's choice."""

    seed: int = 0
    device: str = "auto"  # auto: CUDA when available, else CPU
    precision: str = "fp32"  # fp32 | bf16 (autocast; parameters and optimizer state stay fp32)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    model: ModelConfig = MISSING  # type: ignore[valid-type]
    moe: MoEConfig = MISSING
    parallel: ParallelConfig = MISSING
    optim: OptimConfig = MISSING
    data: DataConfig = MISSING
    logger: LoggerConfig = MISSING


# group -> its schema; the root is stored as `base_train`, each group's as `base_<group>`
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
}


def register(cs: ConfigStore | None = None) -> None:
    """Store the schemas (idempotent; done on import, so ``import experiments.training.schema`` before
    composing is enough)."""
    cs = cs or ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)


register()


def check_keys(cfg: Any) -> None:
    """Raise ValueError naming every key of a composed config that its node's schema does not have
    (only ``+key=value`` overrides get past composition with one); untyped nodes are not checked."""
    unknown = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, DictConfig):
            return
        schema = OmegaConf.get_type(node)
        known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
        for key in node.keys():
            full = f"{path}{key}"
            if not path and key == "hydra":  # compose(return_hydra_config=True): Hydra's own, typed by Hydra
                continue
            if known is not None and key not in known:
                unknown.append((full, schema))
                continue
            walk(node._get_node(key), f"{full}.")

    walk(cfg, "")
    if unknown:
        raise ValueError(
            "; ".join(
                f"unknown config key {full}: {schema.__name__} has no such field "
                f"(valid: {', '.join(f.name for f in dataclasses.fields(schema))})"
                for full, schema in unknown
            )
        )


def model_config(cfg: Any) -> TransformerConfig:
    """The ``TransformerConfig`` of ``cfg.model`` (+ ``cfg.moe`` when any block is MoE), without the
    trainer's ``model.init_from``; configs validate themselves, so a bad value stops here with a
    message naming the key. ``cfg`` may be a checkpoint's saved ``config.yaml``."""
    # plain dicts of the resolved values; a key still ??? fails here naming it (MissingMandatoryValue)
    mcfg = OmegaConf.to_container(cfg.model, resolve=True, throw_on_missing=True)
    for key, *_ in MODEL_TRAINER_FIELDS:
        mcfg.pop(key, None)
    moe_cfg = None
    if mcfg.get("moe_every", 1):
        moe_cfg = MoEConfig.from_dict(OmegaConf.to_container(cfg.moe, resolve=True, throw_on_missing=True))
    return TransformerConfig.from_dict(mcfg, moe=moe_cfg)
