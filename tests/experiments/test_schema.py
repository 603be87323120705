"""The config schema (experiments/training/schema.py): yaml files hold deltas only, typos and wrong types stop
composition naming the key, every config composes into valid moe configs, moe stays hydra-free."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from experiments.training import schema
from moe import MoEConfig
from moe.model import TransformerConfig
from tests.support.paths import NOT_GROUPS

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
# the trainer's groups; conf/hydra holds Hydra's own (hydra/launcher: the submitit plugin's schemas)
GROUPS = sorted(
    p.name
    for p in CONF.iterdir()
    if p.is_dir() and not p.name.startswith("_") and p.name not in ("experiment", "hydra", *NOT_GROUPS)
)


def cfg_of(*overrides, conf=CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _group_files():
    return [(group, f) for group in GROUPS for f in sorted((CONF / group).glob("*.yaml"))]


def _redundant(raw: dict, schema_cls: type, path: str = "") -> list[str]:
    """Keys of ``raw`` (a yaml's own keys) whose value, as the schema types it, equals the schema's
    default; ``???`` where the schema already has ``???`` counts as a default too."""
    base = OmegaConf.structured(schema_cls)
    typed = OmegaConf.to_container(OmegaConf.merge(base, raw))  # merge converts: 1.0e-5 == 1e-5, 300 == 300.0
    default = OmegaConf.to_container(base)
    out = []
    for key in raw:
        sub = getattr(schema_cls, "__dataclass_fields__", {}).get(key)
        if (
            isinstance(raw[key], dict)
            and sub is not None
            and dataclasses.is_dataclass(typing.get_type_hints(schema_cls)[key])
        ):
            out += _redundant(raw[key], typing.get_type_hints(schema_cls)[key], f"{path}{key}.")
        elif typed[key] == default[key] and type(typed[key]) is type(default[key]):
            out.append(f"{path}{key}={raw[key]!r}")
    return out


def test_every_group_is_registered_with_its_schema():
    assert set(schema.GROUPS) == set(GROUPS), "one schema per conf/ group"
    assert schema.GROUPS["moe"] is MoEConfig  # the moe dataclass itself, not a copy


def test_model_schema_is_transformer_config_without_moe():
    ours = {f.name: f for f in dataclasses.fields(schema.ModelConfig)}
    theirs = {f.name: f for f in dataclasses.fields(TransformerConfig) if f.name != "moe"}
    trainer = [name for name, _, _ in schema.MODEL_TRAINER_FIELDS]
    assert list(ours) == list(theirs) + trainer  # the trainer's own keys (init_from) come last
    hints, their_hints = typing.get_type_hints(schema.ModelConfig), typing.get_type_hints(TransformerConfig)
    for name, f in theirs.items():
        assert hints[name] == their_hints[name], name
        if f.default is dataclasses.MISSING:
            assert ours[name].default == "???", f"{name} is required in TransformerConfig, so ??? in the schema"
        else:
            assert ours[name].default == f.default, name


@pytest.mark.parametrize("group,path", _group_files(), ids=lambda x: x if isinstance(x, str) else x.stem)
def test_group_yaml_holds_only_deltas(group, path):
    raw = OmegaConf.to_container(OmegaConf.load(path))
    assert raw.pop("defaults", None) == [f"base_{group}", "_self_"], f"{path} starts from the registered schema"
    redundant = _redundant(raw, schema.GROUPS[group])
    assert not redundant, f"{path.relative_to(ROOT)} repeats the schema's defaults: {redundant}"


def test_train_yaml_holds_only_deltas():
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"))
    defaults, _ = raw.pop("defaults"), raw.pop("hydra")
    assert defaults[:2] == ["base_train", "_self_"]
    assert not _redundant(raw, schema.TrainConfig), "conf/train.yaml repeats TrainConfig's defaults"


def test_delta_check_sees_a_repeated_default(tmp_path):
    # the check above is not vacuous: a default written out (in the yaml's own spelling) is caught
    assert _redundant({"top_k": 2, "aux_loss_coef": 1.0e-2, "d_model": "${model.d_model}"}, MoEConfig) == [
        "top_k=2",
        "aux_loss_coef=0.01",
    ]
    assert _redundant({"rope_theta": 10000, "moe_every": 2}, schema.ModelConfig) == ["rope_theta=10000"]
    assert _redundant({"train": {"steps": 400, "seq_len": 64}, "seed": 1}, schema.TrainConfig) == ["train.steps=400"]


def _choices():
    return [f"{g}={f.stem}" for g in GROUPS + ["experiment"] for f in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("choice", _choices())
def test_every_config_composes_into_valid_moe_configs(choice):
    cfg = cfg_of(choice, *(["data.path=/corpus"] if choice in ("data=text", "data=tokens") else []))
    assert OmegaConf.get_type(cfg) is schema.TrainConfig
    for group, cls in schema.GROUPS.items():
        assert OmegaConf.get_type(cfg[group]) is cls, group
    schema.check_keys(cfg)
    # what build_model does, without the model: the moe dataclasses validate the values
    moe_cfg = MoEConfig.from_dict(OmegaConf.to_container(cfg.moe, resolve=True, throw_on_missing=True))
    model = OmegaConf.to_container(cfg.model, resolve=True, throw_on_missing=True)
    for name, _, _ in schema.MODEL_TRAINER_FIELDS:  # the trainer's keys, which build_model takes out
        model.pop(name)
    TransformerConfig.from_dict(model, moe=moe_cfg)
    # the tracker's copy (wandb's config) is plain, resolved and serialisable
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert type(plain["moe"]) is dict and "${" not in json.dumps(plain)


@pytest.mark.parametrize(
    "override,key",
    [
        ("moe.topk=2", "moe.topk"),
        ("train.stepz=3", "train.stepz"),
        ("model.d_modle=64", "model.d_modle"),
        ("parallel.zero_stag=1", "parallel.zero_stag"),
        ("optim.learning_rate=1e-3", "optim.learning_rate"),
        ("data.paht=/x", "data.paht"),
        ("logger.projet=x", "logger.projet"),
        ("sed=1", "sed"),
    ],
)
def test_mistyped_key_is_rejected_naming_it(override, key):
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'") as info:
        cfg_of(override)
    assert f"full_key: {key}" in str(info.value.__cause__)


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.steps=abc", "train.steps"),
        ("moe.top_k=two", "moe.top_k"),
        ("moe.capacity_factor=lots", "moe.capacity_factor"),
        ("model.d_model=1.5", "model.d_model"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("parallel.zero_hpz=perhaps", "parallel.zero_hpz"),
        ("optim.lr=fast", "optim.lr"),
        ("optim.betas=0.9", "optim.betas"),
        ("data.vocab_size=big", "data.vocab_size"),
        ("seed=x", "seed"),
    ],
)
def test_wrong_type_is_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException, match=f"Error merging override {override}") as info:
        cfg_of(override)
    assert f"full_key: {key}" in str(info.value.__cause__)


def test_typo_in_a_yaml_is_rejected_naming_the_key(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with open(conf / "moe" / "switch.yaml", "a") as f:
        f.write("capacity_factr: 2.0\n")
    with pytest.raises(ConfigCompositionException, match="capacity_factr"):
        cfg_of("moe=switch", conf=conf)


def test_added_key_is_rejected_before_training():
    # `+key=value` opens struct mode on purpose, so composition lets it through; the trainer stops
    from experiments.train import train

    cfg = cfg_of("+moe.foo=1", "+train.stepz=3")
    with pytest.raises(ValueError) as info:
        schema.check_keys(cfg)
    assert "unknown config key moe.foo: MoEConfig has no such field (valid: d_model, d_ff, num_experts" in str(
        info.value
    )
    assert "unknown config key train.stepz: TrainLoopConfig has no such field (valid: steps," in str(info.value)
    with pytest.raises(ValueError, match=r"train\.stepz"):
        train(cfg_of("model=tiny", "logger=none", "+train.stepz=3"))
    schema.check_keys(OmegaConf.create({"anything": {"goes": 1}}))  # untyped configs are not checked


@pytest.mark.distributed
def test_moe_zero_kernels_import_without_hydra():
    # hydra, omegaconf, wandb and transformers made unimportable: the library packages must not need them
    code = (
        "import sys\n"
        "for m in ('hydra', 'omegaconf', 'wandb', 'transformers', 'safetensors'): sys.modules[m] = None\n"
        "import moe, moe.model, zero, routing_kernels\n"
        "moe.MoEConfig(d_model=8, d_ff=16)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
