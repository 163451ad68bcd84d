"""Offline rollout dumps (design.md §2 step 7, §6): Parquet shards of GRPO trajectories.

schema    the versioned Arrow schema (one row per trajectory) and file naming
records   Trajectory <-> row conversion, routed-experts codec, block-selection placement, provenance hashes
writer    atomic, never-overwriting shard writer with retention; the GRPO loop's hook
reader    shard listing and loading; bad shards reported by file, the rest still load
report    ``inspect`` (per-step table) and ``show`` (one group by turn)
replay    re-scoring statistics: stored rollout logprobs against a scorer's

The jobs on a dump (generate without training, scorers, offline GRPO) and the CLI
``python -m m3_rollout.dump {generate,inspect,show,replay} ...`` are in ``m3_rollout.jobs``.
"""

import importlib

# NOTE: the names load with their module on first use (PEP 562), not with the package:
# ``python -m m3_rollout.dump`` imports this package before its ``__main__`` runs, so the
# submodules' torch and pyarrow (seconds) loaded here were outside the entry's Ctrl-C handling
# (m3_rollout.jobs.interrupt.run_entry) and a Ctrl-C then printed a traceback.
_NAMES = {
    "reader": (
        "DumpDirError",
        "DumpError",
        "DumpFileError",
        "DumpRead",
        "SchemaVersionError",
        "ShardInfo",
        "read_dump",
        "read_shard",
        "shard_info",
        "shard_paths",
    ),
    "records": (
        "StepContext",
        "decode_routed_experts",
        "encode_routed_experts",
        "table_from_trajectories",
        "trajectories_from_rows",
        "trajectory_from_row",
    ),
    "schema": ("SCHEMA", "SCHEMA_VERSION"),
    "writer": ("RetentionPolicy", "RolloutDumpWriter", "writer_from_config"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
# The submodules an ``import m3_rollout.dump`` bound as attributes when it imported them eagerly.
_SUBMODULES = (*_NAMES, "row_checks")

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    """``m3_rollout.dump.NAME`` for a name of ``__all__``, from its submodule, or one of
    ``_SUBMODULES`` itself (imported now).

    Raises:
        AttributeError: any other name.
    """
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    """The loaded attributes plus every name of ``__all__`` and ``_SUBMODULES`` (loaded or not)."""
    return sorted({*globals(), *__all__, *_SUBMODULES})
