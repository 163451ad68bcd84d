"""Adapters that let other RL frameworks drive this project's generation stack.

nemo_rl   ``NemoRLGeneration``: NeMo RL's ``GenerationInterface`` over a ``GenerationBackend``
          (batched right-padded dicts in and out, sleep / wake-up, refit, KV-cache invalidation),
          without importing nemo_rl; ``ReleasedNaming``: a trainer's tensors (any naming) as the
          released names and order a refit sends.
"""

from .nemo_rl import NemoRLGeneration, ReleasedNaming

__all__ = ["NemoRLGeneration", "ReleasedNaming"]
