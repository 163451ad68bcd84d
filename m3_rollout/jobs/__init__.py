"""The job layer: the only code that wires the trainer (``m3_trainers``) and the rollout side
(engine, service, environments) together.

grpo            the GRPO loop (``python -m m3_rollout.grpo``)
stack           the rollout pieces of a run built from the config (checkpoint, backend, env, prompts)
builtin         the embedded tiny checkpoint, built (SFT warm start) and cached on first use
metrics_logger  step metrics to stdout, metrics.jsonl and Weights & Biases
dump_generate   dumps without training (``python -m m3_rollout.dump generate``)
replay          re-scoring and offline GRPO on a dump (``python -m m3_rollout.dump replay``)
dump_cli        the ``python -m m3_rollout.dump`` command line
export          checkpoints for other tools (``m3-rollout export``, ``python -m m3_rollout.export``)
interrupt       Ctrl-C at every entry: one ``interrupted:`` line and exit 130, while loading or working
"""
