"""The entry points on unusable input, as a new user meets it: a corrupt checkpoint stops grpo and
serve with one ``error:`` line naming the file (exit 2, as export says it), export's ``--out``
naming a file is a bad argument (exit 2), serve's port in use is one line naming ``--port`` (exit
3) with nothing printed as served, a Ctrl-C while serve starts or serves is one line (exit 130), and the
end-of-run plot hint runs from any directory."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from server_util import save_tiny_checkpoint, tiny_model, tiny_tokenizer

import m3_rollout.jobs.grpo as grpo
from m3_rollout.jobs.export import main as export_main
from m3_rollout.parallel.process_group import free_port
from m3_rollout.serve import main as serve_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A good tiny checkpoint (tokenizer + chat template), one with its model.safetensors cut in
    half, and one whose config.json is not JSON."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("ckpts")
    good = save_tiny_checkpoint(root / "good", tok, tiny_model(len(tok)))
    trunc, bad_json = root / "trunc", root / "bad_json"
    shutil.copytree(good, trunc)
    shutil.copytree(good, bad_json)
    weights = trunc / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    (bad_json / "config.json").write_text('{"model_type":\n')
    return good, trunc, bad_json


def _grpo_args(tmp_path, model_dir):
    return [
        "--config",
        "configs/grpo_smoke.yaml",
        "policy.generation.expert_parallel_size=1",
        "cluster.launcher=auto",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path}/logs",
        f"policy.model_name={model_dir}",
    ]


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    return last


def test_grpo_with_a_truncated_safetensors_exits_2_naming_it(ckpts, tmp_path, capsys):
    _, trunc, _ = ckpts
    with pytest.raises(SystemExit) as exc:
        grpo.main(_grpo_args(tmp_path, trunc))
    assert exc.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {trunc}/model.safetensors: not a readable safetensors file"), line


def test_grpo_with_a_config_json_that_is_not_json_names_it_not_the_tokenizer(ckpts, tmp_path, capsys):
    _, _, bad_json = ckpts
    with pytest.raises(SystemExit) as exc:
        grpo.main(_grpo_args(tmp_path, bad_json))
    assert exc.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{bad_json}/config.json: not valid JSON (line 2, column 1" in line and "fix or re-download it" in line
    assert "tokenizer" not in line, line


def test_serve_with_a_corrupt_checkpoint_exits_2_naming_the_file(ckpts, capsys):
    _, trunc, bad_json = ckpts
    assert serve_main(["--model", str(trunc), "--port", str(free_port())]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert line.startswith(f"error: {trunc}/model.safetensors: not a readable safetensors file"), line
    assert "serving" not in captured.out
    assert serve_main(["--model", str(bad_json), "--port", str(free_port())]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: --model: {bad_json}/config.json: not valid JSON (line 2, column 1"), line


def test_bad_config_json_values_stop_grpo_serve_and_export_in_one_line_listing_every_key(ckpts, tmp_path, capsys):
    # JSON that parses but holds values the model refuses (a string eps, a negative eos id): one
    # line naming the file and every bad key, exit 2, before transformers' own config class (which
    # raised a traceback about a dataclass field) or the weights are read.
    good, _, _ = ckpts
    bad = tmp_path / "bad_values"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["rms_norm_eps"] = "1e-6"
    cfg["text_config"]["eos_token_id"] = [3, -1]
    (bad / "config.json").write_text(json.dumps(cfg))
    want = (
        f"{bad}/config.json: invalid M3 config values: rms_norm_eps='1e-6': must be a finite number; "
        "eos_token_id=[3, -1]: must be null or a token id (an int >= 0), or a list of them"
    )
    with pytest.raises(SystemExit) as exc:
        grpo.main(_grpo_args(tmp_path, bad))
    assert exc.value.code == 2
    assert want in _one_error_line(capsys.readouterr().err)
    assert serve_main(["--model", str(bad), "--port", str(free_port())]) == 2
    assert _one_error_line(capsys.readouterr().err).startswith(f"error: --model: {want}")
    assert export_main(["--model", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert want in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_serve_on_a_port_in_use_says_so_in_one_line_before_serving(ckpts, capsys):
    good, _, _ = ckpts
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert serve_main(["--model", str(good), "--port", str(port)]) == 3
    captured = capsys.readouterr()
    assert "serving" not in captured.out
    assert captured.err.startswith(f"error: --port={port}: 127.0.0.1:{port} is already in use")
    assert captured.err.count("\n") == 1 and "give a free --port" in captured.err


def test_serve_with_an_ep_size_that_does_not_split_the_experts_names_the_flag(ckpts, capsys):
    # the EP check names its GRPO config key (policy.generation.expert_parallel_size); serve's user
    # gave --expert-parallel-size
    good, _, _ = ckpts
    assert serve_main(["--model", str(good), "--port", str(free_port()), "--expert-parallel-size", "3"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --expert-parallel-size=3: ") and "policy.generation" not in line


def test_ctrl_c_while_serve_starts_exits_130_in_one_line_and_frees_the_port(ckpts, capsys, monkeypatch):
    # A Ctrl-C while the checkpoint loads (or EP workers start): one line, exit 130, no traceback,
    # nothing printed as served, and the bound port is released for the next start.
    from m3_rollout.server import cli

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    good, _, _ = ckpts
    port = free_port()
    monkeypatch.setattr(cli, "build_server", interrupted)
    assert serve_main(["--model", str(good), "--port", str(port)]) == 130
    captured = capsys.readouterr()
    assert "serving" not in captured.out
    assert captured.err == "interrupted: the server stopped (Ctrl-C) while starting; nothing was served\n"
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def test_export_to_a_path_that_is_a_file_is_a_bad_argument(ckpts, tmp_path, capsys):
    good, _, _ = ckpts
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert export_main(["--model", str(good), "--out", str(afile)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out={str(afile)!r}: a file, not a directory; give a new or existing directory\n"
    )
    assert afile.read_text() == "keep me"


def test_the_plot_hint_names_the_script_by_its_absolute_path_or_is_left_out(tmp_path):
    cmd = grpo.plot_command("ep/logs")
    assert cmd is not None
    script = cmd.split()[1]
    assert os.path.isabs(script) and os.path.isfile(script) and script.endswith("scripts/plot_metrics.py")
    assert cmd.endswith(" ep/logs -o grpo_curves.png")
    assert grpo.plot_command("ep/logs", script=tmp_path / "plot_metrics.py") is None  # installed without the repo


def test_serve_help_gives_port_and_max_num_seqs_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT TCP port to serve on (default 8000)" in text
    assert "--max-num-seqs MAX_NUM_SEQS most sequences the engine runs at once (default 256)" in text


def test_export_help_shows_plain_quotes_not_rst_literals(capsys):
    with pytest.raises(SystemExit):
        export_main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text
    assert "'--format transformers-text'" in text


# a malformed device string: cluster.device's verdict, and serve's (which also takes auto, and says so)
DEVICE_FORMS = "must be 'cpu', 'cuda' or 'cuda:N' (N = device index)"
SERVE_DEVICE_FORMS = (
    "must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N = device index); "
    "use --device=auto for CUDA when there is one, else cpu"
)


@pytest.mark.parametrize(
    "device, needle",
    [
        ("cuda", "this machine has 0 CUDA device(s) (torch.cuda.is_available() is False); use --device=cpu"),
        ("gpu", SERVE_DEVICE_FORMS),
    ],
)
def test_serve_device_that_this_machine_lacks_is_one_line_and_exit_2(capsys, device, needle):
    """--device cuda on a machine without CUDA was a 36-line traceback from the checkpoint load (exit 1)."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "builtin:tiny-random", "--device", device])
    assert e.value.code == 2
    assert f"error: --device={device}: {needle}" in capsys.readouterr().err


