"""Imported once by the forkserver of ProcessLauncher, so every worker forks warm.

Besides importing the worker module, it runs one ``normal_`` on the ``meta`` device: the first
such call imports torch's decomposition machinery (seconds); building a model on ``meta`` (the
sharded loader does) would otherwise pay it in every freshly started worker.
"""

import torch

import m3_rollout.service.worker  # noqa: F401

with torch.device("meta"):
    torch.nn.init.normal_(torch.empty(1))
