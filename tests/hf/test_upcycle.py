"""Sparse upcycling (``moe.hf.upcycle``): ``model.init_from=<dense Llama or Qwen3 dir>`` with
``model.upcycle.num_experts=E``, ``model.upcycle.top_k=k``. Step 0's model is the dense one: its
logits equal the stock dense model's within 1e-6 relative in norm (the same computation as
tests/hf/test_families.py's export check, plus a weighted sum of k identical expert outputs whose
weights sum to 1: a few ulps), every expert is the dense FFN bit for bit; then a short run trains,
and its first loss is the dense model's loss on that batch.

The granular split (``model.upcycle.granularity=G``): every expert is its slice of the dense FFN bit
for bit, a copy's G router rows are one row, and the logits equal the dense model's within the same
1e-6: the FFN's F-sum is cut into G partial sums added in another order, and the kept weights
(``p_c / sum p`` times G, after dividing by G) are 1/G-ths that sum to 1 within an ulp each: a few
ulps more per block, still ~10x under 1e-6 at these sizes (measured ~1e-7)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as nnf

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.support.training import SHORT, cfg_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-6  # see the module docstring
DENSE = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),  # GQA 2, head dim 8
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=10)),
}


def _dense(family, path):
    cls, kw = DENSE[family]
    cfg = getattr(transformers, cls)(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **kw,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(path)
    return hf


def _run(path, *extra):
    return [*SHORT, f"model.init_from={path}", "model.upcycle.num_experts=4", "model.upcycle.top_k=2", *extra]


def _starts_as_the_dense_model_and_trains(hf, model, run, tmp_path, stdlib):
    """The upcycled ``model``'s logits are the dense ``hf`` model's, the trainer's step-0 loss on
    its first batch is the dense model's, and 6 steps of ``run`` train; the run's summary."""
    from experiments.train import train

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits, model(ids)
    assert ((b - a).norm() / a.norm()).item() <= RTOL

    summary = train(cfg_of(*run), run_dir=tmp_path / "run", data=stdlib, keep_weights=True)
    x, y = dataclasses.replace(stdlib, seed=0).get_batch("train", 0, 8, 32)
    with torch.no_grad():
        ref = nnf.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    first = summary["train_losses"][0]
    # the trainer's step 0 is the dense model too: measured equal to the last bit here; 1e-6 is a few ulps of a
    # loss ~5.5 (the random tiny model's loss is near ln 256 whatever its FFNs compute, so 1e-5 let a slice
    # offset by one row pass)
    assert abs(first - ref) <= 1e-6 * ref, (first, ref)
    # it trains: 6 steps take ~0.4 nats off (measured, G=2 and 4); with optim.lr=0 the batches alone move the
    # loss by ~0.01 either way (a plain last < first passed with lr=0)
    assert summary["train_losses"][-1] < first - 0.1, summary["train_losses"]
    return summary


@pytest.mark.parametrize("family,moe_family", [("llama", "mixtral"), ("qwen3", "qwen3_moe")])
def test_upcycled_model_starts_as_the_dense_one_and_trains(family, moe_family, tmp_path, stdlib):
    from experiments.training.build import build_model
    from experiments.training.hf_init import resolve_init_from

    hf = _dense(family, tmp_path / "dense")
    run = _run(tmp_path / "dense", "train.steps=6", "train.log_every=1", "train.eval_every=6")
    cfg = resolve_init_from(cfg_of(*run), overrides=run)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.model.moe_every, cfg.model.hf_family) == (4, 2, 1, moe_family)
    model = build_model(cfg).eval()
    dense = dict(hf.named_parameters())
    for i, block in enumerate(model.blocks):
        ex = block.ffn.experts
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            want = dense[f"model.layers.{i}.mlp.{theirs}.weight"].detach().t()
            assert all(torch.equal(getattr(ex, ours)[e], want) for e in range(4)), (i, ours)
        assert block.ffn.router.weight.abs().sum() > 0  # the router is initialised, not zero
    summary = _starts_as_the_dense_model_and_trains(hf, model, run, tmp_path, stdlib)
    w = summary["weights"]["blocks.0.ffn.experts.w1"]
    assert not torch.equal(w[0], w[1]) or not torch.equal(w[0], w[2])  # the experts drift apart


def test_upcycling_refuses_an_moe_checkpoint_and_a_capacity(tmp_path):
    from experiments.training.hf_init import resolve_init_from

    transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, num_attention_heads=4, num_experts=4, moe_intermediate_size=8
    ).save_pretrained(tmp_path / "moe")
    run = _run(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"model\.upcycle\.num_experts=4: .* is a Qwen3-MoE checkpoint"):
        resolve_init_from(cfg_of(*run), overrides=run)
    _dense("llama", tmp_path / "dense")
    run = _run(tmp_path / "dense", "moe.capacity_factor=1.25")
    with pytest.raises(ValueError, match=r"moe\.capacity_factor=1\.25: an upcycled model starts as the dense one"):
        resolve_init_from(cfg_of(*run), overrides=run)
    run = _run(tmp_path / "dense", "model.upcycle.top_k=5")
    with pytest.raises(ValueError, match=r"model\.upcycle\.top_k=5 is invalid"):
        resolve_init_from(cfg_of(*run), overrides=run)


# (family, G, num_experts, top_k): 3 copies of 2 slices, each token 2 copies (k'=2); 2 copies of 4
# slices, each token one copy (k'=1)
GRANULAR = [("llama", 2, 6, 4), ("qwen3", 4, 8, 4)]


@pytest.mark.parametrize("family,G,E,k", GRANULAR)
def test_granular_upcycling_starts_as_the_dense_model_and_trains(family, G, E, k, tmp_path, stdlib):
    from experiments.training.build import build_model
    from experiments.training.hf_init import resolve_init_from

    hf = _dense(family, tmp_path / "dense")
    F = hf.config.intermediate_size
    run = [
        *_run(tmp_path / "dense", f"model.upcycle.num_experts={E}", f"model.upcycle.top_k={k}"),
        f"model.upcycle.granularity={G}",
        "train.steps=6",
        "train.log_every=1",
        "train.eval_every=6",
    ]
    cfg = resolve_init_from(cfg_of(*run), overrides=run)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.d_ff, cfg.moe.route_scale) == (E, k, F // G, float(G))
    model = build_model(cfg).eval()
    dense = dict(hf.named_parameters())
    Fs = F // G
    for b, block in enumerate(model.blocks):
        ex = block.ffn.experts
        for e in range(E):  # expert c G + i: slice i of copy c
            sl = slice((e % G) * Fs, (e % G + 1) * Fs)
            mlp = f"model.layers.{b}.mlp."
            assert torch.equal(ex.w1[e], dense[mlp + "gate_proj.weight"].detach()[sl].t()), (b, e, "w1")
            assert torch.equal(ex.w3[e], dense[mlp + "up_proj.weight"].detach()[sl].t()), (b, e, "w3")
            assert torch.equal(ex.w2[e], dense[mlp + "down_proj.weight"].detach()[:, sl].t()), (b, e, "w2")
        rows = block.ffn.router.weight.detach().view(E // G, G, -1)
        assert torch.equal(rows, rows[:, :1].expand_as(rows)), b  # a copy's slices score alike
        assert not torch.equal(rows[0, 0], rows[1, 0]), b  # and copies do not
    _starts_as_the_dense_model_and_trains(hf, model, run, tmp_path, stdlib)


@pytest.mark.parametrize(
    "overrides,match",
    [
        # d_ff=48: 5 does not divide it
        (["model.upcycle.granularity=5"], r"model\.upcycle\.granularity=5 is invalid: .* d_ff=48 .* divisor of 48"),
        (["model.upcycle.granularity=0"], r"model\.upcycle\.granularity=0 is invalid: expected a positive integer"),
        (
            ["model.upcycle.granularity=3", "model.upcycle.num_experts=4", "model.upcycle.top_k=3"],
            r"model\.upcycle\.num_experts=4 is invalid with model\.upcycle\.granularity=3: expected a multiple of 3",
        ),
        (
            ["model.upcycle.granularity=4", "model.upcycle.num_experts=8", "model.upcycle.top_k=2"],
            r"model\.upcycle\.top_k=2 is invalid with model\.upcycle\.granularity=4: expected a multiple of 4",
        ),
    ],
)
def test_granular_upcycling_refuses_a_split_that_does_not_fit(overrides, match, tmp_path):
    from experiments.training.hf_init import resolve_init_from

    _dense("llama", tmp_path / "dense")
    run = _run(tmp_path / "dense", *overrides)
    with pytest.raises(ValueError, match=match):
        resolve_init_from(cfg_of(*run), overrides=run)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["model.upcycle.granularity=2"],
            r"model\.upcycle\.granularity=2 does nothing without model\.upcycle\.num_experts \(null: no upcycling\): "
            r"set model\.upcycle\.num_experts \(a multiple of 2\) .* or leave model\.upcycle\.granularity at its "
            r"default 1",
        ),
        (
            ["model.upcycle.top_k=4"],
            r"model\.upcycle\.top_k=4 does nothing without model\.upcycle\.num_experts .*\(at least 4\) .* "
            r"default 2",
        ),
    ],
)
@pytest.mark.parametrize("init_from", [True, False])
def test_upcycle_keys_without_num_experts_are_refused_before_anything_is_built(
    overrides, match, init_from, tmp_path, monkeypatch
):
    from experiments.train import train
    from experiments.training import loop
    from experiments.training.build import build_model

    _dense("llama", tmp_path / "dense")
    run = [*SHORT, *overrides, *([f"model.init_from={tmp_path / 'dense'}"] if init_from else [])]

    def never(*a, **kw):
        raise AssertionError("built before the check")

    for name in ("plan_before_build", "build_layout", "build_data"):
        monkeypatch.setattr(loop, name, never)
    with pytest.raises(ValueError, match=match):
        train(cfg_of(*run))
    with pytest.raises(ValueError, match=match):
        build_model(cfg_of(*run))


def test_upcycle_num_experts_without_init_from_is_refused():
    from experiments.train import train

    with pytest.raises(ValueError, match=r"model\.upcycle\.num_experts=4 upcycles model\.init_from, which is null"):
        train(cfg_of(*SHORT, "model.upcycle.num_experts=4"))


def test_a_dense_checkpoint_without_num_experts_is_refused_naming_upcycling(tmp_path):
    # it failed with an AttributeError on the dense config's moe (None)
    from experiments.training.hf_init import resolve_init_from

    _dense("qwen3", tmp_path / "dense")
    run = [*SHORT, f"model.init_from={tmp_path / 'dense'}"]
    with pytest.raises(
        ValueError, match=r"is a dense Qwen3 checkpoint, .* set model\.upcycle\.num_experts=E .* qwen3_moe"
    ):
        resolve_init_from(cfg_of(*run), overrides=run)
