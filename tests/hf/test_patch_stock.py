"""The way back from moe.hf.patch: ``unpatch``, ``save_pretrained`` in the stock layout,
``load_state_dict`` of the stock layout, and transformers' ``Trainer`` training, saving and resuming
a patched model like the stock one (tests/hf/patch_models.py builds the models; 1e-5 relative)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe.hf as hf  # noqa: E402
from moe import MoELayer  # noqa: E402
from tests.hf.patch_models import (  # noqa: E402
    ARCHS,
    RTOL,
    VOCAB,
    B,
    L,
    _assert_same_state,
    _build,
    _load_stock,
    _rel,
    _scaled,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits (conftest)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_unpatch_gives_back_the_stock_model_exactly(arch, tmp_path):
    """patch, change every weight through the patched model, unpatch: the stock model with those
    weights, bit for bit; it saves with save_pretrained and loads into the stock class."""
    want = _scaled(_build(arch)).state_dict()
    model = hf.unpatch(_scaled(hf.patch(_build(arch))))
    got = model.state_dict()
    assert list(got) == list(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in got.items())
    ids = torch.randint(0, VOCAB, (B, L))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    with pytest.raises(ValueError, match="holds no layer that moe.hf.patch made"):
        hf.unpatch(model)
    assert "save_pretrained" not in vars(model)  # the stock class's own again
    with pytest.raises(ValueError, match="holds no layer that moe.hf.patch made"):
        hf.stock_state_dict(model)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_patched_model_saves_pretrained_in_the_stock_layout(arch, tmp_path):
    """save_pretrained of a model still patched writes what unpatch then save_pretrained would: the
    stock class loads it with no missing, unexpected or mismatched key, bit for bit. So does a
    trainer's call with state_dict=model.state_dict() (our names). The model stays patched, with the
    same Parameters (an optimizer built over them goes on), and a deep copy saves its own weights."""
    model = _scaled(hf.patch(_build(arch)))
    params = [id(p) for p in model.parameters()]
    want = hf.unpatch(copy.deepcopy(model)).state_dict()
    _assert_same_state(hf.stock_state_dict(model), want, "stock_state_dict")
    model.save_pretrained(tmp_path / "plain")
    _assert_same_state(_load_stock(type(model), tmp_path / "plain"), want, "save_pretrained")
    model.save_pretrained(tmp_path / "trainer", state_dict=model.state_dict())
    _assert_same_state(_load_stock(type(model), tmp_path / "trainer"), want, "save_pretrained(state_dict=...)")
    assert [id(p) for p in model.parameters()] == params and any(isinstance(m, MoELayer) for m in model.modules())

    # a deep copy and an unpickled model save their own weights
    twin = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    thawed = torch.load(tmp_path / "model.pt", weights_only=False)
    ids = torch.randint(0, VOCAB, (B, L))
    with torch.no_grad():  # still patched, the router logits still recorded
        out, back = model.eval()(ids, output_router_logits=True), thawed.eval()(ids, output_router_logits=True)
    assert torch.equal(out.logits, back.logits)
    # transformers 5.17's DeepSeek-V3 returns no router logits
    recorded, again = (getattr(o, "router_logits", None) or () for o in (out, back))
    assert len(again) == len(recorded) and (len(recorded) > 0 or model.config.model_type == "deepseek_v3")
    assert all(torch.equal(a, b) for a, b in zip(recorded, again))
    for i, other in enumerate((twin, thawed)):
        with torch.no_grad():
            next(m for m in other.modules() if isinstance(m, MoELayer)).experts.w1.add_(1.0)
        other.save_pretrained(tmp_path / f"other{i}")
        got = _load_stock(type(model), tmp_path / f"other{i}")
        _assert_same_state(got, hf.stock_state_dict(other), ("a copy", i))
        assert any(not torch.equal(got[k], want[k]) for k in want if k.endswith("gate_up_proj"))

    broken = {k: v for k, v in model.state_dict().items() if not k.endswith("router.weight")}
    with pytest.raises(ValueError, match=r"has no 'model\.layers\.\d\.mlp\.router\.weight'"):
        hf.stock_state_dict(model, broken)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_patched_model_loads_a_state_dict_in_the_stock_layout(arch, tmp_path):
    """load_state_dict of a patched model takes the stock module's names and layout too (a stock
    model's state_dict(), stock_state_dict's output): every weight lands, bit for bit, strict; so it
    does in a deep copy and in an unpickled model. The patched names load as ever; a layer given in
    both layouts, half of the fused experts, or fused experts of the wrong size are refused naming
    the key."""
    trained = _scaled(hf.patch(_build(arch)))
    want = trained.state_dict()
    stock_sd = hf.stock_state_dict(trained)
    fresh = hf.patch(_build(arch))
    assert any(not torch.equal(t, want[k]) for k, t in fresh.state_dict().items())
    twin = copy.deepcopy(fresh)
    torch.save(fresh, tmp_path / "model.pt")
    thawed = torch.load(tmp_path / "model.pt", weights_only=False)
    fresh.load_state_dict(stock_sd)
    _assert_same_state(fresh.state_dict(), want, "stock_state_dict")
    for what, model in (("a deep copy", twin), ("an unpickled model", thawed)):
        model.load_state_dict(_scaled(_build(arch)).state_dict())  # a stock model's own
        _assert_same_state(model.state_dict(), want, what)
    again = hf.patch(_build(arch))
    again.load_state_dict(want)  # our own names
    _assert_same_state(again.state_dict(), want, "patched names")

    p = hf._patched_layers(fresh)[-1][0] + "."
    with pytest.raises(
        ValueError, match=rf"holds {p}.* \(transformers' layout\) and {p}experts\.w1 \(the patched layer's\)"
    ):
        fresh.load_state_dict(stock_sd | {p + "experts.w1": want[p + "experts.w1"]})
    with pytest.raises(ValueError, match=rf"holds {p}experts\.gate_up_proj without {p}experts\.down_proj"):
        fresh.load_state_dict({k: v for k, v in stock_sd.items() if k != p + "experts.down_proj"})
    with pytest.raises(
        ValueError, match=rf"{p}experts\.down_proj has shape \(1, \d+, \d+\): expected \(\d+, \d+, \d+\)"
    ):
        fresh.load_state_dict(stock_sd | {p + "experts.down_proj": stock_sd[p + "experts.down_proj"][:1]})


@pytest.mark.parametrize(
    "arch", ["mixtral", "deepseek_v3"]
)  # the Hub renames Mixtral's block; groups, bias, shared experts
def test_transformers_trainer_resumes_a_patched_model_from_its_checkpoint(arch, tmp_path):
    """transformers' Trainer checkpoints a patched model (checkpoint-N/ in the Hub layout) and
    resumes it, the checkpoint's weights loaded first as the README says (the Trainer's own reload
    reads the file without converting the Hub's per-expert tensors, and leaves the experts of stock
    and patched models alike as they were): a run of 4 steps resumed from step 2 into a freshly
    patched model logs the same losses for steps 3 and 4 and ends with the same weights as the run
    that went straight through."""
    pytest.importorskip("accelerate")
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (16, L))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(out, resume=None):
        model = hf.patch(_build(arch))
        if resume is not None:
            model.load_state_dict(type(model).from_pretrained(resume, dtype=torch.float32).state_dict())
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out),
            per_device_train_batch_size=4,
            max_steps=4,
            learning_rate=0.05,
            optim="sgd",
            use_cpu=True,
            report_to=[],
            save_strategy="steps",
            save_steps=2,
            logging_steps=1,
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}, model.state_dict()

    losses, weights = run("straight")
    resumed, resumed_weights = run("resumed", resume=str(tmp_path / "straight" / "checkpoint-2"))
    assert sorted(losses) == [1, 2, 3, 4]
    assert resumed == losses  # steps 1 and 2 from the checkpoint's trainer state, 3 and 4 run again
    _assert_same_state(resumed_weights, weights, "resumed")


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_transformers_trainer_trains_a_patched_model_like_the_stock_one_and_saves_it_stock(arch, tmp_path):
    """transformers' Trainer, unchanged, on a patched model and on the stock one (same weights, data
    and seed; SGD, whose update is the gradient itself, so rounding stays rounding): the same
    logged losses (the balancing loss included), and ``save_model`` of the patched model writes a
    directory the stock class loads with no missing or unexpected key, holding the stock run's
    weights. The Trainer hands ``save_pretrained`` the model's own ``state_dict()``, in the patched
    names, which the patched model's ``save_pretrained`` converts."""
    pytest.importorskip("accelerate")
    stock = _build(arch)
    patched = hf.patch(copy.deepcopy(stock))
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (8, L))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=0.05,
        optim="sgd",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    losses = {}
    for name, model in (("stock", stock), ("patched", patched)):
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        trainer.save_model(str(tmp_path / name))
    assert len(losses["stock"]) == 3 and losses["patched"] == pytest.approx(losses["stock"], rel=RTOL)
    assert any(isinstance(m, MoELayer) for m in patched.modules())
    want = _load_stock(type(stock), tmp_path / "stock")
    got = _load_stock(type(stock), tmp_path / "patched")
    assert list(got) == list(want)
    for name, t in want.items():
        assert _rel(got[name], t) <= RTOL, name
