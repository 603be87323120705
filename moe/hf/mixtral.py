"""A Switchyard ``Transformer`` as a transformers Mixtral checkpoint, and back: one mapping table.

Needs the optional extra (``pip install -e .[hf]``: transformers for the config class, safetensors
for the files); ``import moe`` never imports this module, and this module imports neither package
until a function needs it.

Shapes follow the project's legend (docs/design.md): V vocabulary, D model dim, H heads, J head dim,
F expert hidden dim, E experts of the model, X experts held by this process.

What maps to what (``TABLE``; ``{i}`` is the block, ``{e}`` the expert):

| ours | Mixtral module (transformers 5, ``state_dict()``) | Mixtral checkpoint file (what ``save_pretrained`` writes) |
|---|---|---|
| ``embed.weight [V, D]`` | ``model.embed_tokens.weight`` | same |
| ``blocks.{i}.attn_norm.weight [D]`` | ``model.layers.{i}.input_layernorm.weight`` | same |
| ``blocks.{i}.attn.qkv.weight [3D, D]`` | ``...self_attn.{q,k,v}_proj.weight [D, D]`` (rows 0:D, D:2D, 2D:3D) | same |
| ``blocks.{i}.attn.proj.weight [D, D]`` | ``...self_attn.o_proj.weight`` | same |
| ``blocks.{i}.ffn_norm.weight [D]`` | ``...post_attention_layernorm.weight`` | same |
| ``blocks.{i}.ffn.router.weight [E, D]`` | ``...mlp.gate.weight`` | ``...block_sparse_moe.gate.weight`` |
| ``blocks.{i}.ffn.experts.w1, w3 [E, D, F]`` | ``...mlp.experts.gate_up_proj [E, 2F, D]`` = ``cat(w1ᵀ, w3ᵀ)`` | ``...block_sparse_moe.experts.{e}.w1.weight, w3.weight [F, D]`` = ``w1[e]ᵀ, w3[e]ᵀ`` |
| ``blocks.{i}.ffn.experts.w2 [E, F, D]`` | ``...mlp.experts.down_proj [E, D, F]`` = ``w2ᵀ`` | ``...block_sparse_moe.experts.{e}.w2.weight [D, F]`` = ``w2[e]ᵀ`` |
| ``norm.weight [D]`` | ``model.norm.weight`` | same |
| ``lm_head.weight [V, D]`` | ``lm_head.weight`` (absent from the file when tied) | same |

Nothing else needs converting: both models are pre-norm with RMSNorm (normalised in fp32, then
times the gain), rotary positions rotate the same half-split pairs (``x[j]`` with ``x[j + J/2]``,
transformers' ``rotate_half``) with the same frequencies ``theta^(-2j/J)``, so q and k rows need no
permutation; attention is causal at scale ``J^-1/2`` with no biases; the router is softmax over all
E, top-k, renormalised; each expert is ``w2(silu(w1 x) * w3 x)``. ``router.expert_bias`` (our
selection bias, zero unless ``expert_bias``) has no Mixtral counterpart: exported only when zero,
imported as zeros.

The checkpoint file format is the Hub's (one tensor per expert under ``block_sparse_moe``): what
transformers 5 writes and converts to its fused module layout on load, and what every other
Mixtral reader expects. Import also reads a file in the fused module layout (a raw ``state_dict()``
of a transformers 5 model).

Configs (``CONFIG_FIELDS``): our ``TransformerConfig``/``MoEConfig`` fields against Mixtral's; a
Mixtral config always has one MoE block per layer (``moe_every=1``), as many key/value heads as
heads, a SwiGLU with silu, no sliding window, default rotary positions, no router jitter and no
attention dropout, and its router is exactly ``MIXTRAL_ROUTING``. Anything else is refused with a
ValueError naming the field, its value and what is valid.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MoEConfig
from ..model import Transformer, TransformerConfig

# ---------------------------------------------------------------------------------------------
# the expert layouts (also used by moe.hf.patch, which copies transformers' fused experts through them)


def fused_to_ours(gate_up: torch.Tensor, down_XDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers 5's fused experts -> ``(w1, w3, w2)`` in our layout, as views (no copy).

    ``gate_up [X, 2F, D]`` holds the gate rows then the up rows of each expert; ``down [X, D, F]``.
    Ours: ``w1, w3 [X, D, F]``, ``w2 [X, F, D]``."""
    F = down_XDF.shape[2]
    return gate_up[:, :F].transpose(1, 2), gate_up[:, F:].transpose(1, 2), down_XDF.transpose(1, 2)


