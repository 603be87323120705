"""Tokenizers: round trips of every kind, the separator conventions read from a model folder, a
stable fingerprint, a deterministic cached BPE trainer, clear refusals. Everything is built here
with ``tokenizers``; nothing is downloaded."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.training.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    Separator,
    load_tokenizer,
    padded_vocab,
    train_bpe,
)

tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Grüße, 世界! 🎉 tabs\tand  double  spaces\r\nand a windows line end",
    "   leading spaces, trailing spaces   ",
    "a" * 300,
    "",
]
CORPUS = [f"def function_{i}(value):\n    return value * {i} + {i % 7}\n" for i in range(200)] + TEXTS


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(CORPUS, 400, tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def _llama_style(tmp: Path, *, template: bool, config: dict | None) -> Path:
    """A model folder like Llama 2's: <unk>/<s>/</s>, a tokenizer_config.json saying add_bos_token."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = tmp / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_bytes_round_trip_and_separator():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    ids = tok.encode_batch(TEXTS)
    assert ids[0] == list(TEXTS[0].encode())
    assert [tok.decode(i) for i in ids] == TEXTS
    # experiments/data.py's convention: a NUL byte after every document
    assert tok.separator == Separator(bos=None, eos=0) and tok.eos_id == 0 and tok.bos_id is None
    tokens, lengths = tok.encode_documents(TEXTS, "uint16")
    assert lengths.tolist() == [len(t.encode()) + 1 for t in TEXTS]
    assert tokens.tolist() == [b for t in TEXTS for b in [*t.encode(), 0]]
    assert tok.fingerprint() == load_tokenizer("bytes").fingerprint()


def test_json_round_trip_eos_and_literal_special_tokens(bpe):
    tok = load_tokenizer(bpe)
    assert tok.kind == "json" and 257 < tok.vocab_size <= 400  # fewer where the corpus runs out of merges
    assert [tok.decode(ids) for ids in tok.encode_batch(TEXTS)] == TEXTS  # byte-level: any text round-trips
    assert tok.eos_id == 0 and tok.separator == Separator(bos=None, eos=0)
    # a document that spells the EOS token holds plain text there, never the separator
    text = f"GPT-2 ends documents with {EOS_TOKEN} in its data"
    (ids,) = tok.encode_batch([text])
    assert tok.eos_id not in ids and tok.decode(ids) == text
    tokens, lengths = tok.encode_documents([text, "x"], "uint16")
    assert tokens.tolist() == [*ids, 0, *tok.encode_batch(["x"])[0], 0] and lengths.tolist() == [len(ids) + 1, 2]
    # the worker processes' copy
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode_batch(TEXTS) == tok.encode_batch(TEXTS) and clone.fingerprint() == tok.fingerprint()


def test_model_dir_add_bos_token(tmp_path):
    d = _llama_style(
        tmp_path,
        template=False,
        config={"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": {"content": "</s>"}},
    )
    tok = load_tokenizer(d)
    assert tok.kind == "model_dir" and (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.separator == Separator(bos=1, eos=None)  # Llama-style: BOS before every document, no EOS
    assert [tok.decode(ids) for ids in tok.encode_batch(TEXTS)] == TEXTS
    tokens, lengths = tok.encode_documents(["ab", "c"], "uint16")
    assert tokens.tolist() == [1, *tok.encode_batch(["ab"])[0], 1, *tok.encode_batch(["c"])[0]]
    # encode_batch adds no special tokens of its own (the convention is the separator's)
    assert 1 not in tok.encode_batch(["ab"])[0]


def test_model_dir_conventions_from_configs_and_template(tmp_path):
    # the post-processor's template alone says BOS
    (tmp_path / "a").mkdir()
    tok = load_tokenizer(_llama_style(tmp_path / "a", template=True, config=None) / "tokenizer.json")
    assert tok.separator == Separator(bos=1, eos=None)
    # tokenizer_config.json overrides the template; EOS from special_tokens_map.json
    (tmp_path / "b").mkdir()
    d = _llama_style(tmp_path / "b", template=True, config={"add_bos_token": False})
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    assert load_tokenizer(d).separator == Separator(bos=None, eos=2)
    # GPT-2-style: config.json's eos_token_id, nothing added by the tokenizer: EOS after every document
    (tmp_path / "c").mkdir()
    d = _llama_style(tmp_path / "c", template=False, config=None)
    (d / "config.json").write_text(json.dumps({"eos_token_id": [2, 1], "vocab_size": 32000}))
    tok = load_tokenizer(d)
    assert tok.separator == Separator(bos=None, eos=2) and tok.vocab_size == 350


def test_truncation_in_the_file_is_ignored(tmp_path, bpe):
    spec = json.loads(bpe.read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "t.json").write_text(json.dumps(spec))
    ids = load_tokenizer(tmp_path / "t.json").encode_batch(["a long text " * 20])[0]
    assert len(ids) > 4


def test_fingerprint_is_the_state_not_the_formatting(tmp_path, bpe):
    tok = load_tokenizer(bpe)
    spec = json.loads(bpe.read_text())
    (tmp_path / "pretty.json").write_text(json.dumps(spec, indent=4))
    assert load_tokenizer(tmp_path / "pretty.json").fingerprint() == tok.fingerprint()
    # the same tokenizer.json in a model folder that asks for nothing else: the same tokenizer
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text(bpe.read_text())
    assert load_tokenizer(tmp_path / "m").fingerprint() == tok.fingerprint()
    # another separator convention: another fingerprint (the prepared ids differ)
    (tmp_path / "m" / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN})
    )
    assert load_tokenizer(tmp_path / "m").fingerprint() != tok.fingerprint()
    # one merge fewer: another fingerprint
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tmp_path / "less.json").write_text(json.dumps(spec))
    assert load_tokenizer(tmp_path / "less.json").fingerprint() != tok.fingerprint()
    assert len(tok.fingerprint()) == 32 and tok.fingerprint() != load_tokenizer("bytes").fingerprint()


