"""Mixture-of-experts layers: routers, balancing losses, grouped experts, dispatchers, MoELayer."""

from routing_kernels.runtime import is_expert_param

from .config import MoEConfig
from .dispatch import AllToAllDispatcher, LocalDispatcher, NodeDispatcher
from .experts import DenseFFN, GroupedExperts
from .layer import MoELayer, MoEStats, moe_layers, scale_aux_losses, update_expert_biases
from .losses import load_balancing_loss, router_z_loss, routing_entropy, sequence_load_balancing_loss
from .model import Transformer, TransformerConfig
from .router import Router, Routing, capacity, capacity_keep_mask

__all__ = [
    "MoEConfig",
    "MoELayer",
    "MoEStats",
    "Router",
    "Routing",
    "GroupedExperts",
    "DenseFFN",
    "LocalDispatcher",
    "AllToAllDispatcher",
    "NodeDispatcher",
    "load_balancing_loss",
    "sequence_load_balancing_loss",
    "router_z_loss",
    "routing_entropy",
    "capacity",
    "capacity_keep_mask",
    "moe_layers",
    "scale_aux_losses",
    "update_expert_biases",
    "is_expert_param",
    "Transformer",
    "TransformerConfig",
]