def ours_to_fused(
    w1_XDF: torch.Tensor, w3_XDF: torch.Tensor, w2_XFD: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w1, w3, w2)`` -> transformers 5's ``(gate_up [X, 2F, D], down [X, D, F])`` (contiguous copies)."""
    return torch.cat([w1_XDF.transpose(1, 2), w3_XDF.transpose(1, 2)], dim=1), w2_XFD.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# the table


def _same(*ts):
    return ts


def _split_qkv(qkv):
    return tuple(qkv.chunk(3, dim=0))  # our rows are q, k, v (each h-major, "(three h j)")


def _cat_qkv(q, k, v):
    return (torch.cat([q, k, v], dim=0),)


@dataclass(frozen=True)
class Row:
    """Our tensors ``ours`` are Mixtral's ``module`` tensors (the transformers 5 module layout) by
    ``to_module``/``to_ours``. ``file`` names the same tensors in a checkpoint file: the module
    names, except for the experts (``experts=True``: dimension 0 runs over experts), which a file
    stores one tensor per expert: ``file[j]`` of expert e is ``ours[j][e]`` transposed."""

    ours: tuple[str, ...]
    module: tuple[str, ...]
    file: tuple[str, ...]
    to_module: Callable = _same
    to_ours: Callable = _same
    experts: bool = False


_L, _M = "model.layers.{i}.", "model.layers.{i}.block_sparse_moe."


def _row(ours, module, file=None, **kw) -> Row:
    return Row(tuple(ours), tuple(module), tuple(file if file is not None else module), **kw)


TABLE: tuple[Row, ...] = (
    _row(["embed.weight"], ["model.embed_tokens.weight"]),
    _row(["blocks.{i}.attn_norm.weight"], [_L + "input_layernorm.weight"]),
    _row(
        ["blocks.{i}.attn.qkv.weight"],
        [_L + f"self_attn.{p}_proj.weight" for p in "qkv"],
        to_module=_split_qkv,
        to_ours=_cat_qkv,
    ),
    _row(["blocks.{i}.attn.proj.weight"], [_L + "self_attn.o_proj.weight"]),
    _row(["blocks.{i}.ffn_norm.weight"], [_L + "post_attention_layernorm.weight"]),
    _row(["blocks.{i}.ffn.router.weight"], [_L + "mlp.gate.weight"], [_M + "gate.weight"]),
    _row(
        [f"blocks.{{i}}.ffn.experts.{w}" for w in ("w1", "w3", "w2")],
        [_L + "mlp.experts.gate_up_proj", _L + "mlp.experts.down_proj"],
        [_M + f"experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")],
        to_module=ours_to_fused,
        to_ours=fused_to_ours,
        experts=True,
    ),
    _row(["norm.weight"], ["model.norm.weight"]),
    _row(["lm_head.weight"], ["lm_head.weight"]),
)
# ours only: the aux-loss-free selection bias, zero unless MoEConfig.expert_bias (which Mixtral lacks)
ZERO_IN_MIXTRAL = ("blocks.{i}.ffn.router.expert_bias",)
# in old checkpoints: non-persistent buffers, recomputed from the config on both sides
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# (our field, Mixtral field): the same value on both sides. "moe." fields are MoEConfig's.
CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("d_model", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("moe.d_ff", "intermediate_size"),
    ("moe.num_experts", "num_local_experts"),
    ("moe.top_k", "num_experts_per_tok"),
    ("tie_embeddings", "tie_word_embeddings"),
    ("rope_theta", "rope_parameters.rope_theta"),
    ("norm_eps", "rms_norm_eps"),
    ("max_seq_len", "max_position_embeddings"),
    ("init_std", "initializer_range"),
)
# fields that do not change what the weights compute: not compared when a run starts from a checkpoint
_NOT_ARCHITECTURE = ("max_seq_len", "init_std")