# (device, torch.cuda.is_available(), torch.cuda.device_count(), the problem; None = usable)
DEVICE_CASES = [
    ("cpu", False, 0, None),
    ("cuda", True, 1, None),
    ("cuda:1", True, 2, None),
    ("cuda", False, 0, "this machine has 0 CUDA device(s) (torch.cuda.is_available() is False); use KEY=cpu"),
    ("cuda:0", False, 3, "this machine has 0 CUDA device(s) (torch.cuda.is_available() is False); use KEY=cpu"),
    ("cuda:2", True, 2, "this machine has 2 CUDA device(s); use KEY=cpu or an index < 2"),
    ("cuda:1", True, 0, "this machine has 0 CUDA device(s); use KEY=cpu"),
    *[
        (bad, True, 8, DEVICE_FORMS)
        # cuda: was served as cuda:0 by --device, cuda:01 (torch refuses both) and cuda:\u0663 (an Arabic-Indic
        # 3, which \\d matched) were accepted as cluster.device
        for bad in (
            *("gpu", "cuda:x", "cuda:", "cuda:01", "cuda:-1", "cuda:\u0663", "CUDA", "cuda0", " cuda", "cuda:1 "),
            *("AUTO", "auto:0"),
        )
    ],
]


@pytest.mark.parametrize("device, available, count, problem", DEVICE_CASES)
def test_serve_device_flag_and_cluster_device_give_one_verdict(
    tmp_path, monkeypatch, capsys, device, available, count, problem
):
    """serve's --device and the GRPO job's cluster.device were two rules (cuda: passed one, cuda:01
    and a non-ASCII digit the other); both now ask m3_rollout.config.device_problem, and each keeps
    its own error style: argparse's exit 2 naming the flag, a ConfigError naming the key. For a
    malformed string the flag's error lists auto too (it had dropped it), with the fix --device=auto."""
    from m3_rollout.config import ConfigError, check_devices, load_config
    from m3_rollout.server.cli import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    argv = ["--model", "m", "--device", device]
    config = tmp_path / "device.yaml"  # a YAML string: a key=value override would read "cuda:" as a mapping
    config.write_text(f"defaults: {ROOT / 'configs/grpo_bf16_ep.yaml'}\ncluster:\n  device: {json.dumps(device)}\n")
    if problem is None:
        assert parse_args(argv).device == device
        check_devices(load_config(config), available, count)
        return
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    serve_problem = SERVE_DEVICE_FORMS if problem == DEVICE_FORMS else problem.replace("KEY", "--device")
    assert err == f"m3-rollout serve: error: --device={device}: {serve_problem}"
    with pytest.raises(ConfigError) as exc:
        check_devices(load_config(config), available, count)
    assert f"cluster.device={device!r}: {problem.replace('KEY', 'cluster.device')}" in [
        line.strip() for line in str(exc.value).splitlines()
    ]


