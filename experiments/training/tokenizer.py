"""Tokenizers for language-model data: one small interface, three kinds, chosen by a spec string.

    tok = load_tokenizer("bytes")                 # byte-level, vocabulary 256, NUL ends a document
    tok = load_tokenizer("runs/tok/tokenizer.json")  # a Hugging Face ``tokenizers`` file
    tok = load_tokenizer("models/llama-3-8b")     # a model folder: tokenizer.json + its json configs
    ids = tok.encode_batch(["some text", "more"])  # list[list[int]], no special tokens
    doc = tok.separator.wrap(ids[0])              # the document as it lies in prepared data

The interface (``Tokenizer``): ``encode_batch``, ``decode``, ``vocab_size`` (ids lie in
``[0, vocab_size)``), ``eos_id`` / ``bos_id`` (None where the tokenizer has none), ``separator``
(the ids put around every document) and ``fingerprint()``, a hash of everything that decides the
ids of prepared data: the tokenizer's whole serialized state and the separator convention.

``encode_batch`` never adds special tokens, and text that spells a special token (a document about
GPT-2 that contains ``<|endoftext|>``) is encoded as plain text: the only separators in prepared data
are the ones the separator convention puts there, so a document index and the separators agree.

The separator convention follows the tokenizer's own: BOS before every document where it says so
(``add_bos_token`` in ``tokenizer_config.json``, Llama-style, or a post-processor template that
starts with a special token), EOS after every document where it says so (``add_eos_token`` or a
template ending in one) and, where it says neither, EOS after every document (GPT-2-style). ``bytes``
keeps the byte-level trainer's convention (``experiments/data.py``): a NUL byte ends every document.

The model's vocabulary is the tokenizer's padded to a multiple of 64 (``padded_vocab``).

``train_bpe`` trains a byte-level BPE tokenizer locally (any text round-trips; ``<|endoftext|>`` is
its EOS), deterministic for the same input and cached by a hash of it.

``tokenizers`` (the ``data`` extra) is imported only when a Hugging Face tokenizer is loaded or
trained: ``bytes`` works with the core dependencies alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

BYTES_SEPARATOR = 0  # experiments/data.py's SEPARATOR: NUL ends every document
EOS_TOKEN = "<|endoftext|>"  # train_bpe's EOS
# special tokens taken as EOS by a bare tokenizer.json, in this order (GPT-2 / Llama 1-2 / Llama 3 / Gemma)
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
MODEL_DIR_FILES = ("tokenizer_config.json", "special_tokens_map.json", "config.json")


def padded_vocab(n: int, multiple: int = 64) -> int:
    """The model's vocabulary for a tokenizer of ``n`` ids: ``n`` rounded up to a multiple of
    ``multiple`` (embedding and output matmuls run at full speed on such shapes)."""
    if n < 1 or multiple < 1:
        raise ValueError(f"padded_vocab(n={n}, multiple={multiple}): both must be positive")
    return -(-n // multiple) * multiple


def _digest(obj) -> str:
    return xxhash.xxh3_128(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Separator:
    """The ids around every document in prepared data: ``bos`` before it, ``eos`` after it (None: not
    added). A document's span in the document index includes them."""

    bos: int | None
    eos: int | None

    def wrap(self, ids: Sequence[int]) -> list[int]:
        return ([self.bos] if self.bos is not None else []) + list(ids) + ([self.eos] if self.eos is not None else [])

    @property
    def extra(self) -> int:
        return (self.bos is not None) + (self.eos is not None)

    def as_dict(self) -> dict:
        return {"bos": self.bos, "eos": self.eos}