# the MoEConfig routing that Mixtral's sparse block computes; every other value is refused
MIXTRAL_ROUTING: dict[str, object] = dict(
    activation="swiglu",
    router="token_choice",
    score_func="softmax",
    softmax_before_topk=True,
    normalize_topk=True,
    route_scale=1.0,
    num_groups=None,
    topk_groups=None,
    expert_bias=False,
    num_shared_experts=0,
    shared_expert_gate=False,
)


# ---------------------------------------------------------------------------------------------
# configs


def _bad(field: str, value, why: str) -> ValueError:
    return ValueError(f"{field}={value!r} cannot be a Mixtral model: {why}")


def check_exportable(cfg: TransformerConfig, *, dropless: bool = True) -> None:
    """Raise ValueError naming the first field of ``cfg`` that a Mixtral model cannot compute.

    ``dropless=False`` accepts a ``capacity_factor`` (a training-time rule: a run may start from a
    dropless checkpoint and train with a capacity); export keeps it refused, since the exported
    model would route dropless and so compute something else."""
    if cfg.moe is None or cfg.moe_every != 1:
        raise _bad("model.moe_every", cfg.moe_every, "every Mixtral layer is an MoE block; use moe_every=1")
    for name, want in MIXTRAL_ROUTING.items():
        got = getattr(cfg.moe, name)
        if got != want:
            raise _bad(f"moe.{name}", got, f"Mixtral's router and experts are {name}={want!r}")
    if dropless and cfg.moe.capacity_factor is not None:
        raise _bad(
            "moe.capacity_factor",
            cfg.moe.capacity_factor,
            "Mixtral routes dropless; export the same weights with a config whose capacity_factor is None",
        )


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def mixtral_config(cfg: TransformerConfig, dtype: torch.dtype = torch.float32):
    """The ``transformers.MixtralConfig`` of a Switchyard model (refusing what Mixtral cannot be)."""
    import transformers

    check_exportable(cfg)
    kw = {theirs: _get(cfg, ours) for ours, theirs in CONFIG_FIELDS if "." not in theirs}
    return transformers.MixtralConfig(
        **kw,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu",
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        # a byte-level (or any Switchyard) vocabulary has no special tokens; Mixtral's defaults
        # (bos 1, eos 2) would make generate() stop at an ordinary token
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=["MixtralForCausalLM"],
        dtype=str(dtype).removeprefix("torch."),
    )


def transformer_config(hf_cfg, *, max_seq_len: int | None = None, **moe_kw) -> TransformerConfig:
    """Our ``TransformerConfig`` for a ``transformers.MixtralConfig`` (refusing what our model cannot
    compute). ``max_seq_len``: default ``max_position_embeddings`` (rotary tables are that long).
    ``moe_kw``: training-time MoEConfig fields (aux_loss_coef, z_loss_coef, capacity_factor, ...)."""
    _check_mixtral(hf_cfg)
    fixed = sorted(set(moe_kw) & (set(MIXTRAL_ROUTING) | {"d_model", "d_ff", "num_experts", "top_k"}))
    if fixed:
        raise ValueError(
            f"moe.{fixed[0]}={moe_kw[fixed[0]]!r}: the checkpoint's config decides {fixed}; "
            "only training-time MoEConfig fields can be passed"
        )
    ours = {o: _get(hf_cfg, t) for o, t in CONFIG_FIELDS}
    if max_seq_len is not None:
        ours["max_seq_len"] = max_seq_len
    moe_fields = {o.removeprefix("moe."): ours.pop(o) for o in list(ours) if o.startswith("moe.")}
    moe = MoEConfig(d_model=ours["d_model"], **moe_fields, **MIXTRAL_ROUTING, **moe_kw)
    # the dense d_ff is unused when every block is MoE; the experts' width is the natural value
    return TransformerConfig(**ours, d_ff=moe.d_ff, moe_every=1, moe=moe)


