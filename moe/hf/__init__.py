"""Hugging Face transformers interop. Needs the optional extra (``pip install -e .[hf]``); ``import
moe`` never imports this package, and importing it imports neither transformers nor safetensors
(the functions that need them do, when called).

- ``moe.hf.patch``: ``patch(model)``, a transformers MoE model's sparse blocks swapped for
  ``MoELayer`` in place (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3).
- ``moe.hf.stock``: the stock way back: ``unpatch``, ``stock_state_dict``, ``save_pretrained``,
  and the load pre-hook that lets a patched model load the stock layout.
- ``moe.hf.logits_tap``: how a patched layer's router logits reach transformers' output recorder.
- ``moe.hf.adapter``: ``Adapter``, the conversions every family's tables are read with, in both
  directions; ``moe.hf.tables``: what the tables are made of (``Row``, ``Field``, ``Fixed``) and
  transformers 5's fused expert layout against ours.
- ``moe.hf.families``: ``import_model`` / ``export_model``, any supported family's checkpoint
  directory as our ``Transformer`` and back, the family picked by ``model_type`` (``FAMILIES``).
- ``moe.hf.mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``olmoe``, ``deepseek_v3``: one adapter per
  family, each one mapping table read both ways (``moe.hf.common``: the rows and fields they
  share; ``moe.hf.arch``: what a config's weights compute, compared to refuse what a family
  cannot carry). ``export_mixtral``/``import_mixtral`` are the Mixtral case.
- ``moe.hf.safetensors_io``: safetensors files tensor by tensor (``TensorSource``,
  ``SafetensorsFiles``, ``write_safetensors``, shards and their index).

Note: ``moe.hf.patch`` is the function, which hides the submodule of that name as an attribute;
``from moe.hf.patch import X`` still reads the module (``import moe.hf.patch as m`` does not).
"""

# The private names ("_x as _x") are kept here on purpose: tests and experiments/bench/hf.py read
# moe.hf._BLOCKS and moe.hf._patched_layers; a patched model pickled while this package was one
# module, moe/hf.py, names _new_tap, _SavePretrained and _load_stock_layout as moe.hf.<name>.
from .families import FAMILIES, config_of, export_model, import_model, import_state_dict, read_config
from .logits_tap import _new_tap as _new_tap
from .mixtral import (
    export_mixtral,
    import_mixtral,
    import_mixtral_state_dict,
    mixtral_config,
    read_mixtral_config,
    to_mixtral_state_dict,
)
from .patch import _BLOCKS as _BLOCKS
from .patch import SUPPORTED_MODEL_TYPES, patch
from .safetensors_io import DEFAULT_SHARD_BYTES, SafetensorsFiles, TensorSource, write_safetensors
from .stock import _load_stock_layout as _load_stock_layout
from .stock import _patched_layers as _patched_layers
from .stock import _SavePretrained as _SavePretrained
from .stock import save_pretrained, stock_state_dict, unpatch
from .tables import fused_to_ours, ours_to_fused

__all__ = [
    "import_model",
    "export_model",
    "import_state_dict",
    "read_config",
    "config_of",
    "FAMILIES",
    "patch",
    "unpatch",
    "stock_state_dict",
    "save_pretrained",
    "SUPPORTED_MODEL_TYPES",
    "export_mixtral",
    "import_mixtral",
    "import_mixtral_state_dict",
    "to_mixtral_state_dict",
    "mixtral_config",
    "read_mixtral_config",
    "fused_to_ours",
    "ours_to_fused",
    "TensorSource",
    "SafetensorsFiles",
    "write_safetensors",
    "DEFAULT_SHARD_BYTES",
]