class Tokenizer:
    """The interface every kind implements. Picklable: a worker process gets its own copy."""

    kind: str  # "bytes" | "json" | "model_dir"
    spec: str  # what load_tokenizer was given (a resolved path for files and folders)
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    separator: Separator

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def _state(self) -> dict:
        """Everything that decides the ids this tokenizer gives (hashed by ``fingerprint``)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """XXH3-128 (hex) of the tokenizer's whole serialized state and its separator convention.
        Stable across processes, machines and file formatting (the JSON is canonicalized), so two
        tokenizers with the same fingerprint give the same prepared data."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = _digest({"state": self._state(), "separator": self.separator.as_dict()})
        return self._fingerprint

    def encode_documents(self, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        """The documents as they lie in prepared data, concatenated: ``(tokens, lengths)``, each
        document wrapped in the separator (its length counts the separator)."""
        encoded = self.encode_batch(texts)
        bos, eos = self.separator.bos, self.separator.eos
        lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded)) + self.separator.extra
        out = np.empty(int(lengths.sum()), dtype=dtype)
        pos = 0
        for ids in encoded:
            if bos is not None:
                out[pos] = bos
                pos += 1
            out[pos : pos + len(ids)] = ids
            pos += len(ids)
            if eos is not None:
                out[pos] = eos
                pos += 1
        return out, lengths

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "spec": self.spec,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "fingerprint": self.fingerprint(),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, separator={self.separator})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids: the trainer's byte-level default. A NUL byte ends every document, as in
    ``experiments/data.py``; ``decode`` replaces invalid UTF-8 (a cut through a character)."""

    kind = "bytes"
    spec = "bytes"
    vocab_size = 256
    eos_id = BYTES_SEPARATOR
    bos_id = None
    separator = Separator(bos=None, eos=BYTES_SEPARATOR)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_documents(self, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        # one buffer for the whole batch instead of a Python int per byte
        raw = [t.encode("utf-8") for t in texts]
        if not raw:
            return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int64)
        joined = np.frombuffer(b"\x00".join(raw) + b"\x00", dtype=np.uint8)
        lengths = np.fromiter((len(r) + 1 for r in raw), dtype=np.int64, count=len(raw))
        return joined.astype(dtype), lengths

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def _state(self) -> dict:
        return {"kind": "bytes", "vocab_size": 256}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "a tokenizer.json needs the Hugging Face `tokenizers` library: pip install -e '.[data]' "
            "(or use --tokenizer bytes)"
        ) from e
    return tokenizers


def _token_content(value) -> str | None:
    # transformers writes a special token either as its string or as a serialized AddedToken
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_specials(post_processor: dict | None) -> tuple[str | None, str | None]:
    """(first, last) special token of a TemplateProcessing post-processor's single-sequence
    template, looked for inside a Sequence too: what the tokenizer itself puts around a text."""
    if not post_processor:
        return None, None
    if post_processor.get("type") == "Sequence":
        for p in post_processor.get("processors", []):
            found = _template_specials(p)
            if found != (None, None):
                return found
        return None, None
    if post_processor.get("type") != "TemplateProcessing":
        return None, None
    single = post_processor.get("single") or []
    first = single[0].get("SpecialToken", {}).get("id") if single else None
    last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
    return first, last


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``), alone (kind ``json``) or from a
    model folder (kind ``model_dir``), whose json configs name BOS/EOS and the convention."""

    def __init__(self, json_text: str, *, kind: str, spec: str, configs: dict[str, dict] | None = None):
        self.kind, self.spec = kind, spec
        self._json = json_text
        self._configs = configs or {}
        self._load()
        self._resolve_specials()

    def _load(self) -> None:
        tokenizers = _import_tokenizers()
        try:
            tok = tokenizers.Tokenizer.from_str(self._json)
        except Exception as e:  # the Rust library raises a bare Exception on a malformed file
            raise ValueError(
                f"tokenizer {self.spec!r} could not be loaded by tokenizers {tokenizers.__version__}: {e}; "
                "expected a tokenizer.json as written by tokenizers' Tokenizer.save or transformers' save_pretrained"
            ) from None
        # a shipped tokenizer.json may enable truncation (max_length 512 is common) or padding, which would
        # silently cut or pad documents
        tok.no_truncation()
        tok.no_padding()
        # literal special-token text in a document is text, not a separator (see the module docstring)
        tok.encode_special_tokens = True
        self._tok = tok
        self._encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
        vocab = tok.get_vocab(with_added_tokens=True)
        # ids, not the count of tokens: added tokens may leave holes
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        if self.vocab_size == 0:
            raise ValueError(f"tokenizer {self.spec!r} has an empty vocabulary")

    def _id_of(self, token: str, where: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{where} names the special token {token!r}, which tokenizer {self.spec!r} does not hold")
        return i

    def _resolve_specials(self) -> None:
        parsed = json.loads(self._json)
        tc = self._configs.get("tokenizer_config.json", {})
        stm = self._configs.get("special_tokens_map.json", {})
        cfg = self._configs.get("config.json", {})
        first, last = _template_specials(parsed.get("post_processor"))

        def special(name: str) -> int | None:
            # tokenizer_config.json, then special_tokens_map.json, then config.json's ids
            for fname, conf in (("tokenizer_config.json", tc), ("special_tokens_map.json", stm)):
                token = _token_content(conf.get(f"{name}_token"))
                if token:
                    return self._id_of(token, f"{Path(self.spec) / fname} ({name}_token)")
            ident = cfg.get(f"{name}_token_id")
            if isinstance(ident, list):  # Llama 3 instruct lists several EOS ids; the first is the base model's
                ident = ident[0] if ident else None
            if isinstance(ident, int):
                return ident
            return None

        specials = [t["content"] for t in parsed.get("added_tokens", []) if t.get("special")]
        self.bos_id = special("bos")
        if self.bos_id is None and first is not None:
            self.bos_id = self._id_of(first, f"tokenizer {self.spec!r}'s post-processor")
        self.eos_id = special("eos")
        if self.eos_id is None and last is not None:
            self.eos_id = self._id_of(last, f"tokenizer {self.spec!r}'s post-processor")
        if self.eos_id is None:
            named = [t for t in EOS_NAMES if t in specials]
            self.eos_id = self._tok.token_to_id(named[0]) if named else None

        add_bos = tc.get("add_bos_token", first is not None and self._tok.token_to_id(first) == self.bos_id)
        add_eos = tc.get("add_eos_token", last is not None and self._tok.token_to_id(last) == self.eos_id)
        if not add_bos and not add_eos:
            add_eos = True  # the tokenizer adds nothing itself: EOS ends a document (GPT-2-style)
        if add_bos and self.bos_id is None:
            raise ValueError(
                f"tokenizer {self.spec!r} asks for a BOS token before every text (add_bos_token) but names none: "
                "set bos_token in its tokenizer_config.json"
            )
        if add_eos and self.eos_id is None:
            raise ValueError(
                f"tokenizer {self.spec!r} has no EOS token to end documents with: none is named in "
                f"{', '.join(MODEL_DIR_FILES)} and its special tokens {specials} include none of {list(EOS_NAMES)}; "
                f"add one (e.g. {EOS_TOKEN!r}) or pass the model folder whose tokenizer_config.json names eos_token"
            )
        self.separator = Separator(bos=self.bos_id if add_bos else None, eos=self.eos_id if add_eos else None)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encode(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _state(self) -> dict:
        return {"kind": "tokenizers", "tokenizer": json.loads(self._json)}

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_tok")
        state.pop("_encode")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._load()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer file {str(path)!r} could not be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer file {str(path)!r} holds a JSON {type(data).__name__}, expected an object")
    return data


def load_tokenizer(spec: str | os.PathLike | Tokenizer) -> Tokenizer:
    """``"bytes"``; a path to a ``tokenizer.json`` (any ``.json`` file written by ``tokenizers``); or a
    path to a Hugging Face model folder holding ``tokenizer.json`` (its ``tokenizer_config.json``,
    ``special_tokens_map.json`` and ``config.json`` name BOS/EOS and the convention). Nothing is
    downloaded: a hub name must be downloaded first."""
    if isinstance(spec, Tokenizer):
        return spec
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    valid = "expected 'bytes', a tokenizer.json file, or a Hugging Face model folder holding tokenizer.json"
    if not path.exists():
        hint = ""
        if not path.is_absolute() and str(spec).count("/") == 1:
            hint = (
                f"; to use the hub's {spec}, download it first (huggingface-cli download {spec} --local-dir DIR) "
                "and pass DIR"
            )
        raise FileNotFoundError(f"tokenizer {str(spec)!r} not found: {valid}{hint}")
    resolved = str(path.resolve())
    if path.is_dir():
        tj = path / "tokenizer.json"
        if not tj.is_file():
            present = sorted(p.name for p in path.iterdir() if p.is_file())
            raise FileNotFoundError(
                f"model folder {resolved!r} has no tokenizer.json (it holds {present[:12]}); only the fast-tokenizer "
                "file is read: convert the slow files with transformers "
                "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) or pass a tokenizer.json"
            )
        configs = {name: _read_json(path / name) for name in MODEL_DIR_FILES if (path / name).is_file()}
        return HFTokenizer(_read_text(tj), kind="model_dir", spec=resolved, configs=configs)
    return HFTokenizer(_read_text(path), kind="json", spec=resolved)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {str(path)!r} could not be read ({e}); expected a tokenizer.json") from None


# ----------------------------------------------------------------------------- local BPE training


def _cache_root(cache_root: str | os.PathLike | None) -> Path:
    # experiments/data.py's cache location
    return Path(cache_root or os.environ.get("SWITCHYARD_CACHE") or "~/.cache/switchyard").expanduser()


def _training_texts(texts_or_files: Iterable[str | os.PathLike]) -> tuple[list[str], str]:
    """The training texts and a hash of them. ``str`` items are texts; ``os.PathLike`` items are
    sources read as ``experiments.prepare`` reads them (text files, folders, .jsonl, .parquet). A
    ``str`` is never taken for a path: a text that happens to name a file stays a text."""
    from experiments.prepare import iter_documents  # the sources' reader; imported here to keep this module light

    texts = []
    for item in texts_or_files:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, os.PathLike):
            texts.extend(iter_documents([item]))
        else:
            raise ValueError(f"train_bpe: {type(item).__name__} {item!r} is neither a text (str) nor a path")
    if not texts:
        raise ValueError("train_bpe: no texts to train on (the inputs hold no documents)")
    h = xxhash.xxh3_128()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))  # lengths too: ["ab", "c"] and ["a", "bc"] differ
        h.update(b)
    return texts, h.hexdigest()