def _check_mixtral(hf_cfg) -> None:
    def refuse(field, value, why):
        raise ValueError(f"Mixtral config.{field}={value!r} is not supported: {why}")

    model_type = getattr(hf_cfg, "model_type", None)
    if model_type != "mixtral":
        refuse("model_type", model_type, "only 'mixtral' checkpoints map onto moe.model.Transformer")
    H, D = hf_cfg.num_attention_heads, hf_cfg.hidden_size
    if hf_cfg.num_key_value_heads not in (None, H):
        refuse(
            "num_key_value_heads",
            hf_cfg.num_key_value_heads,
            f"our attention has one key/value head per head (num_attention_heads={H})",
        )
    head_dim = getattr(hf_cfg, "head_dim", None)
    if head_dim not in (None, D // H) or D % H:
        refuse("head_dim", head_dim, f"our head dim is hidden_size / num_attention_heads = {D}/{H}")
    if hf_cfg.hidden_act not in ("silu", "swish"):
        refuse("hidden_act", hf_cfg.hidden_act, "our experts are SwiGLU (silu gate)")
    if getattr(hf_cfg, "sliding_window", None) is not None:
        refuse("sliding_window", hf_cfg.sliding_window, "our attention is full causal attention; null is valid")
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        refuse("rope_parameters", rope, "only rope_type 'default' (no scaling) is implemented")
    for field in ("router_jitter_noise", "attention_dropout"):
        value = getattr(hf_cfg, field, 0.0) or 0.0
        if value != 0:
            refuse(field, value, "our model has no such noise; 0 is valid")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_cfg, field, False):
            refuse(field, True, "our model has no biases")
    quant = getattr(hf_cfg, "quantization_config", None)
    if quant is not None:
        refuse(
            "quantization_config",
            quant.get("quant_method", quant) if isinstance(quant, dict) else quant,
            "only unquantized checkpoints are read",
        )


def config_mismatches(cfg: TransformerConfig, hf_cfg) -> list[str]:
    """``model.x=ours (checkpoint: mixtral_field=theirs)`` for each architecture field of ``cfg`` that
    differs from the Mixtral config's (empty when the checkpoint's weights fit ``cfg``); also the
    fields of ``cfg`` no Mixtral model has. Training-time fields (aux losses, capacity, init, sequence
    length) are free."""
    try:
        check_exportable(cfg, dropless=False)
    except ValueError as e:
        return [str(e)]
    want = transformer_config(hf_cfg)
    out = []
    for ours, theirs in CONFIG_FIELDS:
        if ours in _NOT_ARCHITECTURE:
            continue
        a, b = _get(cfg, ours), _get(want, ours)
        if a != b:
            out.append(f"{ours if ours.startswith('moe.') else 'model.' + ours}={a!r} (checkpoint: {theirs}={b!r})")
    return out


# ---------------------------------------------------------------------------------------------
# state dicts


def _names(templates: tuple[str, ...], i: int, e: int | None = None) -> list[str]:
    return [t.format(i=i, e=e) for t in templates]


def _rows(cfg: TransformerConfig) -> Iterator[tuple[Row, int]]:
    """Every (row, block) of a model of ``cfg`` (block -1 for the rows outside the blocks)."""
    for row in TABLE:
        if row.ours[0] == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if "{i}" in row.ours[0]:
            for i in range(cfg.n_layers):
                yield row, i
        else:
            yield row, -1


