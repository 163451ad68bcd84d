"""scripts/bench_grpo_step.py on the CPU at tiny sizes: both modes write their figures into a docs file."""

import pytest
from script_loader import script_module  # tests/ on sys.path


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_grpo_step") as module:
        yield module


def test_step_split_reads_the_timing_keys_there_are(bench):
    rows = [
        {
            "timing/train/total_step_time": 9.0,
            "timing/train/generation": 5.0,
            "performance/generation_tokens_per_s": 1.0,
        },
        {
            "timing/train/total_step_time": 4.0,
            "timing/train/generation": 2.0,
            "timing/train/policy_and_reference_logprobs": 0.5,
            "timing/train/policy_training": 1.0,
            "timing/train/prepare_for_generation/transfer_and_update_weights": 0.25,
            "timing/train/finish_generation": 0.125,
            "timing/train/prepare_for_generation/graph_capture": 0.0625,  # part of wake_up: not a phase
            "performance/generation_tokens_per_s": 300.0,
        },
    ]
    s = bench.step_split(rows)  # step 1 left out
    assert s["steps"] == 1 and s["step"] == 4.0
    assert s["phases"] == {
        "generation": 2.0,
        "logprob recomputation": 0.5,
        "training": 1.0,
        "refit": 0.25,
        "sleep": 0.125,
        "wake": None,
    }
    assert s["other"] == pytest.approx(0.125) and s["tokens_per_s"] == 300.0
    assert s["keys"]["refit"] == ["timing/train/prepare_for_generation/transfer_and_update_weights"]
    assert s["keys"]["wake"] == []


def test_real_shapes_tiny_writes_phases_memory_and_refit_ratio(bench, tmp_path):
    doc = tmp_path / "bench.md"
    argv = ["--real-shapes", "--device", "cpu", "--tiny", "--layers", "2", "--experts", "4", "--doc", str(doc)]
    lines = bench.main(argv)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n") and "\n".join(lines) in text
    assert "bench_grpo_step.py --real-shapes" in text and "2 layers" in text and "x 4 experts" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    for phase in ("generation", "logprob recomputation", "training", "refit", "raw flat copy"):
        seconds = rows[phase].split(" | ")[1]
        assert float(seconds) > 0, rows[phase]
        assert rows[phase].endswith("| - |")  # no CUDA memory figures on the CPU
    assert "Refit " in text and "vs raw flat copy" in text and "Generated tokens/s: " in text
    # the job's trainer: the refit sent the bf16 compute copy and the receiver trusted the cast's flags
    assert "precision bfloat16" in text and "Refit verdict: attested (initial refit: attested)" in text
    assert "skipped_step False" in text


def test_main_job_tiny_writes_split_and_learning_curve(bench, tmp_path, monkeypatch):
    from m3_rollout.config import ClusterConfig

    if "device" not in ClusterConfig.__dataclass_fields__:
        pytest.skip("configs/grpo_h200.yaml sets cluster.device, which the trainer-on-device work adds")
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    doc = tmp_path / "bench.md"
    argv = ["--device", "cpu", "--tiny", "--seeds", "7", "--steps", "1", "--doc", str(doc)]
    lines = bench.main([*argv, "grpo.num_val_prompts=2", "policy.generation.max_new_tokens=8"])
    text = doc.read_text()
    assert "GRPO step split, GPU main job" in text and "configs/grpo_h200.yaml" in text
    split = next(line for line in lines if line.startswith("| 7 | 1 |"))
    cells = [c.strip() for c in split.strip("|").split("|")]
    # seed, steps, step, generation, logprobs, training, refit, sleep, wake, other, tok/s
    assert len(cells) == 11 and all(float(c) > 0 for c in cells[2:7])
    curve = next(line for line in lines if line.startswith("| 7 |") and "0: 0." in line)
    assert curve.rstrip(" |").endswith("1: 0.000") or ", 1: " in curve  # step 0 and the final validation
    build, loop = (c.strip() for c in curve.strip("|").split("|")[1:3])
    assert build != "cached" and float(loop) > 0  # a fresh cache: the checkpoint was built in this run


def test_main_job_tiny_runs_the_multi_gpu_topology_on_the_cpu(bench, tmp_path, monkeypatch):
    """--config configs/grpo_h200_x2.yaml (issue 25: trainer on one GPU, EP=2 rollout workers on two
    others, refit by broadcast) in the same shape on the CPU: the trainer process and 2 worker
    processes (gloo), the tiny random checkpoint, one step."""
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    doc = tmp_path / "bench.md"
    argv = ["--config", "configs/grpo_h200_x2.yaml", "--device", "cpu", "--tiny", "--seeds", "7", "--steps", "1"]
    overrides = ["cluster.gpus_per_node=0", "grpo.num_val_prompts=2", "policy.generation.max_new_tokens=8"]
    lines = bench.main([*argv, "--doc", str(doc), *overrides])
    text = doc.read_text()
    assert "--config configs/grpo_h200_x2.yaml" in text and "cluster.device=cpu cluster.gpus_per_node=0" in text
    split = next(line for line in lines if line.startswith("| 7 | 1 |"))
    cells = [c.strip() for c in split.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[2:7])  # step, generation, logprobs, training, refit (broadcast)
    assert cells[7:9] == ["-", "-"]  # no sleep / wake-up: the workers are not colocated


def test_main_job_tiny_runs_the_colocated_multi_gpu_topology_on_the_cpu(bench, tmp_path, monkeypatch):
    """--config configs/grpo_h200_x2_colocated.yaml (issue 25: EP=2 rollout workers beside the
    trainer, refit through its shared memory, no NCCL) in the same shape on the CPU: the trainer
    process and 2 worker processes (gloo), refit from the trainer's shared-memory stage, the tiny
    random checkpoint, one step; both workers sleep while the trainer trains."""
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    doc = tmp_path / "bench.md"
    config = "configs/grpo_h200_x2_colocated.yaml"
    argv = ["--config", config, "--device", "cpu", "--tiny", "--seeds", "7", "--steps", "1"]
    overrides = ["cluster.gpus_per_node=0", "grpo.num_val_prompts=2", "policy.generation.max_new_tokens=8"]
    lines = bench.main([*argv, "--doc", str(doc), *overrides])
    assert f"--config {config}" in doc.read_text()
    split = next(line for line in lines if line.startswith("| 7 | 1 |"))
    cells = [c.strip() for c in split.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[2:7])  # step, generation, logprobs, training, refit (IPC)
    assert "-" not in cells[7:9] and float(cells[8]) > 0  # sleep / wake-up timed: the workers share the device
