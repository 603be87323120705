"""Benchmarks and the layer profiler, each run as ``python -m experiments.bench.<name> --help``.

They import torch, triton, ``moe``, ``zero``, ``routing_kernels`` and the helpers beside them
(``timing``, ``layers``), never each other, so one runs on a GPU box with nothing else installed
(``pipeline``'s trainer part, ``hf`` and ``bpe_compute`` need more: hydra, transformers, the trainer).
"""
