"""The trainer's tokenized data: prepared shards (``experiments.prepare``) as ``LMData``, prepared on
first use, and weighted mixtures of them.

``data.tokenizer`` (``resolve_tokenizer``): ``bytes`` (the default: byte-level data as
``experiments.training.data`` loads it, unchanged), a ``tokenizer.json``, a Hugging Face model folder,
or ``bpe:<N>``: a byte-level BPE tokenizer of N ids trained with ``tokenizers`` on the training side
of the run's sources (the documents ``prepare``'s split puts in train, so no validation text shapes
the vocabulary), cached by a hash of those texts.

A source (``data.path`` of ``data.source=text``, ``stdlib``, ``data.source=prepared``, or one entry of
``data.sources``) is either a prepared directory, opened as it is and refused when another tokenizer
wrote it, or anything ``experiments.prepare`` reads, prepared into the cache on first use
(``prepare_cached``: keyed by the files and the tokenizer; a warm cache opens at once, an interrupted
one resumes). ``stdlib`` names the standard library folder.

``Mixture``: ``data.sources`` with weights. Each step's global batch draws each row's source by weight,
then its window, from the generator of (seed, split, step) alone, so every rank draws the same
global batch and a resumed run the same rows (``LMData.get_batch``'s contract). Validation is per
source (``evaluate.validation``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from experiments.training.data import SPLITS, LMData, rank_rows, stdlib_path
from experiments.training.shards import MANIFEST, PreparedDataset

BPE_PREFIX = "bpe:"


class _Offsets(Mapping):
    # the document index of a prepared dataset, built on first use (8 bytes a document)
    def __init__(self, ds: PreparedDataset):
        self.ds = ds

    def __getitem__(self, split: str) -> np.ndarray:
        return self.ds.offsets(split)

    def __iter__(self):
        return iter(SPLITS)

    def __len__(self) -> int:
        return len(SPLITS)


def load_prepared(path, tokenizer, *, seed: int = 0, name: str | None = None) -> LMData:
    """A prepared directory as ``LMData`` (memory-mapped), refused when ``tokenizer`` (a spec or a
    ``Tokenizer``) did not write it: the message names both tokenizers and what to do."""
    ds = PreparedDataset(path, tokenizer=tokenizer)
    counts = ds.manifest["counts"]
    text = {s: counts[s].get("text_bytes") for s in SPLITS}  # absent in data prepared before it was recorded
    info = {
        "prepared": str(ds.path),
        "tokenizer": ds.manifest["tokenizer"]["spec"],
        "tokenizer_vocab_size": ds.tokenizer_vocab_size,
        "docs": counts["docs"],
        "text_bytes": counts["text_bytes"],
    }
    return LMData(ds.train, ds.val, ds.vocab_size, name or str(path), seed, info, offsets=_Offsets(ds), text_bytes=text)


def is_prepared(path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def source_path(path) -> Path:
    """``stdlib`` is the standard library's folder; any other value a path."""
    return stdlib_path() if str(path) == "stdlib" else Path(str(path)).expanduser()


def _prepare_kw(cfg) -> dict:
    return dict(
        field=str(cfg.get("text_field", "text")),
        workers=cfg.get("prepare_workers"),
        val_fraction=float(cfg["val_fraction"]),
        split_seed=int(cfg["split_seed"]),
        progress=False,
    )


def resolve_tokenizer(cfg, sources: list):
    """The run's tokenizer from ``data.tokenizer`` (see the module docstring): a ``Tokenizer``."""
    from experiments.training.tokenizer import load_tokenizer

    spec = str(cfg["tokenizer"])
    if not spec.startswith(BPE_PREFIX):
        return load_tokenizer(spec)
    n = spec[len(BPE_PREFIX) :]
    if not n.isdigit() or int(n) < 257:
        raise ValueError(
            f"data.tokenizer={spec!r} is invalid: bpe:<N> needs a vocabulary size N >= 257 (256 bytes and the "
            "end-of-text token), e.g. bpe:4096"
        )
    raw = [source_path(s) for s in sources if not is_prepared(source_path(s))]
    if not raw:
        raise ValueError(
            f"data.tokenizer={spec!r} trains on the run's sources, but every one is already prepared: give the "
            "tokenizer.json they were prepared with"
        )
    return load_tokenizer(_train_bpe_on(raw, int(n), cfg))


