"""Hugging Face interop (``moe.hf.patch``, ``moe.hf.mixtral``)."""

from .patch import (
    _BLOCKS,
    SUPPORTED_MODEL_TYPES,
    _patched_layers,
    export_mixtral,
    fused_to_ours,
    import_mixtral,
    ours_to_fused,
    patch,
    save_pretrained,
    stock_state_dict,
    unpatch,
)

__all__ = [
    "patch",
    "unpatch",
    "stock_state_dict",
    "save_pretrained",
    "SUPPORTED_MODEL_TYPES",
    "export_mixtral",
    "import_mixtral",
    "fused_to_ours",
    "ours_to_fused",
]