def _check_state(src: TensorSource, cfg: TransformerConfig) -> None:
    """``src`` holds the whole model of ``cfg``: its names and shapes (read from the source's
    metadata, no tensor is loaded), every expert, and the Mixtral-less buffers zero (these small
    buffers are read). A tied head may be absent (it is the embedding)."""
    with torch.device("meta"):  # shapes only: nothing is allocated or drawn
        ref = Transformer(cfg).state_dict()
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    names = set(src.keys())
    missing = sorted(set(ref) - names - optional)
    unknown = sorted(names - set(ref))
    if missing or unknown:
        raise ValueError(
            f"the state dict does not hold a model of this config: missing {missing[:8]}, unknown {unknown[:8]}"
        )
    for name in sorted(set(ref) & names):
        got, want = tuple(src.meta(name).shape), tuple(ref[name].shape)
        if got != want:
            experts = ".experts." in name and got[1:] == want[1:]
            raise ValueError(
                f"{name} has shape {got}, the config's model {want}"
                + (
                    f": {got[0]} of num_experts={want[0]} experts; under expert parallelism gather every rank's experts "
                    "(a consolidated checkpoint) before exporting"
                    if experts
                    else ""
                )
            )
    for name in (n for i in range(cfg.n_layers) for n in _names(ZERO_IN_MIXTRAL, i)):
        if torch.count_nonzero(src.get(name)):
            raise _bad(name, "non-zero", "Mixtral's router has no selection bias")