def _train_bpe_on(paths: list[Path], vocab: int, cfg) -> Path:
    import xxhash

    from experiments.training.corpus import iter_documents
    from experiments.training.tokenizer import train_bpe

    # prepare's split (experiments.prepare): validation when the content's hash is below the fraction
    threshold, seed = int(float(cfg["val_fraction"]) * 2**64), int(cfg["split_seed"])
    texts = [
        t
        for t in iter_documents(paths, str(cfg.get("text_field", "text")))
        if xxhash.xxh3_64_intdigest(t.encode("utf-8"), seed=seed) >= threshold
    ]
    return train_bpe(texts, vocab, cache_root=cfg.get("cache_dir"))


def open_source(path, tok, cfg, *, seed: int = 0, name: str | None = None) -> LMData:
    """One source: a prepared directory as it is, anything else prepared with ``tok`` on first use."""
    from experiments.training.preparing import prepare_cached

    p = source_path(path)
    if not is_prepared(p):
        if not p.exists():
            raise FileNotFoundError(
                f"data source {str(path)!r} does not exist: expected a prepared directory, `stdlib`, or a text file, "
                "folder, .jsonl, .parquet or datasets folder to prepare"
            )
        p = prepare_cached([p], tok, cfg.get("cache_dir"), **_prepare_kw(cfg))
    return load_prepared(p, tok, seed=seed, name=name or str(path))


# ----------------------------------------------------------------------------- mixtures


@dataclass
class Mixture:
    """Sources drawn by weight (see the module docstring). Quacks like ``LMData`` where the
    trainer uses it: ``get_batch``, ``vocab_size``, ``name``, ``info``, ``train``/``val`` lengths,
    ``unigram_entropy``; ``parts`` are the sources, ``names`` their metric names."""

    parts: list[LMData]
    weights: list[float]
    names: list[str]
    seed: int = 0
    _p: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if not self.parts:
            raise ValueError("a mixture needs at least one source (data.sources)")
        w = torch.tensor(self.weights, dtype=torch.float64)
        self._p = w / w.sum()
        self.parts = [p if p.seed == self.seed else _reseed(p, self.seed) for p in self.parts]

    @property
    def vocab_size(self) -> int:
        return max(p.vocab_size for p in self.parts)

    @property
    def name(self) -> str:
        return " + ".join(f"{n} x{w:.3g}" for n, w in zip(self.names, self.probabilities))

    @property
    def probabilities(self) -> list[float]:
        return self._p.tolist()

    @property
    def info(self) -> dict:
        return {n: p.info for n, p in zip(self.names, self.parts)}

    @property
    def train(self):
        return _Length(sum(len(p.train) for p in self.parts))

    @property
    def val(self):
        return _Length(sum(len(p.val) for p in self.parts))

    def sources_of(self, split: str, step: int, global_batch: int, seq_len: int):
        """``(source_G, start_G)`` of the step's global batch: each row's source, drawn by weight, and
        its window's start, both from the (seed, split, step) generator alone."""
        g = self.parts[0]._generator(split, step)
        src_G = torch.multinomial(self._p, global_batch, replacement=True, generator=g)
        u_G = torch.rand(global_batch, dtype=torch.float64, generator=g)
        for s in src_G.unique().tolist():
            tokens = self.parts[s].train if split == "train" else self.parts[s].val
            if len(tokens) < seq_len + 1:
                raise ValueError(
                    f"data source {self.names[s]!r}: the {split} split has {len(tokens)} tokens, fewer than "
                    f"seq_len+1={seq_len + 1}"
                )
        room_G = torch.tensor(
            [len(p.train if split == "train" else p.val) - seq_len for p in self.parts], dtype=torch.float64
        )[src_G]
        return src_G, (u_G * room_G).long()

    def get_batch(
        self,
        split: str,
        step: int,
        global_batch: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        microbatches: int = 1,
        documents: bool = False,
    ):
        """As ``LMData.get_batch``: this dp rank's rows of the step's global batch."""
        if microbatches < 1 or global_batch % (dp_size * microbatches):
            raise ValueError(
                f"global batch size {global_batch} is not divisible by the data-parallel size {dp_size} "
                f"x {microbatches} micro-batches"
            )
        src_G, start_G = self.sources_of(split, step, global_batch, seq_len)
        rows_B = rank_rows(torch.stack([src_G, start_G], 1), dp_rank, dp_size, microbatches).tolist()
        out = [self.parts[s].windows(split, [start], seq_len, documents) for s, start in rows_B]
        return tuple(torch.cat(parts) for parts in zip(*out))

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy in nats of the weight-mixed token frequencies of the sources' split."""
        p = np.zeros(self.vocab_size)
        for part, w in zip(self.parts, self.probabilities):
            tokens = part.train if split == "train" else part.val
            counts = np.bincount(np.asarray(tokens), minlength=self.vocab_size).astype(np.float64)
            p += w * counts / counts.sum()
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())


