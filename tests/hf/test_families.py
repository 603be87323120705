"""moe.hf.import_model / export_model for every family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3): tiny random transformers models (built from each config class, saved with
``save_pretrained``; nothing is downloaded) at odd sizes: 4 query heads over 4, 2 and 1 key/value
heads (GQA ratios 1, 2, 4), head dims 6 and 10, MLA with and without a query latent.

Tolerances. Import (ours against the stock model, fp32): ``max |ours - theirs| / max |theirs| <=
1e-5`` for the logits and every weight's gradient, as in tests/moe/architectures.py (whose
naive name mapping ``hf_to_ours`` maps transformers' gradients here, independently of the adapter
tables): the same formulas in another order (SDPA against eager attention, grouped experts against
a loop), measured <= 5e-6; a wrong detail moves it by 1e-3 or more. Export (the exported directory
in transformers against ours): ``||a - b|| / ||b|| <= 5e-6`` on the logits (tests/hf/test_mixtral.py's
measure), measured <= 6e-7 on one machine and 1.4e-6 on another (DeepSeek-V3 without a query
latent; another CPU's kernels sum in another order): the same weights and the same computation as
the import check, forward only; in fp64 every family agrees within 3e-7 (transformers keeps its
rotary tables in fp32), so the gap is rounding, and the bound is 5e-6; the largest entry's error
alone reaches 1.7e-6 (DeepSeek-V3's latent attention). Round trips are bit for bit: moving
weights is copies and transposes.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import moe.hf as mh  # noqa: E402
from moe.hf.safetensors_io import SafetensorsFiles  # noqa: E402
from tests.moe.architectures import randomize_, worst_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, D, L, B = 37, 24, 11, 2  # odd vocabulary and length; D / 4 heads = 6, not a power of two
IMPORT_TOL, EXPORT_TOL = 1e-5, 5e-6  # see the module docstring


def _mha(cls: str, kv: int, **kw) -> tuple[str, dict]:
    return cls, dict(num_attention_heads=4, num_key_value_heads=kv, num_hidden_layers=3, **kw)


_DS = dict(
    num_attention_heads=3,
    num_key_value_heads=3,
    num_hidden_layers=3,
    intermediate_size=20,
    moe_intermediate_size=8,
    first_k_dense_replace=1,
    n_shared_experts=2,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    kv_lora_rank=7,
    qk_rope_head_dim=6,
    qk_nope_head_dim=5,
    v_head_dim=9,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=0,
)

CASES = {
    **{
        f"mixtral-kv{kv}": _mha("MixtralConfig", kv, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
        for kv in (4, 2, 1)
    },
    **{
        f"qwen2_moe-kv{kv}": _mha(
            "Qwen2MoeConfig",
            kv,
            intermediate_size=20,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            num_experts=6,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            qkv_bias=True,
            norm_topk_prob=kv == 2,
        )
        for kv in (4, 2, 1)
    },
    **{
        f"qwen3_moe-kv{kv}": _mha(
            "Qwen3MoeConfig",
            kv,
            head_dim=10,
            intermediate_size=20,
            moe_intermediate_size=8,
            num_experts=5,
            num_experts_per_tok=2,
            decoder_sparse_step=2 if kv == 1 else 1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0) if kv == 2 else None,
        )
        for kv in (4, 2, 1)
    },
    **{
        f"olmoe-kv{kv}": _mha(
            # OLMoE's pad token (1 by default) freezes that embedding row's gradient in transformers
            # (nn.Embedding's padding_idx); ours trains every row, so the gradients compare without it
            "OlmoeConfig",
            kv,
            intermediate_size=12,
            num_experts=6,
            num_experts_per_tok=3,
            pad_token_id=None,
            eos_token_id=None,
        )
        for kv in (4, 2, 1)
    },
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            _DS,
            q_lora_rank=10,
            rope_interleave=True,
            max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50.0,
                factor=4.0,
                original_max_position_embeddings=8,
                mscale=0.9,
                mscale_all_dim=1.1,
            ),
        ),
    ),
    "deepseek_v3-plain": ("DeepseekV3Config", dict(_DS, q_lora_rank=None, rope_interleave=False)),
}


def _hf_model(case: str, **over):
    cls, kw = CASES[case]
    kw = {k: v for k, v in {**kw, **over}.items() if not (k == "rope_parameters" and v is None)}
    hf_cfg = getattr(transformers, cls)(vocab_size=V, hidden_size=D, tie_word_embeddings=False, **kw)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").float()
    randomize_(hf, seed=0)  # unit-gain weights, norms and biases away from 1 and 0 (tests/moe/architectures.py)
    return hf.eval()


def _saved(case, tmp_path, **over):
    hf = _hf_model(case, **over)
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def _norm_rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _file_tensors(path) -> dict[str, torch.Tensor]:
    files = SafetensorsFiles(path)
    return {k: files.get(k) for k in files.keys()}


def _from_pretrained(path):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    return hf.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_logits_and_gradients(case, tmp_path):
    hf, path = _saved(case, tmp_path)
    ours = mh.import_model(path, aux_loss_coef=0.0, z_loss_coef=0.0)
    assert ours.hf_family == hf.config.model_type
    worst, err = worst_error(hf, ours, V, B, L)
    assert err <= IMPORT_TOL, f"{worst}: {err:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_and_round_trips_bit_for_bit(case, tmp_path):
    hf, path = _saved(case, tmp_path)
    ours = mh.import_model(path)
    out = mh.export_model(ours, tmp_path / "out")  # the family it came from
    back = _from_pretrained(out)
    assert type(back) is type(hf)
    idx = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = _norm_rel(back(input_ids=idx).logits, ours(idx))
    assert err <= EXPORT_TOL, err
    # import -> export gives the file transformers wrote, tensor for tensor
    theirs, mine = _file_tensors(path), _file_tensors(out)
    assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))
    for name in theirs:
        assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
    # and the config comes back the same
    assert mh.import_model(out).cfg == ours.cfg


def test_sharded_export_with_index_and_bf16(tmp_path):
    hf, path = _saved("qwen3_moe-kv2", tmp_path)
    ours = mh.import_model(path)
    out = mh.export_model(ours, tmp_path / "sharded", max_shard_bytes=20_000, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    back = mh.import_model(out)
    assert next(back.parameters()).dtype == torch.bfloat16  # dtype=None: the checkpoint's
    for name, t in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], t.to(torch.bfloat16)), name
    assert mh.import_model(out, torch.float32).embed.weight.dtype == torch.float32
    _from_pretrained(out)


def test_pipeline_layers_and_experts_are_read_alone(tmp_path, monkeypatch):
    _, path = _saved("deepseek_v3", tmp_path)
    whole = mh.import_model(path)
    reads = []
    original = SafetensorsFiles._tensor
    monkeypatch.setattr(
        SafetensorsFiles, "_tensor", lambda self, n, lo, hi: reads.append((n, lo, hi)) or original(self, n, lo, hi)
    )
    torch.manual_seed(5)
    part = mh.import_model(path, layers={2, 3})  # blocks 1 and 2 only
    assert all(".layers.1." in n or ".layers.2." in n for n, *_ in reads), reads
    for name, t in part.state_dict().items():
        block = name.split(".")[1] if name.startswith("blocks.") else None
        assert torch.equal(t, whole.state_dict()[name]) == (block in ("1", "2")), name

    # a table that misses a row fails on a pipeline rank as strict loading does in one process
    from moe.hf.adapter import Adapter

    read = Adapter.read

    def drop_one(self, *a, **k):
        state = read(self, *a, **k)
        for n in [n for n in state if n.startswith("blocks.2.")][:1]:
            del state[n]
        return state

    monkeypatch.setattr(Adapter, "read", drop_one)
    with pytest.raises(AssertionError, match=r"left tensors of layers \[2, 3\] unread: \['blocks\.2\."):
        mh.import_model(path, layers={2, 3})
    mh.import_model(path, layers={0, 1})  # the dropped row is not of these layers


# ---------------------------------------------------------------------------------------------
# refusals, each by its field, before any tensor is read


@pytest.mark.parametrize(
    "case,over,match",
    [
        ("mixtral-kv2", dict(sliding_window=16), r"Mixtral config\.sliding_window=16"),
        ("qwen2_moe-kv2", dict(use_sliding_window=True, sliding_window=8), r"use_sliding_window=True"),
        ("qwen3_moe-kv2", dict(attention_bias=True), r"config\.attention_bias=True"),
        ("olmoe-kv2", dict(clip_qkv=8.0), r"config\.clip_qkv=8\.0"),
        ("olmoe-kv2", dict(hidden_act="gelu"), r"config\.hidden_act='gelu'"),
        ("deepseek_v3", dict(rms_norm_eps=1e-5), r"config\.rms_norm_eps=1e-05"),
        ("deepseek_v3", dict(topk_method="group_limited_greedy"), r"config\.topk_method='group_limited_greedy'"),
        ("qwen3_moe-kv1", dict(quantization_config={"quant_method": "fp8"}), r"config\.quantization_config='fp8'"),
        (
            "qwen3_moe-kv1",
            dict(
                rope_parameters=dict(
                    rope_type="longrope",
                    rope_theta=1e4,
                    short_factor=[1.0] * 5,
                    long_factor=[1.0] * 5,
                    original_max_position_embeddings=8,
                    factor=2.0,
                )
            ),
            r"config\.rope_parameters=.*longrope",
        ),
        ("qwen2_moe-kv1", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), r"dynamic"),
    ],
)
def test_import_refuses_by_field(case, over, match, tmp_path):
    hf = _hf_model(case)
    for k, v in over.items():
        setattr(hf.config, k, v)
    hf.config.save_pretrained(tmp_path)  # config.json only: the refusal comes before any weight file is opened
    with pytest.raises(ValueError, match=match):
        mh.import_model(tmp_path)


def test_import_refuses_other_model_types_and_mtp_modules(tmp_path, monkeypatch):
    (tmp_path / "oss").mkdir()
    (tmp_path / "oss" / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(ValueError, match=r"config\.model_type='gpt_oss' is not supported: .*attention sinks"):
        mh.import_model(tmp_path / "oss")
    # DeepSeek-V3 with a multi-token-prediction layer in the files: refused from the names alone
    from safetensors.torch import load_file, save_file

    _, path = _saved("deepseek_v3", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.zeros(D, 2 * D)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(SafetensorsFiles, "_tensor", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers: .*model\.layers\.3\.eh_proj\.weight"):
        mh.import_model(path)


def _ours(case, tmp_path, **cfg_over):
    import dataclasses

    _, path = _saved(case, tmp_path)
    cfg = mh.config_of(path)
    moe_over = {k[4:]: cfg_over.pop(k) for k in list(cfg_over) if k.startswith("moe.")}
    cfg = dataclasses.replace(cfg, **cfg_over, moe=dataclasses.replace(cfg.moe, **moe_over))
    return mh.import_model(path), cfg


@pytest.mark.parametrize(
    "case,family,over,match",
    [
        ("qwen3_moe-kv2", "mixtral", {}, r"^model\.moe_every=1 cannot be a Mixtral model: its MoE blocks are \[1, 2\]"),
        ("olmoe-kv2", "mixtral", {}, r"^model\.qk_norm='proj' cannot be a Mixtral model: a Mixtral model has"),
        ("mixtral-kv2", "olmoe", {"head_dim": 10}, r"^model\.head_dim=10 cannot be a OLMoE model"),
        ("mixtral-kv2", "qwen3_moe", {"qkv_bias": True}, r"^model\.qk_norm='none' cannot be a Qwen3-MoE model"),
        ("qwen3_moe-kv2", "qwen3_moe", {"qkv_bias": True}, r"^model\.qkv_bias=True cannot be a Qwen3-MoE model"),
        ("mixtral-kv1", "mixtral", {"rope_interleave": True}, r"^model\.rope_interleave=True cannot be a Mixtral"),
        ("deepseek_v3", "deepseek_v3", {"norm_eps": 1e-5}, r"^model\.norm_eps=1e-05 cannot be a DeepSeek-V3 model"),
        ("deepseek_v3", "deepseek_v3", {"moe.shared_d_ff": 15}, r"^moe\.shared_d_ff=15 cannot be a DeepSeek-V3"),
        ("qwen2_moe-kv2", "qwen2_moe", {"moe.shared_expert_gate": False}, r"^moe\.shared_expert_gate=False"),
        ("olmoe-kv1", "olmoe", {"moe.score_func": "sigmoid"}, r"^moe\.score_func='sigmoid' cannot be a OLMoE"),
    ],
)
def test_export_refuses_by_field(case, family, over, match, tmp_path):
    model, cfg = _ours(case, tmp_path, **over)
    with pytest.raises(ValueError, match=match):
        mh.export_model(model.state_dict(), tmp_path / "out", cfg, family=family)
    assert not (tmp_path / "out").exists()


def test_export_picks_the_one_family_that_carries_the_model(tmp_path):
    import dataclasses

    model, cfg = _ours("olmoe-kv2", tmp_path)
    del model.hf_family  # a model not imported: its config decides
    assert mh.export_model(model, tmp_path / "out").joinpath("config.json").read_text().count('"olmoe"') == 1
    with pytest.raises(
        ValueError, match=r"no supported family can carry this model: .*model\.qkv_bias=True cannot be a Qwen3"
    ):
        mh.export_model(model.state_dict(), tmp_path / "none", dataclasses.replace(cfg, qk_norm="head", qkv_bias=True))
    # a dense model: every MoE family says so, by field; the dense Llama carries it
    dense = dataclasses.replace(cfg, moe_every=0, moe=None, qk_norm="none")
    with pytest.raises(ValueError, match=r"model\.moe_every=0 cannot be a Qwen2-MoE model: a Qwen2-MoE model has MoE"):
        mh.export_model({}, tmp_path / "dense", dense, family="qwen2_moe")
    assert mh.families.exporter(dense).model_type == "llama"


@pytest.mark.parametrize("case", ["qwen3_moe-kv2", "deepseek_v3"])
def test_bf16_import_is_as_close_to_fp32_as_the_stock_bf16_model(case, tmp_path):
    # bf16 weights on both sides against the fp32 stock model: ours no further from it than 1.5x the
    # stock bf16 model's own distance (the rounding of bf16 weights and activations, ~1e-2, is the
    # same in both; which ops round where differs, hence the margin, as tests/hf/test_patch.py's bf16 check)
    hf, path = _saved(case, tmp_path)
    stock16 = _from_pretrained(path).to(torch.bfloat16)
    ours16 = mh.import_model(path, torch.bfloat16)
    assert ours16.embed.weight.dtype == torch.bfloat16
    idx = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=idx).logits
        theirs, mine = stock16(input_ids=idx).logits.float(), ours16(idx).float()
    assert _norm_rel(mine, ref) <= 1.5 * _norm_rel(theirs, ref), (_norm_rel(mine, ref), _norm_rel(theirs, ref))