def to_mixtral_state_dict(state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> ``MixtralForCausalLM.state_dict()`` names and layouts (transformers 5, fused
    experts), e.g. for ``hf_model.load_state_dict``."""
    check_exportable(cfg)
    _check_state(TensorSource(state), cfg)
    out = {}
    for row, i in _rows(cfg):
        out.update(
            zip(
                _names(row.module, i), (t.contiguous() for t in row.to_module(*(state[n] for n in _names(row.ours, i))))
            )
        )
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _file_tensors(get: Callable[[str], torch.Tensor], cfg: TransformerConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A Mixtral checkpoint file's (name, tensor), in table order, from ``get(our name)``.

    Each of our tensors is got once and dropped before the next is got, so with a lazy ``get`` (a
    checkpoint read tensor by tensor) one of our parameters is in memory at a time; with
    ``get=src.meta`` this yields the file's names and shapes without reading anything. Expert
    weights go out weight by weight (every expert's ``w1``, then ``w3``, then ``w2``): the order of
    a file does not matter to its readers."""
    for row, i in _rows(cfg):
        if not row.experts:
            outs = row.to_module(*(get(n) for n in _names(row.ours, i)))
            yield from zip(_names(row.file, i), outs)
            del outs
            continue
        for j, name in enumerate(_names(row.ours, i)):
            t = get(name)
            for e in range(cfg.moe.num_experts):
                yield _names(row.file, i, e)[j], t[e].t()
            del t


# ---------------------------------------------------------------------------------------------
# files


class TensorSource:
    """Named tensors to read from, one at a time: ``keys()``, ``meta(name)`` (a meta tensor of its
    shape and dtype, read from metadata only), ``get(name, lo, hi)`` (the tensor, or the slice
    ``[lo:hi]`` of dimension 0). This one wraps a state dict; ``_Files`` reads safetensors files
    lazily, and ``experiments.checkpoint`` reads a sharded training checkpoint parameter by
    parameter."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def keys(self):
        return self._state.keys()

    def __contains__(self, name):
        return name in self._state

    def meta(self, name: str) -> torch.Tensor:
        t = self._state[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        t = self._state[name]
        return t if lo is None else t[lo:hi]

    def get(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        if name not in self:
            raise KeyError(f"the checkpoint has no tensor {name}")
        return self._tensor(name, lo, hi)


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class _Files(TensorSource):
    """The tensors of a safetensors file, or of a directory's ``model.safetensors`` or of the shards
    its index lists, read lazily (a slice of dimension 0 reads only that slice)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        path = Path(path)
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if path.is_file():
            path, files = path.parent, [path.name]
        elif index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.exists():
            files = [single.name]
        else:
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a directory"
            raise FileNotFoundError(
                f"{path}: no model.safetensors or model.safetensors.index.json (found: {found}); "
                "only safetensors checkpoints are read"
            )
        handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        super().__init__({k: handle for handle in handles.values() for k in handle.keys()})

    def meta(self, name: str) -> torch.Tensor:
        info = self._state[name].get_slice(name)
        return torch.empty(info.get_shape(), dtype=_TORCH_DTYPES[info.get_dtype()], device="meta")

    def _tensor(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        handle = self._state[name]
        return handle.get_tensor(name) if lo is None else handle.get_slice(name)[lo:hi]


def write_safetensors(
    path: str | os.PathLike,
    entries: list[tuple[str, torch.Tensor]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a safetensors file tensor by tensor: ``entries`` (name, meta tensor) fix the header,
    then each tensor is taken from ``tensors`` (the same names, in the same order), converted to
    ``dtype`` (default: its own), written and dropped before the next is taken. Written to
    ``<path>.tmp`` and renamed, so a file under the final name is whole. Needs no safetensors
    package (the format is an 8-byte header length, a JSON header, the raw little-endian bytes)."""
    path = Path(path)
    header, offset = {}, 0
    for name, m in entries:
        dt = dtype or m.dtype
        nbytes = m.numel() * dt.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dt],
            "shape": list(m.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, m in entries:
            got, t = next(tensors)
            if got != name or t.shape != m.shape:
                raise RuntimeError(f"write_safetensors: expected {name} {tuple(m.shape)}, got {got} {tuple(t.shape)}")
            t = t.to(dtype or m.dtype).contiguous().reshape(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()))
            del t
    tmp.replace(path)
    return path


def _read(files: TensorSource, cfg: TransformerConfig, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Our state dict (experts ``[lo, hi)``) from a Mixtral checkpoint of ``cfg``, in either file
    layout; refuses a checkpoint that holds tensors the table does not know (biases, a second
    model...), naming them."""
    # a raw transformers 5 state_dict() holds the fused experts; a checkpoint file, one per expert
    fused = any(row.experts and _names(row.module, 0)[0] in files for row in TABLE)
    state, used = {}, set()
    for row, i in _rows(cfg):
        ours = _names(row.ours, i)
        if not row.experts or fused:
            names = _names(row.module if fused else row.file, i)
            sliced = (lo, hi) if row.experts else ()
            state.update(zip(ours, row.to_ours(*(files.get(n, *sliced) for n in names))))
            used.update(names)
        else:
            for j, name in enumerate(ours):
                state[name] = torch.stack([files.get(_names(row.file, i, e)[j]).t() for e in range(lo, hi)])
            used.update(n for e in range(cfg.moe.num_experts) for n in _names(row.file, i, e))
    for i in range(cfg.n_layers):
        state.update({n: torch.zeros(cfg.moe.num_experts) for n in _names(ZERO_IN_MIXTRAL, i)})
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # transformers ties it to the embedding, whatever the file holds
    unknown = sorted(n for n in files.keys() if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ValueError(
            f"the checkpoint holds tensors a Mixtral model of its config does not have, e.g. {unknown[:6]} "
            f"({len(unknown)} in all); our model has no biases or extra modules"
        )
    return state


# ---------------------------------------------------------------------------------------------
# export and import

DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hub's usual shard size


def export_mixtral(
    src,
    out_dir: str | os.PathLike,
    cfg: TransformerConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``src`` as a transformers Mixtral checkpoint directory: ``config.json`` and
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` each and ``model.safetensors.index.json`` (written last), which
    ``MixtralForCausalLM.from_pretrained(out_dir)`` loads.

    ``src``: a ``Transformer`` holding every expert (one process), or its ``state_dict()``, or the path
    of a safetensors file of our parameter names (a consolidated checkpoint), or a ``TensorSource``
    (e.g. ``experiments.checkpoint``'s reader of a sharded training checkpoint); ``cfg`` is required
    for all but the first. ``dtype``: the file's dtype (default: the embedding's). Returns ``out_dir``.

    The files are written tensor by tensor: from a file or a ``TensorSource`` one of our tensors is
    read at a time (the largest: one layer's expert weight over all experts, or the embedding)."""
    if isinstance(src, Transformer):
        cfg = src.cfg if cfg is None else cfg
        src = TensorSource(src.state_dict())
    elif isinstance(src, (str, os.PathLike)):
        src = _Files(Path(src))
    elif not isinstance(src, TensorSource):
        src = TensorSource(dict(src))
    if cfg is None:
        raise ValueError("export_mixtral needs cfg (the model's TransformerConfig) unless src is a Transformer")
    check_exportable(cfg)
    _check_state(src, cfg)
    dtype = src.meta("embed.weight").dtype if dtype is None else dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(f"{out} already holds {stale}; export into an empty directory")

    # plan the shards from the shapes, so every file's name knows the count before any is written
    entries = list(_file_tensors(src.meta, cfg))
    nbytes = {n: m.numel() * dtype.itemsize for n, m in entries}
    shards, size = [[]], 0
    for n, m in entries:
        if shards[-1] and size + nbytes[n] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, m))
        size += nbytes[n]
    mixtral_config(cfg, dtype).save_pretrained(out)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    tensors = _file_tensors(src.get, cfg)  # one generator across the shards: each of our tensors is read once
    for fname, shard in zip(files, shards):
        write_safetensors(out / fname, shard, tensors, dtype=dtype)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes.values())},
            "weight_map": {n: f for f, shard in zip(files, shards) for n, _ in shard},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def read_mixtral_config(path: str | os.PathLike):
    """The ``transformers.MixtralConfig`` of a checkpoint directory (only ``config.json`` is read)."""
    import transformers

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a transformers Mixtral checkpoint directory)")
    hf_cfg = transformers.AutoConfig.from_pretrained(str(path))
    _check_mixtral(hf_cfg)
    return hf_cfg


def import_mixtral(
    path: str | os.PathLike,
    model: Transformer | None = None,
    *,
    max_seq_len: int | None = None,
    layout=None,
    ep_group=None,
    dp_group=None,
    **moe_kw,
) -> Transformer:
    """Load a transformers Mixtral checkpoint directory into ``model`` (in place; returned), or into a
    new ``Transformer`` of the checkpoint's config (``max_seq_len``, ``moe_kw``: see
    ``transformer_config``; ``layout``/``ep_group``/``dp_group``: as ``Transformer`` takes them).

    ``model``'s config must match the checkpoint's on every architecture field (ValueError naming
    each mismatch); under expert parallelism each process reads only the experts it holds."""
    path = Path(path)
    hf_cfg = read_mixtral_config(path)
    return _import(
        lambda: _Files(path),
        hf_cfg,
        model,
        str(path),
        max_seq_len=max_seq_len,
        layout=layout,
        ep_group=ep_group,
        dp_group=dp_group,
        **moe_kw,
    )


def import_mixtral_state_dict(
    state: dict[str, torch.Tensor],
    hf_cfg,
    model: Transformer | None = None,
    *,
    max_seq_len: int | None = None,
    layout=None,
    ep_group=None,
    dp_group=None,
    **moe_kw,
) -> Transformer:
    """``import_mixtral`` from a transformers model's ``state_dict()`` and its config (e.g. a live
    ``MixtralForCausalLM``: ``import_mixtral_state_dict(m.state_dict(), m.config)``); the tensors are
    copied, the model is not changed."""
    _check_mixtral(hf_cfg)
    return _import(
        lambda: TensorSource(state),
        hf_cfg,
        model,
        "the state dict",
        max_seq_len=max_seq_len,
        layout=layout,
        ep_group=ep_group,
        dp_group=dp_group,
        **moe_kw,
    )


@torch.no_grad()
def _import(
    open_tensors: Callable[[], TensorSource],
    hf_cfg,
    model: Transformer | None,
    where: str,
    *,
    max_seq_len,
    layout,
    ep_group,
    dp_group,
    **moe_kw,
) -> Transformer:
    if model is None:
        model = Transformer(
            transformer_config(hf_cfg, max_seq_len=max_seq_len, **moe_kw),
            layout=layout,
            ep_group=ep_group,
            dp_group=dp_group,
        )
    else:
        bad = config_mismatches(model.cfg, hf_cfg)
        if bad:
            raise ValueError(f"{where}: the model's config does not match the checkpoint's: " + "; ".join(bad))
    experts = model.moe_layers()[0].experts
    lo = experts.expert_offset
    state = _read(open_tensors(), model.cfg, lo, lo + experts.num_local)  # after the config checks
    if model.cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    return model
