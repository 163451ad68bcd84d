"""NeMo RL conventions: its config keys accepted (or refused naming ours), Hydra-style +/++ overrides,
checkpointing.metric_name checked against the logged names, wandb entity/group/tags and the resume
rule (a stand-in wandb module), and the advantage metrics' definition."""

import copy
import sys
import types
from pathlib import Path

import pytest
import torch

from m3_rollout.config import ConfigError, load_config
from m3_rollout.jobs.metrics_logger import MetricsLogger
from m3_rollout.jobs.step_metrics import advantage_metrics, logged_metric_names, resolve_metric_name

MAIN = "configs/grpo_bf16_ep.yaml"


def test_nemo_rl_keys_map_to_ours_in_overrides_and_yaml(tmp_path):
    cfg = load_config(
        MAIN,
        [
            "grpo.max_val_samples=32",
            "policy.generation.vllm_cfg.enforce_eager=true",
            "policy.refit_buffer_size_gb=0.5",
            "policy.optimizer.kwargs.betas=[0.8,0.95]",
            "loss_fn.use_importance_sampling_correction=true",
            "loss_fn.truncated_importance_sampling_type=icepop",
            "loss_fn.truncated_importance_sampling_ratio=5",  # icepop's upper bound
            "loss_fn.truncated_importance_sampling_ratio_min=0.5",
        ],
    )
    assert cfg.grpo.num_val_prompts == 32 and cfg.policy.generation.enable_cuda_graphs is False
    assert cfg.weight_sync.bucket_size_mb == 512.0
    assert (cfg.policy.optimizer.beta1, cfg.policy.optimizer.beta2) == (0.8, 0.95)
    lf = cfg.loss_fn
    assert (lf.importance_sampling_type, lf.mis_ratio_min, lf.mis_ratio_max) == ("mis", 0.5, 5.0)
    assert lf.truncated_importance_sampling_ratio == 2.0  # the TIS threshold is untouched
    child = tmp_path / "nemo.yaml"
    child.write_text(
        f"defaults: {Path(MAIN).resolve()}\n"
        "grpo:\n  max_val_samples: 16\n"
        "policy:\n  generation:\n    vllm_cfg:\n      enforce_eager: false\n      precision: float32\n"
        "loss_fn:\n  truncated_importance_sampling_type: tis\n  truncated_importance_sampling_ratio: 3.0\n"
    )
    cfg = load_config(child)
    assert cfg.grpo.num_val_prompts == 16 and cfg.policy.generation.enable_cuda_graphs is True
    assert cfg.policy.generation.dtype == "float32"
    assert cfg.loss_fn.importance_sampling_type == "tis" and cfg.loss_fn.truncated_importance_sampling_ratio == 3.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("policy.generation.vllm_cfg.gpu_memory_utilization=0.6", "policy.generation.kv_cache_memory_fraction"),
        ("policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.expert_parallel_size"),
        ("loss_fn.truncated_importance_sampling_type=seq-mask-tis", "loss_fn.importance_sampling_type=mis"),
        ("loss_fn.truncated_importance_sampling_ratio_min=0.5", "loss_fn.mis_ratio_min"),
        ("grpo.val_batch_size=8", "grpo.num_val_prompts"),
        ("+grpo.max_num_steps=5", "use grpo.max_num_steps=... or ++grpo.max_num_steps=..."),
        ("+grpo.no_such_key=1", "a typed schema takes no new keys"),
        ("++grpo.max_num_stpes=1", "did you mean 'grpo.max_num_steps'"),
        ("~grpo.seed", "cannot be deleted"),
    ],
)
def test_refused_keys_and_hydra_prefixes_name_what_to_use(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, [override])
    assert needle in str(exc.value)


def test_nemo_rl_default_loss_section_without_truncation(tmp_path):
    """NeMo RL's default loss_fn section (correction off, ratio and type null) is accepted; a null
    ratio with the correction on or unset (untruncated weights, which this loss lacks) is refused."""
    child = tmp_path / "nemo_loss.yaml"
    child.write_text(
        f"defaults: {Path(MAIN).resolve()}\n"
        "loss_fn:\n  use_importance_sampling_correction: false\n  truncated_importance_sampling_ratio: null\n"
        "  truncated_importance_sampling_type: null\n  truncated_importance_sampling_ratio_min: null\n"
    )
    lf = load_config(child).loss_fn
    assert lf.use_importance_sampling_correction is False
    assert (lf.importance_sampling_type, lf.truncated_importance_sampling_ratio) == ("tis", 2.0)
    for overrides in (
        ["loss_fn.truncated_importance_sampling_ratio=null"],
        ["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_ratio=null"],
    ):
        with pytest.raises(ConfigError, match="use_importance_sampling_correction=false next to it"):
            load_config(MAIN, overrides)
    with pytest.raises(ConfigError, match="no untruncated or sequence-level weights"):
        load_config(MAIN, ["loss_fn.truncated_importance_sampling_type=null"])  # a ratio is set: type needed


