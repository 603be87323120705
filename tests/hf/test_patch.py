"""moe.hf.patch against the stock transformers models: a tiny randomly initialised model per
architecture (built from its config class, nothing downloaded), stock vs patch(deepcopy(stock)):
logits, loss (with the balancing loss where the model computes one), router logits, every
weight's gradient, an SGD step and eval, all within 1e-5 relative in fp32.

Relative means ``||a - b|| / ||b||`` per tensor (an elementwise ratio is meaningless where a
gradient element is ~0)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moe.hf as hf  # noqa: E402
from moe import MoELayer  # noqa: E402
from moe.hf.tables import ours_to_fused  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits (conftest)

RTOL = 1e-5
VOCAB, B, L = 97, 2, 12
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    hidden_act="silu",
    attention_dropout=0.0,
)


def _mixtral(**kw):
    cfg = transformers.MixtralConfig(
        **COMMON,
        intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.MixtralForCausalLM, cfg


def _qwen2(norm_topk_prob=False, **kw):
    cfg = transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.Qwen2MoeForCausalLM, cfg


def _qwen3(norm_topk_prob, **kw):
    cfg = transformers.Qwen3MoeConfig(
        **COMMON,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=8,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.Qwen3MoeForCausalLM, cfg


def _olmoe(**kw):
    cfg = transformers.OlmoeConfig(
        **COMMON,
        intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        **kw,
    )
    return transformers.OlmoeForCausalLM, cfg


def _deepseek_v3(**kw):
    # first_k_dense_replace=1: layer 0 keeps its dense MLP, layer 1 is MoE (only MoE blocks change)
    common = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
    cfg = transformers.DeepseekV3Config(
        **common,
        num_key_value_heads=4,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        output_router_logits=True,
        **kw,
    )
    return transformers.DeepseekV3ForCausalLM, cfg


ARCHS = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2,
    "qwen2_moe_norm": lambda **kw: _qwen2(True, **kw),
    "qwen3_moe_norm": lambda **kw: _qwen3(True, **kw),
    "qwen3_moe_nonorm": lambda **kw: _qwen3(False, **kw),
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
}


def _build(arch, **kw):
    cls, cfg = ARCHS[arch](**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).float()
    router_cls = type(_moe_blocks(model)[0].gate)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, router_cls):
                # logits of std ~3 rather than ~0.1: each token's choice depends on the token, so a
                # wrong selection rule (group limit, bias, top-k) changes the outputs
                m.weight.normal_(0.0, 0.5)
            if hasattr(m, "e_score_correction_bias"):  # a bias that changes which experts are picked
                m.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


def _moe_blocks(model):
    return [m for m in model.modules() if type(m).__name__ == hf._BLOCKS[model.config.model_type][0]]


def _stock_grad(name: str, patched: dict[str, torch.nn.Parameter]) -> tuple[list[str], torch.Tensor | None]:
    """The patched parameters that hold the stock parameter ``name``, and their gradient in the stock layout."""
    if name in patched:  # untouched (attention, norms, embeddings, dense MLPs)
        return [name], patched[name].grad
    prefix, _, leaf = name.rpartition("mlp.")
    mlp = prefix + "mlp."
    remap = {
        "gate.weight": "router.weight",
        "shared_expert.gate_proj.weight": "shared_experts.w1.weight",
        "shared_expert.up_proj.weight": "shared_experts.w3.weight",
        "shared_expert.down_proj.weight": "shared_experts.w2.weight",
        "shared_experts.gate_proj.weight": "shared_experts.w1.weight",
        "shared_experts.up_proj.weight": "shared_experts.w3.weight",
        "shared_experts.down_proj.weight": "shared_experts.w2.weight",
        "shared_expert_gate.weight": "shared_expert_gate.weight",
    }
    if leaf in ("experts.gate_up_proj", "experts.down_proj"):  # the mapping table's expert layouts
        names = [mlp + f"experts.{w}" for w in ("w1", "w3", "w2")]
        gate_up, down = ours_to_fused(*(patched[n].grad for n in names))
        return (names[:2], gate_up) if leaf == "experts.gate_up_proj" else (names[2:], down)
    if leaf in remap:
        return [mlp + remap[leaf]], patched[mlp + remap[leaf]].grad
    raise KeyError(f"no mapping for the stock parameter {name}")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _close(a, b, what):
    assert a is not None and b is not None, what
    err = _rel(a, b)
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def _compare(stock, patched, train: bool, n_moe: int):
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L))
    stock.train(train)
    patched.train(train)
    a = stock(ids, labels=ids)
    b = patched(ids, labels=ids)
    _same_outputs(a, b, n_moe)
    return a, b


def _same_outputs(a, b, n_moe: int | None, what: str = ""):
    """``b``'s logits, loss, aux loss and router logits equal ``a``'s (``n_moe``: how many router
    logits each holds; None: not checked)."""
    _close(b.logits, a.logits, f"{what}logits")
    _close(b.loss, a.loss, f"{what}loss")
    if getattr(a, "aux_loss", None) is not None:  # DeepSeek-V3 computes no balancing loss
        _close(b.aux_loss, a.aux_loss, f"{what}aux_loss")
    if not hasattr(a, "router_logits"):  # DeepSeek-V3 in transformers 5.17 returns none
        return
    if n_moe is not None:
        assert len(b.router_logits) == len(a.router_logits) == n_moe
    for i, (ra, rb) in enumerate(zip(a.router_logits, b.router_logits)):
        _close(rb, ra, f"{what}router_logits[{i}]")


def _check(arch, **kw):
    stock = _build(arch, **kw)
    patched = hf.patch(copy.deepcopy(stock))
    n_moe = len(_moe_blocks(stock))
    assert n_moe >= 1
    assert len([m for m in patched.modules() if isinstance(m, MoELayer)]) == n_moe
    assert not _moe_blocks(patched)

    # training step: forward, backward, every gradient, then one SGD step on both
    a, b = _compare(stock, patched, train=True, n_moe=n_moe)
    a.loss.backward()
    b.loss.backward()
    pp = dict(patched.named_parameters())
    covered = set()
    for name, p in stock.named_parameters():
        pnames, g = _stock_grad(name, pp)
        _close(g, p.grad, f"grad of {name} (patched {pnames})")
        covered.update(pnames)
    assert covered == set(pp), sorted(set(pp) ^ covered)  # every patched weight checked, none extra
    for model in (stock, patched):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.zero_grad(set_to_none=True)

    # eval after the step: the patched weights moved exactly as the stock ones
    with torch.no_grad():
        _compare(stock, patched, train=False, n_moe=n_moe)
    return stock, patched


@pytest.mark.parametrize("arch", list(ARCHS))
def test_patch_matches_stock(arch):
    stock, patched = _check(arch)
    # and back: the trained weights in the stock modules, names and layouts
    n_moe = len(_moe_blocks(stock))
    hf.unpatch(patched)
    assert not [m for m in patched.modules() if isinstance(m, MoELayer)] and len(_moe_blocks(patched)) == n_moe
    want, got = stock.state_dict(), patched.state_dict()
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        _close(got[name], t, f"unpatched {name}")  # both took the same SGD step from gradients equal within RTOL
    with torch.no_grad():
        _compare(stock, patched, train=False, n_moe=n_moe)  # router logits still recorded after the swap back


def _scaled(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # exact in fp32, and the same whatever layout holds the weight
    return model


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


def _load_stock(cls, path):
    model, info = cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.state_dict()


def _assert_same_state(got: dict, want: dict, what):
    assert list(got) == list(want), what
    for name, t in want.items():
        assert torch.equal(got[name], t), (what, name)


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


@pytest.mark.parametrize("arch", ["qwen2_moe_norm", "deepseek_v3"])  # a gated shared expert; groups, bias, scaling
def test_patched_model_compiles_with_no_graph_break_of_its_own_and_matches_eager(arch):
    """``torch.compile`` of a patched model, as a user would call it: the patch adds no graph break
    to the ones transformers' model already has (its output recorder), and a compiled training
    forward and backward equal the eager ones. ``aot_eager``: dynamo and AOTAutograd trace and
    partition as for Inductor but run eager kernels, so a break or a wrong fake shape shows in
    seconds (tests/moe/test_compile.py); 1e-5 relative as everywhere here (a decomposition may sum in
    another order; measured with Inductor on Qwen3-MoE and DeepSeek-V3 models of this size: 6e-7 on
    the gradients)."""
    import torch._dynamo

    stock = _build(arch)
    patched = hf.patch(copy.deepcopy(stock))
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L))
    breaks = []
    for model in (stock, patched):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(ids, labels=ids)
        breaks.append(explained.graph_break_count)
    assert breaks[1] == breaks[0], f"graph breaks: stock {breaks[0]}, patched {breaks[1]}"
    torch._dynamo.reset()
    twin = copy.deepcopy(patched)
    compiled = torch.compile(twin, backend="aot_eager")
    runs = []
    for model, params in ((patched, patched), (compiled, twin)):
        out = model(ids, labels=ids)
        out.loss.backward()
        runs.append((out, {n: p.grad for n, p in params.named_parameters()}))
    torch._dynamo.reset()
    (a, grads_a), (b, grads_b) = runs
    _same_outputs(a, b, None, "compiled ")
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        _close(grads_b[name], grads_a[name], f"compiled grad of {name}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_a_bf16_model_patched_is_as_accurate_as_the_stock_bf16_model(arch):
    """Loaded in bf16 (``from_pretrained(..., dtype=torch.bfloat16)``), the patched model computes in
    bf16 like the stock one. Both round differently, so they are compared through their distance
    from the fp32 model: the patched model's logits and every gradient are no further from fp32 than
    1.5x the stock bf16 model's distance (measured: 1.00-1.03x on the logits; bf16 keeps 8 bits, so
    each is ~5e-3 away), and its weight gradients are bf16 like the stock ones."""
    fp32 = _build(arch)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L))
    runs = {}
    for name, model in (
        ("fp32", fp32),
        ("stock", copy.deepcopy(fp32).to(torch.bfloat16)),
        ("patched", hf.patch(copy.deepcopy(fp32).to(torch.bfloat16))),
    ):
        out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if name == "patched":
            assert {g.dtype for g in grads.values()} == {torch.bfloat16}
            grads = {n: _stock_grad(n, {k: _Grad(v) for k, v in grads.items()})[1] for n, _ in fp32.named_parameters()}
        runs[name] = (out.logits, grads)
    (ref, ref_g), (stock, stock_g), (patched, patched_g) = runs["fp32"], runs["stock"], runs["patched"]
    assert _rel(patched, ref) <= 1.5 * _rel(stock, ref), (_rel(patched, ref), _rel(stock, ref))
    flat = lambda g: torch.cat([g[n].float().flatten() for n in ref_g])  # noqa: E731
    assert _rel(flat(patched_g), flat(ref_g)) <= 1.5 * _rel(flat(stock_g), flat(ref_g))
    for n in ref_g:
        if n.endswith("k_proj.bias"):
            # zero in exact arithmetic (the softmax ignores a shift shared by all keys): every model's
            # value is rounding noise, and so is its relative distance
            continue
        # measured: 0.5-1.6% in both models (the patched routers, in fp32, 0.7-0.8% where the stock
        # ones are 2-5%); a floor of 2% for the smallest tensors; an expert output 5% off fails here
        assert _rel(patched_g[n], ref_g[n]) <= max(1.5 * _rel(stock_g[n], ref_g[n]), 0.02), (
            n,
            _rel(patched_g[n], ref_g[n]),
            _rel(stock_g[n], ref_g[n]),
        )


def test_qwen2_shared_expert_gate_is_the_stock_parameter():
    stock = _build("qwen2_moe")
    patched = hf.patch(copy.deepcopy(stock))
    layer = patched.model.layers[0].mlp
    assert layer.cfg.shared_expert_gate and layer.cfg.num_shared_experts == 1
    assert layer.shared_expert_gate.weight.shape == (1, 32)


def test_weights_are_the_stock_parameters_and_contiguous_expert_copies():
    # the router (and the shared experts, checked by test_patch_matches_stock's gradients) are the
    # stock Parameters; the routed experts are contiguous copies in our layout, and the stock fused
    # tensors are no longer referenced by the model
    import weakref

    stock = _build("mixtral")
    block = stock.model.layers[0].mlp
    gate_up, down, router = block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight
    want = [w.detach().clone() for w in (gate_up, down)]
    refs = [weakref.ref(gate_up), weakref.ref(down)]
    del block, gate_up, down
    hf.patch(stock)
    layer = stock.model.layers[0].mlp
    assert isinstance(layer, MoELayer)
    assert layer.router.weight is router
    ex = layer.experts
    assert all(w.is_contiguous() for w in (ex.w1, ex.w3, ex.w2))
    for got, ref in zip(ours_to_fused(ex.w1, ex.w3, ex.w2), want):
        assert torch.equal(got, ref)
    assert all(r() is None for r in refs)  # freed with the stock block


def test_patch_after_a_recording_forward_still_records_router_logits():
    # transformers hooks its output recorder once, on the first forward that records; the stock
    # routers that carried the hooks are gone after patching
    stock = _build("olmoe")
    ids = torch.randint(0, VOCAB, (1, 8))
    model = copy.deepcopy(stock)
    model(ids, output_router_logits=True)
    hf.patch(model)
    out = model(ids, output_router_logits=True)
    ref = stock(ids, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    _close(out.router_logits[1], ref.router_logits[1], "router_logits after late patch")


def test_refusals_name_the_field(monkeypatch):
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf.patch(transformers.MixtralForCausalLM(_mixtral_gelu()))
    stock = _build("mixtral")
    stock.config.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        hf.patch(stock)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    with pytest.raises(ValueError, match="model_type='llama'"):
        hf.patch(llama)
    patched = hf.patch(_build("mixtral"))
    with pytest.raises(ValueError, match="holds no MixtralSparseMoeBlock"):
        hf.patch(patched)
    stock = _build("mixtral")
    for version in ("6.0.0", "4.57.1"):  # a major release whose fused layouts nothing here has checked
        # the module patch imports: transformers may swap the object in sys.modules while it builds a model
        monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
        with pytest.raises(ValueError, match=rf"transformers {version} is not supported.*transformers>=5\.17,<6"):
            hf.patch(stock)
    assert not any(isinstance(m, MoELayer) for m in stock.modules())


def _mixtral_gelu():
    _, cfg = _mixtral()
    cfg.hidden_act = "gelu"
    return cfg


@pytest.mark.distributed
def test_core_packages_import_without_transformers():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\nsys.modules['transformers'] = None\nsys.modules['safetensors'] = None\n"
        "import moe, moe.model, zero, routing_kernels\n"
        "import moe.hf\n"  # the module itself imports; only patching a model needs transformers
        "assert 'transformers' not in sys.modules or sys.modules['transformers'] is None\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]


def test_generate_and_gradient_checkpointing_match_stock():
    # decoding one token at a time with a KV cache, and training under transformers' activation
    # checkpointing (the layer is recomputed in backward)
    stock = _build("deepseek_v3").eval()
    patched = hf.patch(copy.deepcopy(stock))
    ids = torch.randint(0, VOCAB, (2, 5))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(stock.generate(ids, **kw), patched.generate(ids, **kw))
    for m in (stock, patched):
        m.train()
        m.config.use_cache = False
        if hasattr(m, "activation_checkpointing_enable"):  # transformers 5.24
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # its earlier name (5.17, the GPU image's)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    patched.model.layers[1].self_attn.register_forward_hook(lambda *_: calls.append(1))
    a, b = stock(ids, labels=ids), patched(ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert len(calls) == 2  # the MoE decoder layer is checkpointed: its attention ran again in backward
    _close(b.loss, a.loss, "loss under checkpointing")
    pp = dict(patched.named_parameters())
    for name, p in stock.named_parameters():
        _close(_stock_grad(name, pp)[1], p.grad, f"grad of {name} under checkpointing")


EP_ARCHS = ("mixtral", "qwen2_moe", "deepseek_v3")


def _ep_rank(rank, world, archs):
    # each rank: the same stock model, patched with expert parallelism over all ranks; it runs its
    # own sequence of the batch and returns what it computed
    import torch.distributed as dist

    out = {}
    for arch in archs:
        model = hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD)
        torch.manual_seed(1)
        ids = torch.randint(0, VOCAB, (world, L))[rank : rank + 1]
        res = model(ids, labels=ids)
        res.loss.backward()
        out[arch] = dict(
            logits=res.logits.detach(),
            loss=res.loss.detach(),
            router_logits=[r.detach() for r in getattr(res, "router_logits", ())],
            grads={n: p.grad for n, p in model.named_parameters()},
            shapes={n: tuple(p.shape) for n, p in model.named_parameters()},
        )
    return out


def _ep_unpatch_rank(rank, world, archs, tmp):
    import os

    import torch.distributed as dist

    out = {}
    for arch in archs:
        model = _scaled(hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD))
        # refused before anything is written or exchanged: rank 1 never calls these, so a gather
        # on rank 0 would wait for it (or pair with its next gather and corrupt the results below)
        if rank == 0:
            with pytest.raises(
                ValueError,
                match=r"expert parallelism \(ep=2\).*moe\.hf\.save_pretrained\(model, save_directory\) on every rank",
            ):
                model.save_pretrained(os.path.join(tmp, arch, "refused"))
            assert not os.path.exists(os.path.join(tmp, arch, "refused"))
            last = hf._patched_layers(model)[-1][0]
            sd = model.state_dict()
            with pytest.raises(
                ValueError, match=rf"has no '{last}\.router\.weight'"
            ):  # the last layer's: checked before the first gather
                hf.stock_state_dict(model, {k: v for k, v in sd.items() if k != f"{last}.router.weight"})
            bad = sd | {f"{last}.experts.w2": sd[f"{last}.experts.w2"][:1]}
            with pytest.raises(
                ValueError,
                match=rf"{last}\.experts\.w2 has shape \(1, \d+, \d+\): expected \(\d+, \d+, \d+\) \(every expert\)",
            ):
                hf.save_pretrained(model, os.path.join(tmp, arch, "refused"), state_dict=bad)
            assert not os.path.exists(os.path.join(tmp, arch, "refused"))
        other = hf.patch(_build(arch), ep_group=dist.group.WORLD, dp_group=dist.group.WORLD)
        other.load_state_dict(_scaled(_build(arch)).state_dict())  # all experts given; this rank's kept
        loaded = hf.stock_state_dict(other)
        given = hf.stock_state_dict(model, model.state_dict())  # this rank's slices, gathered
        gathered = hf.stock_state_dict(model)  # a collective, the model left patched
        hf.save_pretrained(model, os.path.join(tmp, arch, "saved"))  # every rank; rank 0 writes
        dist.barrier()
        out[arch] = (given, gathered, hf.unpatch(model).state_dict(), loaded)
    return out


@pytest.mark.distributed
def test_unpatch_under_expert_parallelism_gathers_every_expert(tmp_path):
    """ep=2 on 2 gloo ranks: unpatch, stock_state_dict (of the model, and of a state dict holding
    this rank's slices) and moe.hf.save_pretrained gather every expert; bad input is refused on the
    one rank that holds it, before any exchange; a stock state dict loads, each rank keeping its
    own experts."""
    from tests.support.dist import run_distributed

    results = run_distributed(_ep_unpatch_rank, 2, EP_ARCHS, str(tmp_path))
    for arch in EP_ARCHS:
        model = _scaled(_build(arch))
        want = model.state_dict()
        for r in range(2):
            given, gathered, unpatched, loaded = results[r][arch]
            _assert_same_state(unpatched, want, (arch, r, "unpatch"))
            _assert_same_state(loaded, want, (arch, r, "load_state_dict of the stock layout"))
            _assert_same_state(gathered, want, (arch, r, "stock_state_dict"))
            _assert_same_state(given, want, (arch, r, "stock_state_dict(state_dict=)"))
        _assert_same_state(_load_stock(type(model), tmp_path / arch / "saved"), want, (arch, "moe.hf.save_pretrained"))


@pytest.mark.distributed
def test_expert_parallel_patch_matches_stock():
    # 2 ranks, ep=2: rank r holds experts [r*E/2, (r+1)*E/2) and runs sequence r. Its outputs and
    # replicated weights' gradients are the stock model's on sequence r; its experts' gradients
    # are the stock gradients of the sum of both ranks' losses (tokens of both ranks reach them)
    from tests.support.dist import run_distributed

    results = run_distributed(_ep_rank, 2, EP_ARCHS)
    for arch in EP_ARCHS:
        stock = _build(arch)
        names = [n for n, _ in stock.named_parameters()]
        params = [p for _, p in stock.named_parameters()]
        torch.manual_seed(1)
        ids = torch.randint(0, VOCAB, (2, L))
        per_rank = []
        for r in range(2):
            ref = stock(ids[r : r + 1], labels=ids[r : r + 1])
            got = results[r][arch]
            _close(got["logits"], ref.logits, f"{arch} rank {r} logits")
            _close(got["loss"], ref.loss, f"{arch} rank {r} loss")
            for a, b in zip(got["router_logits"], getattr(ref, "router_logits", ()), strict=True):
                _close(a, b, f"{arch} rank {r} router logits")
            per_rank.append(dict(zip(names, torch.autograd.grad(ref.loss, params, allow_unused=True))))
        total = {n: per_rank[0][n] + per_rank[1][n] for n in names if per_rank[0][n] is not None}
        for r in range(2):
            got = results[r][arch]
            checked = set()
            for n in names:
                prefix, _, leaf = n.rpartition("mlp.")
                pnames, g = _stock_grad(n, {k: _Grad(v) for k, v in got["grads"].items()})
                checked.update(pnames)
                if leaf in ("experts.gate_up_proj", "experts.down_proj"):
                    X = got["shapes"][prefix + "mlp.experts.w2"][0]
                    lo, hi = r * X, (r + 1) * X
                    _close(g, total[n][lo:hi], f"{arch} rank {r} grad of {n}[{lo}:{hi}]")
                else:
                    _close(g, per_rank[r][n], f"{arch} rank {r} grad of {n}")
            assert checked == set(got["grads"]), sorted(set(got["grads"]) ^ checked)


class _Grad:
    def __init__(self, grad):
        self.grad = grad


ZERO_STEPS, ZERO_LR = 3, 0.5


def _zero_batch():
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (2, L))


def _zero_optimizer(groups):
    # SGD with momentum: elementwise, so the engine shards it; unlike Adam it does not magnify the
    # rounding of near-zero gradient entries into lr-sized weight differences, so the weights can be
    # held to rounding as tightly as the gradients
    return torch.optim.SGD(groups, lr=ZERO_LR, momentum=0.9)


def _zero_rank(rank, world, arch, out_dir):
    import torch.distributed as dist

    import zero

    model = _build(arch)
    num_experts = getattr(model.config, "num_experts", None) or model.config.n_routed_experts
    layout = zero.Layout.build(ep=2, num_experts=num_experts)
    hf.patch(model, ep_group=layout.ep_group, dp_group=layout.dp_group)
    engine = zero.ZeroEngine(model, layout, stage=3, blocks=list(model.model.layers), optimizer=_zero_optimizer)
    ids = _zero_batch()[rank : rank + 1]  # this rank's share of the global batch
    losses, grads = [], []
    for _ in range(ZERO_STEPS):
        loss = model(ids, labels=ids).loss
        engine.backward(loss)
        grads.append(engine.full_gradients())
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    # the way out (README): the model's buffers and the engine's gathered weights (this rank's
    # experts), saved by every rank; the experts are gathered over ep and rank 0 writes
    trained = engine.full_parameters()
    hf.save_pretrained(model, out_dir, state_dict=model.state_dict() | trained)
    dist.barrier()
    return dict(losses=losses, grads=grads, shapes={n: tuple(t.shape) for n, t in trained.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])  # a gated shared expert; the correction bias, a buffer
def test_patched_model_trains_under_zero3_with_expert_parallelism_like_one_process_and_saves_pretrained(arch, tmp_path):
    """The whole road a user takes: patch a transformers model with ep=2, train it under ZeRO-3 on 2
    gloo ranks (each rank one sequence of the global batch), save it with moe.hf.save_pretrained; against
    the stock model trained in one process on the whole batch. Every step's loss and every gradient
    (the engine's synchronised ones, an ep slice of the experts on each rank) within 1e-5, and the
    saved model's weights within 1e-5 of the reference's (SGD: rounding of the gradients only)."""
    from tests.support.dist import run_distributed

    results = run_distributed(_zero_rank, 2, arch, str(tmp_path))
    stock = _build(arch)
    opt = torch.optim.SGD(stock.parameters(), lr=ZERO_LR, momentum=0.9)
    ids = _zero_batch()
    for step in range(ZERO_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = (stock(ids[:1], labels=ids[:1]).loss + stock(ids[1:], labels=ids[1:]).loss) / 2
        loss.backward()
        for r in range(2):
            got = results[r]
            _close(torch.tensor(got["losses"][step]), loss.detach(), f"rank {r} loss of step {step}")
            grads = {k: _Grad(v) for k, v in got["grads"][step].items()}
            for name, p in stock.named_parameters():
                g, want = _stock_grad(name, grads)[1], p.grad
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # this rank's experts
                    X = got["shapes"][name.rpartition("mlp.")[0] + "mlp.experts.w2"][0]
                    want = want[r * X : (r + 1) * X]
                _close(g, want, f"rank {r} step {step} grad of {name}")
        opt.step()
    saved = type(stock).from_pretrained(tmp_path, attn_implementation="eager").float()
    want = stock.state_dict()
    assert list(saved.state_dict()) == list(want)
    for name, t in saved.state_dict().items():
        _close(t, want[name], f"saved {name}")
