"""Adapters that let other RL frameworks drive this project's generation stack.

nemo_rl   ``NemoRLGeneration``: NeMo RL's ``GenerationInterface`` over a ``GenerationBackend``
          (batched right-padded dicts in and out, sleep / wake-up, refit, KV-cache invalidation),
          without importing nemo_rl.
"""

from .nemo_rl import NemoRLGeneration

__all__ = ["NemoRLGeneration"]