def test_serve_device_auto_is_always_usable(monkeypatch):
    """auto is the flag's own (CUDA when present, else cpu); cluster.device has no auto."""
    from m3_rollout.config import ConfigError, load_config
    from m3_rollout.server.cli import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parse_args(["--model", "m"]).device == "auto"
    assert parse_args(["--model", "m", "--device", "auto"]).device == "auto"
    with pytest.raises(ConfigError, match=r"cluster.device='auto': must be 'cpu', 'cuda' or 'cuda:N'"):
        load_config("configs/grpo_bf16_ep.yaml", ["cluster.device=auto"])


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_serve_graceful_shutdown_timeout_must_be_finite_seconds(capsys, value):
    from m3_rollout.server.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", f"--graceful-shutdown-timeout={value}"])  # -1: not an option
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"m3-rollout serve: error: --graceful-shutdown-timeout={float(value)}: must be a finite number of seconds >= 0"
    )


def test_serve_graceful_shutdown_timeout_defaults_to_30_s_and_takes_0():
    from m3_rollout.server.cli import parse_args

    assert parse_args(["--model", "m"]).graceful_shutdown_timeout == 30.0
    assert parse_args(["--model", "m", "--graceful-shutdown-timeout", "0"]).graceful_shutdown_timeout == 0.0
    assert parse_args(["--model", "m", "--graceful-shutdown-timeout", "2.5"]).graceful_shutdown_timeout == 2.5