def test_train_bpe_deterministic_and_cached(tmp_path):
    a = train_bpe(CORPUS, 350, tmp_path / "a.json")
    b = train_bpe(CORPUS, 350, tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    mtime = a.stat().st_mtime_ns
    assert train_bpe(CORPUS, 350, a) == a and a.stat().st_mtime_ns == mtime  # the cache: not trained again
    assert train_bpe(CORPUS, 360, a).stat().st_mtime_ns != mtime  # another vocabulary: trained again
    # files read as prepare reads them give the texts' tokenizer
    (tmp_path / "src").mkdir()
    for i, t in enumerate(CORPUS):
        (tmp_path / "src" / f"{i:03d}.txt").write_text(t)
    c = train_bpe([tmp_path / "src"], 350, tmp_path / "c.json")
    assert c.read_bytes() == train_bpe([t for t in CORPUS if t], 350, tmp_path / "d.json").read_bytes()
    # the default location: keyed by the inputs under the cache root
    assert train_bpe(CORPUS, 350, cache_root=tmp_path / "cache").parent == tmp_path / "cache" / "tokenizers"


def test_padded_vocab():
    assert [padded_vocab(n) for n in (1, 64, 65, 256, 50257, 65536, 65537)] == [64, 64, 128, 256, 50304, 65536, 65600]
    assert padded_vocab(100, multiple=128) == 128
    with pytest.raises(ValueError, match="positive"):
        padded_vocab(0)


def test_refusals(tmp_path, bpe):
    with pytest.raises(FileNotFoundError, match=r"'nope\.json' not found: expected 'bytes', a tokenizer\.json"):
        load_tokenizer("nope.json")
    with pytest.raises(FileNotFoundError, match="download it first"):
        load_tokenizer("gpt2-org/gpt2-model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json.*expected a tokenizer\.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match=r"could not be loaded by tokenizers .*expected a tokenizer\.json"):
        load_tokenizer(tmp_path / "other.json")
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json \(it holds \['tokenizer\.model'\]\)"):
        load_tokenizer(tmp_path / "slow")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text(bpe.read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"names the special token '<\|im_end\|>', which tokenizer .* does not hold"):
        load_tokenizer(tmp_path / "m")
    spec = json.loads(bpe.read_text())
    spec["added_tokens"] = []
    (tmp_path / "noeos.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"has no EOS token to end documents with"):
        load_tokenizer(tmp_path / "noeos.json")
    with pytest.raises(ValueError, match="vocab_size=100 is below 257"):
        train_bpe(["x"], 100, tmp_path / "t.json")
    with pytest.raises(ValueError, match="no texts to train on"):
        train_bpe([], 300, tmp_path / "t.json")


@pytest.mark.distributed
def test_core_packages_do_not_import_tokenizers():
    code = (
        "import sys, moe, zero, routing_kernels, experiments.prepare, experiments.training.shards; "
        "heavy = sorted(m for m in ('tokenizers', 'pyarrow', 'datasets') if m in sys.modules); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
