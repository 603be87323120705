"""A transformers model family as a checkpoint of our ``Transformer``, and back: the machinery that
every model-family adapter (``moe.hf.mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``,
``deepseek_v3``) reads its tables with.

An adapter is data: ``Adapter(table=..., fields=..., ours_fixed=..., fixed=...)``. Each table is
read in both directions, so that export and import cannot disagree:

- ``table``: ``Row``s, our state-dict names against the transformers module's and the checkpoint
  file's, with the layout change each way (``to_module``/``to_ours``) and the blocks it is in
  (``when``);
- ``fields``: our config fields that are one of theirs (``Field``), each with its conversion both ways;
- ``ours_fixed``: our config fields with one value in the family (``qk_norm="head"``,
  ``moe.score_func="sigmoid"``), set on import and required on export;
- ``fixed``: their config fields with one valid value for our model (``Fixed``): what export
  writes, what import accepts.

Export checks a config by the round trip: our config -> theirs (``fields``) -> ours again
(``fields`` + ``ours_fixed``); every architecture field (``moe.hf.arch.architecture``) that comes
back different is one the family cannot carry, and is refused by name and value.

transformers is imported only by the functions that build or read a config object; safetensors
only when a file is read (``moe.hf.safetensors_io``).

Shapes follow the project's legend (docs/design.md): V vocabulary, D model dim, F expert hidden
dim, E experts of the model, X experts held by this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MoEConfig
from ..model import Transformer, TransformerConfig
from .arch import TRAINING_MOE_FIELDS, architecture, block_of, describe, layer_blocks, placement_why
from .safetensors_io import (
    DEFAULT_SHARD_BYTES,
    SafetensorsFiles,
    TensorSource,
    check_no_weights,
    plan_shards,
    write_sharded,
)
from .tables import OMIT, Field, Fixed, Row, get_field, names, put_field

# in old checkpoints: non-persistent buffers, recomputed from the config on both sides
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Adapter:
    """One model family (``name``, as messages say it; ``model_type``, as its configs do): its
    tables (module docstring), the transformers config class that export writes
    (``config_class``, ``architectures``), ``zero_in_theirs``: our tensors the family has no place
    for, exported only when zero, imported as zeros, and ``check_files(hf_cfg, keys)``: a check of
    the checkpoint's tensor names (metadata only) before any is read."""

    name: str
    model_type: str
    table: tuple[Row, ...]
    fields: tuple[Field, ...]
    ours_fixed: dict[str, object]
    fixed: tuple[Fixed, ...]
    config_class: str
    architectures: tuple[str, ...]
    zero_in_theirs: tuple[str, ...] = ()
    check_files: Callable | None = None

    # --- configs ---------------------------------------------------------------------------

    def _bad(self, field: str, value, why: str) -> ValueError:
        return ValueError(f"{field}={value!r} cannot be a {self.name} model: {why}")

    def theirs(self, cfg: TransformerConfig) -> dict:
        """Their config fields for a model of ``cfg``, as a dict (no check)."""
        out: dict = {}
        for f in self.fields:
            value = f.to_theirs(get_field(cfg, f.ours), cfg)
            if value is not OMIT:
                put_field(out, f.theirs, value)
        for f in self.fixed:
            if f.export is not None:
                put_field(out, f.field, f.export(cfg))
        return out

    def check_exportable(self, cfg: TransformerConfig, *, dropless: bool = True) -> None:
        """Raise ValueError naming the first field of ``cfg`` that a model of this family cannot
        carry (by the round trip through their config). ``dropless=False`` accepts a
        ``capacity_factor`` (a training-time rule: a run may start from a dropless checkpoint and
        train with a capacity); export keeps it refused, since the exported model would route
        dropless and so compute something else."""
        dense_family = self.ours_fixed.get("moe_every") == 0
        if (cfg.moe is None or not cfg.moe_every) != dense_family:
            has = "has no MoE block" if dense_family else "has MoE blocks"
            raise self._bad("model.moe_every", cfg.moe_every, f"a {self.name} model {has}")
        try:
            back = self.transformer_config(self.theirs(cfg), checked=False)
        except ValueError as e:  # their config of ours is not a valid one of ours: a fixed field of ours differs
            for field, want in self.ours_fixed.items():
                if get_field(cfg, field) != want:
                    name = field if field.startswith("moe.") else f"model.{field}"
                    raise self._bad(name, get_field(cfg, field), f"a {self.name} model has {name}={want!r}") from None
            raise ValueError(f"{self.name} cannot carry this model: {e}") from None
        mine, theirs = architecture(cfg), architecture(back)
        for key, value in mine.items():
            if theirs.get(key, "absent") != value:
                field, shown = describe(cfg, key)
                _, want = describe(back, key)
                why = (
                    placement_why(cfg, back, self.name)
                    if key == "placement"
                    else f"a {self.name} model has {field}={want!r}"
                )
                raise self._bad(field, shown, why)
        exported = self.theirs(cfg)
        for f in self.fixed:  # their fields with one valid value, as our config would write them
            value = get_field(exported, f.field)
            if f.accepts is not None and not f.accepts(value, exported):
                ours = next((g.ours for g in self.fields if g.theirs == f.field), None)
                field = f"config.{f.field}" if ours is None else (ours if ours.startswith("moe.") else f"model.{ours}")
                shown = value if ours is None else get_field(cfg, ours)
                raise self._bad(field, shown, f.why(exported) if callable(f.why) else f.why)
        if dropless and cfg.moe is not None and cfg.moe.capacity_factor is not None:
            raise self._bad(
                "moe.capacity_factor",
                cfg.moe.capacity_factor,
                f"{self.name} routes dropless; export the same weights with a config whose capacity_factor is None",
            )

    def hf_config(self, cfg: TransformerConfig, dtype: torch.dtype = torch.float32):
        """The transformers config of a model of ``cfg`` (refusing what this family cannot be)."""
        import transformers

        self.check_exportable(cfg)
        return getattr(transformers, self.config_class)(
            **self.theirs(cfg), architectures=list(self.architectures), dtype=str(dtype).removeprefix("torch.")
        )

    def check_hf_config(self, hf_cfg) -> None:
        """Raise ValueError naming the first field of their config that our model cannot compute."""

        def refuse(field, value, why):
            raise ValueError(f"{self.name} config.{field}={value!r} is not supported: {why}")

        model_type = get_field(hf_cfg, "model_type")
        if model_type != self.model_type:
            refuse("model_type", model_type, f"only {self.model_type!r} checkpoints map onto the {self.name} adapter")
        for f in self.fixed:
            value = get_field(hf_cfg, f.field)
            if f.accepts is not None and not f.accepts(value, hf_cfg):
                refuse(f.field, f.shown(value), f.why(hf_cfg) if callable(f.why) else f.why)

    def transformer_config(
        self, hf_cfg, *, max_seq_len: int | None = None, checked: bool = True, **moe_kw
    ) -> TransformerConfig:
        """Our ``TransformerConfig`` for their config (an object or a dict; refusing what our model
        cannot compute). ``max_seq_len``: default theirs (rotary tables are that long). ``moe_kw``:
        training-time MoEConfig fields (aux_loss_coef, z_loss_coef, capacity_factor, ...)."""
        if checked:
            self.check_hf_config(hf_cfg)
        decided = sorted(set(moe_kw) - set(TRAINING_MOE_FIELDS))
        if decided:
            raise ValueError(
                f"moe.{decided[0]}={moe_kw[decided[0]]!r}: the checkpoint's config decides {decided}; only "
                f"training-time MoEConfig fields ({', '.join(TRAINING_MOE_FIELDS)}) can be passed"
            )
        ours = dict(self.ours_fixed)
        for f in self.fields:
            value = f.to_ours(get_field(hf_cfg, f.theirs), hf_cfg)
            if value is not None:
                ours[f.ours] = value
        if max_seq_len is not None:
            ours["max_seq_len"] = max_seq_len
        moe_fields = {o.removeprefix("moe."): ours.pop(o) for o in list(ours) if o.startswith("moe.")}
        if ours.get("moe_every", 1) == 0:  # a dense family
            return TransformerConfig(**ours, moe=None)
        moe = MoEConfig(d_model=ours["d_model"], **moe_fields, **moe_kw)
        ours.setdefault("d_ff", moe.d_ff)  # the dense width of a family without dense blocks
        return TransformerConfig(**ours, moe=moe)

    def config_mismatches(self, cfg: TransformerConfig, hf_cfg) -> list[str]:
        """``model.x=ours (checkpoint: their_field=theirs)`` for each architecture field of ``cfg``
        that differs from their config's (empty when the checkpoint's weights fit ``cfg``); also the
        fields of ``cfg`` no model of the family has. Training-time fields (aux losses, capacity,
        init, sequence length, activation checkpointing) are free."""
        try:
            self.check_exportable(cfg, dropless=False)
        except ValueError as e:
            return [str(e)]
        want = self.transformer_config(hf_cfg)
        mine, theirs = architecture(cfg), architecture(want)
        out = []
        for key in mine:
            if mine[key] != theirs.get(key):
                field, a = describe(cfg, key)
                _, b = describe(want, key)
                out.append(f"{field}={a!r} (checkpoint: {self.their_name(field)}={b!r})")
        return out

    def their_name(self, field: str) -> str:
        """Their config field for our ``model.x`` / ``moe.x`` (or the family's name for a fixed one)."""
        ours = field.removeprefix("model.").split(",")[0]
        for f in self.fields:
            if f.ours == ours:
                return f.theirs
        return f"{self.name}'s {field}"

    def read_hf_config(self, path: str | os.PathLike):
        """The transformers config of a checkpoint directory (only ``config.json`` is read)."""
        import transformers

        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"{path}: no config.json (expected a transformers {self.name} checkpoint directory)"
            )
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path))
        self.check_hf_config(hf_cfg)
        return hf_cfg

    # --- state dicts ---------------------------------------------------------------------------

    def _theirs_of(self, ours: str) -> str:
        return next(r.module[0] for r in self.table if r.ours == (ours,))

    def rows(self, cfg: TransformerConfig, layers: set[int] | None = None) -> Iterator[tuple[Row, int]]:
        """Every (row, block) of a model of ``cfg`` (block -1 for the rows outside the blocks);
        ``layers``: only those pipeline layers (0 the embedding, i + 1 block i, n_layers + 1 the
        head)."""
        keep = layer_blocks(cfg, layers)
        for r in self.table:
            if r.ours[0] == "lm_head.weight" and cfg.tie_embeddings:
                continue
            if "{i}" in r.ours[0]:
                yield from ((r, i) for i in range(cfg.n_layers) if i in keep and r.when(cfg, i))
            elif (-2 if r.ours[0] in ("norm.weight", "lm_head.weight") else -1) in keep:
                yield r, -1

    def check_state(self, src: TensorSource, cfg: TransformerConfig) -> None:
        """``src`` holds the whole model of ``cfg``: its names and shapes (read from the source's
        metadata, no tensor is loaded), every expert, and ``zero_in_theirs`` zero (these small
        buffers are read). A tied head may be absent (it is the embedding)."""
        with torch.device("meta"):  # shapes only: nothing is allocated or drawn
            ref = Transformer(cfg).state_dict()
        optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
        have = set(src.keys())
        missing = sorted(set(ref) - have - optional)
        unknown = sorted(have - set(ref))
        if missing or unknown:
            raise ValueError(
                f"the state dict does not hold a model of this config: missing {missing[:8]}, unknown {unknown[:8]}"
            )
        for name in sorted(set(ref) & have):
            got, want = tuple(src.meta(name).shape), tuple(ref[name].shape)
            if got != want:
                experts = ".experts." in name and got[1:] == want[1:]
                hint = (
                    f": {got[0]} of num_experts={want[0]} experts; under expert parallelism gather every "
                    "rank's experts (a consolidated checkpoint) before exporting"
                )
                raise ValueError(f"{name} has shape {got}, the config's model {want}" + (hint if experts else ""))
        for i in range(cfg.n_layers):
            if cfg.is_moe_block(i):
                for name in names(self.zero_in_theirs, i):
                    if torch.count_nonzero(src.get(name)):
                        raise self._bad(name, "non-zero", f"{self.name}'s router has no selection bias")

    def to_module_state_dict(self, state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
        """Our state dict -> their module's ``state_dict()`` names and layouts (transformers 5,
        fused experts), e.g. for ``hf_model.load_state_dict``."""
        self.check_exportable(cfg)
        self.check_state(TensorSource(state), cfg)
        out = {}
        for r, i in self.rows(cfg):
            tensors = r.to_module(cfg, *(state[n] for n in names(r.ours, i)))
            out.update(zip(names(r.module, i), (t.contiguous() for t in tensors)))
        if cfg.tie_embeddings:
            out[self._theirs_of("lm_head.weight")] = out[self._theirs_of("embed.weight")]
        return out

    def file_tensors(
        self, get: Callable[[str], torch.Tensor], cfg: TransformerConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint file's (name, tensor), in table order, from ``get(our name)``.

        Each of our tensors is got once and dropped before the next is got, so with a lazy ``get`` (a
        checkpoint read tensor by tensor) one of our parameters is in memory at a time; with
        ``get=src.meta`` this yields the file's names and shapes without reading anything. Expert
        weights go out weight by weight (every expert's ``w1``, then ``w3``, then ``w2``): the order
        of a file does not matter to its readers."""
        for r, i in self.rows(cfg):
            if not r.experts:
                outs = r.to_module(cfg, *(get(n) for n in names(r.ours, i)))
                yield from zip(names(r.file, i), outs)
                del outs
                continue
            for j, name in enumerate(names(r.ours, i)):
                t = get(name)
                for e in range(cfg.moe.num_experts):
                    yield names(r.file, i, e)[j], t[e].t()
                del t

    def read(
        self, files: TensorSource, cfg: TransformerConfig, lo: int, hi: int, layers: set[int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Our state dict (experts ``[lo, hi)``; only ``layers``, pipeline layers, when given) from a
        checkpoint of ``cfg``, in either file layout (the Hub's, one tensor per expert, or a raw
        transformers 5 ``state_dict()``, fused); refuses a checkpoint that holds tensors the table
        does not know (biases, a second model...), naming them, before any tensor is read."""
        keys = set(files.keys())
        every = list(self.rows(cfg))
        moe_rows = [(r, i) for r, i in every if r.experts]
        fused = any(names(r.module, i)[0] in keys for r, i in moe_rows)
        used = set()
        for r, i in every:
            if not r.experts or fused:
                used.update(names(r.module if fused else r.file, i))
            else:
                used.update(n for e in range(cfg.moe.num_experts) for n in names(r.file, i, e))
        if cfg.tie_embeddings:
            used.add(
                self._theirs_of("lm_head.weight")
            )  # transformers ties it to the embedding, whatever the file holds
        if self.check_files is not None:
            self.check_files(cfg, keys - used)
        unknown = sorted(n for n in keys if n not in used and not n.endswith(IGNORED_SUFFIXES))
        if unknown:
            raise ValueError(
                f"the checkpoint holds tensors a {self.name} model of its config does not have, e.g. {unknown[:6]} "
                f"({len(unknown)} in all)"
            )
        state = {}
        for r, i in self.rows(cfg, layers):
            ours = names(r.ours, i)
            if not r.experts or fused:
                theirs = names(r.module if fused else r.file, i)
                sliced = (lo, hi) if r.experts else ()
                state.update(zip(ours, r.to_ours(cfg, *(files.get(n, *sliced) for n in theirs))))
            else:
                for j, name in enumerate(ours):
                    state[name] = torch.stack([files.get(names(r.file, i, e)[j]).t() for e in range(lo, hi)])
        keep = layer_blocks(cfg, layers)
        for i in range(cfg.n_layers):
            if cfg.is_moe_block(i) and i in keep:
                state.update({n: torch.zeros(cfg.moe.num_experts) for n in names(self.zero_in_theirs, i)})
        return state

    # --- export and import ---------------------------------------------------------------------

    def export(
        self,
        src,
        out_dir: str | os.PathLike,
        cfg: TransformerConfig | None = None,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> Path:
        """Write ``src`` as a transformers checkpoint directory of this family (``moe.hf.export_model``
        documents the arguments)."""
        if isinstance(src, Transformer):
            cfg = src.cfg if cfg is None else cfg
            src = TensorSource(src.state_dict())
        elif isinstance(src, (str, os.PathLike)):
            src = SafetensorsFiles(Path(src))
        elif not isinstance(src, TensorSource):
            src = TensorSource(dict(src))
        if cfg is None:
            raise ValueError("export needs cfg (the model's TransformerConfig) unless src is a Transformer")
        self.check_exportable(cfg)
        self.check_state(src, cfg)
        dtype = src.meta("embed.weight").dtype if dtype is None else dtype
        out = check_no_weights(out_dir)
        plan = plan_shards(list(self.file_tensors(src.meta, cfg)), dtype, max_shard_bytes)
        self.hf_config(cfg, dtype).save_pretrained(out)
        write_sharded(out, plan, self.file_tensors(src.get, cfg), dtype)
        return out

    @torch.no_grad()
    def load(
        self,
        open_tensors: Callable[[], TensorSource],
        hf_cfg,
        model: Transformer | None,
        where: str,
        *,
        max_seq_len: int | None = None,
        layout=None,
        ep_group=None,
        dp_group=None,
        layers: set[int] | None = None,
        **moe_kw,
    ) -> Transformer:
        """``model`` (or a new ``Transformer`` of ``hf_cfg``) holding the tensors ``open_tensors()``
        opens, once the configs are checked (``moe.hf.import_model`` documents the arguments).
        ``layers``: read only those pipeline layers (the others keep their initial weights)."""
        if model is None:
            model = Transformer(
                self.transformer_config(hf_cfg, max_seq_len=max_seq_len, **moe_kw),
                layout=layout,
                ep_group=ep_group,
                dp_group=dp_group,
            )
        else:
            bad = self.config_mismatches(model.cfg, hf_cfg)
            if bad:
                raise ValueError(f"{where}: the model's config does not match the checkpoint's: " + "; ".join(bad))
        layers_moe = model.moe_layers()
        lo = layers_moe[0].experts.expert_offset if layers_moe else 0
        hi = lo + layers_moe[0].experts.num_local if layers_moe else 0
        state = self.read(open_tensors(), model.cfg, lo, hi, layers)
        if model.cfg.tie_embeddings and "embed.weight" in state:
            state["lm_head.weight"] = state["embed.weight"]
        if layers is None:
            model.load_state_dict(state, strict=True)
        else:
            own = model.state_dict()
            unknown = sorted(set(state) - set(own))
            if unknown:
                raise AssertionError(f"the table read tensors the model does not have: {unknown[:6]}")
            # as strict as one process's load_state_dict for the layers read: none of theirs left unread
            keep = layer_blocks(model.cfg, layers)
            missing = sorted(n for n in own if block_of(n) in keep and n not in state)
            if missing:
                raise AssertionError(
                    f"{where}: the table left tensors of layers {sorted(layers)} unread: {missing[:6]}"
                )
            for name, t in state.items():
                own[name].copy_(t)
        model.hf_family = self.model_type
        return model