class _Length:
    # what the trainer's summary line reads of a mixture's splits: their total length
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _reseed(data: LMData, seed: int) -> LMData:
    import dataclasses

    return dataclasses.replace(data, seed=seed)


def build_mixture(cfg, tok, seed: int = 0) -> Mixture:
    """``data.sources``: ``[{path, weight, name}]``, each opened by ``open_source``."""
    parts, weights, names = [], [], []
    for i, s in enumerate(cfg["sources"]):
        w = s.get("weight", 1.0)
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"data.sources[{i}].weight={w!r} is invalid: expected a positive number")
        name = s.get("name") or Path(str(s["path"])).name or str(s["path"])
        if "/" in name or name in names:
            raise ValueError(
                f"data.sources[{i}].name={name!r} is invalid: names key the per-source metrics "
                f"(val_loss/<name>), so they must be unique and hold no '/' (taken: {names})"
            )
        parts.append(open_source(s["path"], tok, cfg, seed=seed, name=name))
        weights.append(float(w))
        names.append(name)
    return Mixture(parts, weights, names, seed)


# ----------------------------------------------------------------------------- the trainer's entry


def is_tokenized(cfg) -> bool:
    """Whether ``data`` goes through a tokenizer and prepared data (else byte-level or flat token
    files, as ``experiments.training.data`` loads them)."""
    return bool(cfg.get("sources")) or str(cfg.get("tokenizer", "bytes")) != "bytes" or cfg["source"] == "prepared"


def build_tokenized(cfg, seed: int = 0) -> LMData | Mixture:
    """The data of a ``data`` config that ``is_tokenized``: one source, or ``data.sources``' mixture."""
    source = cfg["source"]
    if cfg.get("sources"):
        paths = [s["path"] for s in cfg["sources"]]
    elif source == "stdlib":
        paths = ["stdlib"]
    elif source in ("text", "prepared"):
        paths = [cfg["path"]]
    else:
        raise ValueError(
            f"data.source={source!r} with data.tokenizer={cfg.get('tokenizer')!r}: a flat token file is already "
            "tokenized; use data.source=text, stdlib or prepared (a directory written by experiments.prepare)"
        )
    if source == "prepared" and not cfg.get("sources") and not is_prepared(paths[0]):
        raise FileNotFoundError(
            f"data.path={paths[0]!r} holds no {MANIFEST}: data.source=prepared takes a directory written by "
            "`python -m experiments.prepare` (an unfinished prepare has no manifest: rerun it to resume)"
        )
    tok = resolve_tokenizer(cfg, paths)
    if cfg.get("sources"):
        return build_mixture(cfg, tok, seed)
    return open_source(paths[0], tok, cfg, seed=seed, name="python-stdlib" if source == "stdlib" else None)


def fit_model_vocab(cfg, data) -> None:
    """The model's vocabulary follows tokenized data: ``model.vocab_size`` (and ``data.vocab_size``)
    become the tokenizer's, padded to a multiple of 64; unless ``model.init_from`` fixes it, when
    the tokenizer's ids must fit in the checkpoint's vocabulary. A no-op for byte-level and flat token
    data (their ``data.vocab_size`` is the configured one)."""
    if not is_tokenized(cfg.data):
        return
    parts = data.parts if isinstance(data, Mixture) else [data]
    if cfg.model.get("init_from"):
        for p in parts:
            ids = p.info["tokenizer_vocab_size"]
            if ids > cfg.model.vocab_size:
                raise ValueError(
                    f"data {p.name!r} was tokenized by {p.info['tokenizer']!r} into {ids} ids, but "
                    f"model.init_from={cfg.model.init_from!r} fixes model.vocab_size={cfg.model.vocab_size}: the "
                    f"tokenizer's ids must fit the checkpoint's vocabulary; use the checkpoint's own tokenizer "
                    f"(data.tokenizer={cfg.model.init_from})"
                )
    else:
        cfg.data.vocab_size = data.vocab_size
        cfg.model.vocab_size = data.vocab_size
    for p in parts:  # an id the model has no row for (a damaged or foreign shard): its file, position, document
        if p.info.get("prepared"):
            PreparedDataset(p.info["prepared"]).check_vocab(int(cfg.model.vocab_size))