def test_double_plus_overrides_like_a_plain_override():
    assert load_config(MAIN, ["++grpo.max_num_steps=7"]).grpo.max_num_steps == 7


def test_checkpoint_metric_name_must_be_a_logged_name():
    base = load_config(MAIN, ["checkpointing.metric_name=val:accuracy"])  # NeMo RL's form

    def cfg(metric_name=None, keep_top_k=None, validates=True, sleep_level=0):
        c = copy.deepcopy(base)
        c.checkpointing.metric_name = metric_name or c.checkpointing.metric_name
        c.checkpointing.keep_top_k = keep_top_k
        c.grpo.val_at_start = c.grpo.val_at_end = validates
        c.grpo.val_period = c.grpo.val_period if validates else 1000
        c.policy.generation.sleep_level = sleep_level
        return c

    assert resolve_metric_name(cfg()) == "validation/accuracy"
    assert resolve_metric_name(cfg("train:reward")) == "train/reward"
    with pytest.raises(ConfigError, match="now logged as 'validation/accuracy'"):
        resolve_metric_name(cfg("val/accuracy"))
    with pytest.raises(ConfigError, match="did you mean 'train/reward'"):
        resolve_metric_name(cfg("train/rewrd"))
    assert "validation/accuracy" not in logged_metric_names(cfg(validates=False))
    assert resolve_metric_name(cfg(validates=False)) == "validation/accuracy"  # nothing ranks by it
    with pytest.raises(ConfigError, match="never validates"):
        resolve_metric_name(cfg(keep_top_k=2, validates=False))
    assert "timing/train/finish_generation" in logged_metric_names(cfg(sleep_level=1))
    assert "timing/train/finish_generation" not in logged_metric_names(cfg())
    # NeMo RL's null: no metric to rank by (keep_top_k keeps the newest); was a type error of the schema
    assert resolve_metric_name(load_config(MAIN, ["checkpointing.metric_name=null"])) is None


def test_advantage_metrics_weight_each_sample_by_its_trained_tokens():
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])  # 3, 1 and 0 trained tokens
    m = advantage_metrics(adv, mask)
    assert m["advantages/mean"] == pytest.approx(0.5) and m["advantages/std"] == pytest.approx(0.75**0.5)
    assert (m["advantages/min"], m["advantages/max"]) == (-1.0, 1.0)  # the untrained 0.5 counts nowhere
    assert advantage_metrics(adv, torch.zeros(3, 4))["advantages/std"] == 0.0


def _fake_wandb(monkeypatch):
    calls = []

    class Run:
        def __init__(self, **kwargs):
            calls.append(kwargs)
            self.id = kwargs.get("id", "fresh-id")

        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run(**kw)))
    return calls


def test_wandb_fields_and_resume_rule(tmp_path, monkeypatch):
    calls = _fake_wandb(monkeypatch)
    wandb = [
        "logger.wandb.mode=offline",
        "logger.wandb.entity=lab",
        "logger.wandb.group=sweep",
        "logger.wandb.tags=[a]",
    ]
    cfg = load_config(MAIN, [*wandb, f"logger.log_dir={tmp_path}"]).logger
    run_config = {"checkpointing": {"resume": False}}
    fresh = MetricsLogger(cfg, run_config, resume_run_id="ignored-for-a-fresh-run")
    assert fresh.run_id == "fresh-id"
    assert (calls[0]["entity"], calls[0]["group"], calls[0]["tags"], calls[0]["mode"]) == (
        "lab",
        "sweep",
        ["a"],
        "offline",
    )
    assert "id" not in calls[0]
    fresh.close()
    resumed = {"checkpointing": {"resume": True}}
    assert MetricsLogger(cfg, resumed, resume_run_id="abc").run_id == "abc"
    assert calls[1]["id"] == "abc" and calls[1]["resume"] == "allow"
    cfg.wandb.resume = "must"
    MetricsLogger(cfg, resumed, resume_run_id="abc")
    assert calls[2]["resume"] == "must"
    with pytest.raises(ConfigError, match="records no wandb run id"):
        MetricsLogger(cfg, resumed, resume_run_id=None)
    cfg.wandb.resume = "never"
    MetricsLogger(cfg, resumed, resume_run_id="abc")
    assert "id" not in calls[3]
    with pytest.raises(ConfigError, match="logger.wandb.resume"):
        load_config(MAIN, ["logger.wandb.resume=sometimes"])
