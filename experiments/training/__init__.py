"""The trainer, one job per module; ``python -m experiments.train`` runs ``loop.train``.

- ``loop``: ``Trainer`` (build, one step, validation, log rows, checkpoints, summary) and ``train``;
- ``build``: layout, pipeline plan, model, engine, device and precision from the config;
- ``checks``: the trainer's own config keys, checked once before any collective;
- ``schema``: the config schema (Hydra's ConfigStore) and ``model_config``;
- ``optim``: the optimizer factory and the learning-rate schedule;
- ``evaluate``: the loss and the validation pass; ``stats``: what a log row sums;
- ``data``: the corpora and their batches; ``tracking``: metrics.jsonl, wandb, sweep summaries;
- ``nonfinite``: skipped steps and when a run stops;
- ``checkpointing`` and ``preemption``: saving, resuming, and stopping on a scheduler's signal;
- ``export``: a checkpoint as safetensors or a transformers directory (``python -m experiments.checkpoint``).
- ``corpus`` and ``preparing``: ``python -m experiments.prepare``'s sources (planned, read) and its work
  (tokenizing workers, the shards written and resumed).

Importing this package imports none of them, so ``experiments.training.data`` stays light.
"""