def train_bpe(
    texts_or_files: Iterable[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike | None = None,
    *,
    min_frequency: int = 2,
    cache_root: str | os.PathLike | None = None,
) -> Path:
    """Train a byte-level BPE tokenizer and write its ``tokenizer.json`` to ``out_path`` (default:
    ``<cache>/tokenizers/bpe-<key>.json``); returns the path. ByteLevel pre-tokenizer and decoder
    (every text round-trips), ``<|endoftext|>`` (id 0) as EOS. Deterministic: the same texts give
    the same file. Cached: a key of the texts, ``vocab_size``, ``min_frequency`` and the
    ``tokenizers`` version is kept beside the file (``<out>.key``) and a matching file is reused."""
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"train_bpe: vocab_size={vocab_size} is below 257, the 256 bytes and {EOS_TOKEN}")
    texts, text_hash = _training_texts(texts_or_files)
    key = _digest(
        {"texts": text_hash, "vocab_size": vocab_size, "min_frequency": min_frequency, "v": tokenizers.__version__}
    )
    out = Path(out_path) if out_path is not None else _cache_root(cache_root) / "tokenizers" / f"bpe-{key[:16]}.json"
    key_file = out.with_name(out.name + ".key")
    if out.is_file() and key_file.is_file() and key_file.read_text().strip() == key:
        return out

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    from zero.checkpoint import write_durably  # imports torch: only here, never in prepare's workers

    out.parent.mkdir(parents=True, exist_ok=True)
    key_file.unlink(missing_ok=True)  # the key goes last: a crash in between leaves a file that is not reused
    write_durably(out, tok.to_str().encode())
    write_durably(key_file, key.encode())
    return out
