"""Rollout processes (design.md §5-6).

worker     RolloutWorker: one EP rank (expert shard + LLMEngine), lockstep ``run``
launchers  Ray actors (default where Ray is installed) or torch.multiprocessing processes
service    RolloutService: P workers behind one GenerationBackend; placement, restart on failure
ipc_refit  the driver's end of the refit of a worker on its own device (colocated_placement=worker_process)
factory    build the service from the job config (used by m3_rollout.grpo)
"""

from .launchers import GroupFailure, Launcher, ProcessLauncher, RayLauncher, init_ray, make_launcher
from .service import RolloutFailure, RolloutService
from .worker import RolloutWorker, WorkerSpec

__all__ = [
    "GroupFailure",
    "Launcher",
    "ProcessLauncher",
    "RayLauncher",
    "init_ray",
    "make_launcher",
    "RolloutFailure",
    "RolloutService",
    "RolloutWorker",
    "WorkerSpec",
]
