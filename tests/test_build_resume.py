"""The builtin checkpoint build survives Ctrl-C and runs once per cache key.

A build stopped midway saves its warm-start progress (``<name>-<key>.partial``) and the next build
goes on from it to the same weights as a build never stopped; a second process that needs the
same checkpoint waits on the build lock and then uses the first one's build.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from durability import inode, record_fsyncs_and_renames  # tests/ on sys.path
from test_warm_start import _chat  # the tokenizer, task and environment of the warm-start tests

from m3_rollout.jobs import build_lock as build_lock_mod
from m3_rollout.jobs import builtin
from m3_rollout.model import M3ForCausalLM, load_checkpoint, tiny_config
from m3_trainers import warm_start as ws
from m3_trainers import warm_start_progress as ws_progress
from m3_trainers.warm_start_progress import MANIFEST, ProgressStore, saved_step

# ---------------------------------------------------------------------------------------------
# warm_start: resumed anywhere, the same model


# Held-out accuracy by step. The window search: below at 0 and 8, overshoot at 16 -> back to 8,
# interval 2; overshoot again at 10 -> back to 8 a second time (its optimizer state must be the
# snapshot's, not what the training after the first go-back made of it), interval 1; 9 is in the
# window [0.25, 0.45].
ACCURACY = {0: 0.0, 8: 0.1, 16: 0.9, 10: 0.9, 9: 0.3}
CFG = ws.WarmStartConfig(batch_size=2, max_steps=100, max_seconds=1e9, eval_every=8, warmup_steps=2)


class Interrupt:
    """Stands in for Ctrl-C: raises KeyboardInterrupt at the ``at``-th tick (an SFT step's progress
    call or the start of an evaluation); also tells the scripted evaluation its step."""

    def __init__(self, at: int | None):
        self.at, self.ticks, self.step = at, 0, 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == self.at:
            raise KeyboardInterrupt

    def progress(self, step, acc, loss) -> None:
        self.step = step
        if acc is None:
            self.tick()

    def evaluate(self, model) -> float:
        self.tick()
        return ACCURACY[self.step]


# Two layers (one dense, one sparse attention + MoE) at width 64: every kind of tensor, few FLOPs.
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "moe_layer_freq": [0, 1], "sparse_attention_freq": [0, 1],
         "sparse_disable_index_value": [0, 1], "max_position_embeddings": 256}  # fmt: skip


def _model(chat, seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    return M3ForCausalLM(tiny_config(vocab_size=len(chat.tokenizer), **SMALL)).float()


def _run(chat, task, env, directory, interrupt_at=None, save_every=3):
    """One warm start on ``directory``'s progress (resumed if there is some): (result, model) or
    None when interrupted."""
    store = ProgressStore(directory, {"key": "test"})
    resume = store.load()
    model = _model(chat, seed=1 if resume is not None else 0)  # a resume must not rely on the init
    it = Interrupt(interrupt_at)
    try:
        result = ws.warm_start(
            model, chat, task, env, it.evaluate, CFG, progress=it.progress, resume=resume,
            save=store.save, save_every=save_every,
        )  # fmt: skip
    except KeyboardInterrupt:
        return None
    store.remove()
    return result, model


def test_a_warm_start_resumed_after_an_interrupt_returns_the_same_model(tmp_path):
    chat, task, env = _chat()
    ref, ref_model = _run(chat, task, env, tmp_path / "ref")
    assert ref.in_window and (ref.steps, ref.accuracy) == (9, 0.3)
    assert ref.history == [(0, 0.0), (8, 0.1), (16, 0.9), (10, 0.9), (9, 0.3)]
    # Ticks: 1 = evaluation at 0; 2-9 = steps 1-8 (saves after 3 and 6); 10 = evaluation at 8;
    # 11-18 = steps 9-16; 19 = evaluation at 16 (back to 8); 20-21 = steps 9-10; 22 = evaluation at
    # 10 (back to 8 again); 23 = step 9; 24 = evaluation at 9. Ctrl-C before anything is saved, just
    # before and just after a save, in evaluations (the overshoot, the last one) and after each go-back.
    for at in (1, 4, 5, 10, 19, 21, 23, 24):
        d = tmp_path / f"at{at}"
        assert _run(chat, task, env, d, interrupt_at=at) is None, at
        kept = saved_step(d, {"key": "test"})
        again = _run(chat, task, env, d)
        assert again is not None, at
        result, model = again
        assert (result.steps, result.accuracy, result.history) == (ref.steps, ref.accuracy, ref.history), (at, kept)
        for name, t in ref_model.state_dict().items():
            assert torch.equal(t, model.state_dict()[name]), (at, kept, name)


def test_progress_saved_for_another_build_or_format_is_not_resumed_from(tmp_path):
    chat, task, env = _chat()
    d = tmp_path / "partial"
    assert _run(chat, task, env, d, interrupt_at=5) is None  # saved: step 0's evaluation and step 3
    assert saved_step(d, {"key": "test"}) == 3 and saved_step(d, {"key": "other"}) is None
    other = ProgressStore(d, {"key": "other"})
    assert other.load() is None and not d.exists()
    assert "was not used and is removed: it was saved for {'key': 'test'}" in other.discarded
    assert _run(chat, task, env, d, interrupt_at=5) is None
    manifest = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**manifest, "format": 0}))
    store = ProgressStore(d, {"key": "test"})
    assert store.load() is None and "progress format 0" in store.discarded and not d.exists()


def test_the_next_snapshot_id_is_derived_from_the_snapshots_and_not_saved(tmp_path):
    # next_snapshot_id was a field saved with every state; the latest snapshot taken is always best
    # or below, so it is max(best.id, below.id) + 1. Progress of format 1 (which held the field) is
    # discarded with the format line rather than failing to load.
    chat, task, env = _chat()
    d = tmp_path / "partial"
    store, seen = ProgressStore(d, {"key": "test"}), []

    def save(st):
        seen.append((st.step, st.best.id, st.below.id, st.next_snapshot_id))
        store.save(st)

    it = Interrupt(None)
    ws.warm_start(_model(chat, 0), chat, task, env, it.evaluate, CFG, progress=it.progress, save=save, save_every=3)
    # snapshot 0 at step 0; 1 at step 8 (best and below); the overshoots at 16 and 10 take none and
    # go back to 8; 2 at step 9, in the window (the best)
    assert seen == [
        (0, 0, 0, 1), (3, 0, 0, 1), (6, 0, 0, 1), (8, 1, 1, 2), (9, 1, 1, 2), (12, 1, 1, 2), (15, 1, 1, 2),
        (8, 1, 1, 2), (8, 1, 1, 2), (9, 2, 1, 3),
    ]  # fmt: skip
    assert "next_snapshot_id" not in {f.name for f in dataclasses.fields(ws.WarmStartState)}
    manifest = json.loads((d / MANIFEST).read_text())
    assert "next_snapshot_id" not in torch.load(d / manifest["state"], weights_only=True)
    (d / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    store = ProgressStore(d, {"key": "test"})
    assert store.load() is None and "progress format 1" in store.discarded and not d.exists()


def test_a_save_writes_the_weights_once_when_they_are_a_snapshots(tmp_path, monkeypatch):
    # A save right after an evaluation that took a snapshot wrote the model and the optimizer twice:
    # in the snapshot file and in the state file, which equalled it. Now the state file names the
    # snapshot ("live") where its model / optimizer / scheduler are the snapshot's to the bit: after
    # such an evaluation, and after going back to a snapshot (already on disk: nothing written).
    chat, task, env = _chat()
    d = tmp_path / "partial"
    store, written, per_save = ProgressStore(d, {"key": "test"}), [], []
    real_save = torch.save

    def counting_save(obj, f, *a, **k):
        written.append(int("model" in obj and bool(obj["model"])))  # a snapshot's or a state's weights
        real_save(obj, f, *a, **k)

    def save(st):
        written.clear()
        store.save(st)
        manifest = json.loads((d / MANIFEST).read_text())
        per_save.append((st.step, sum(written), manifest["live"]))

    monkeypatch.setattr(torch, "save", counting_save)
    it = Interrupt(None)
    ws.warm_start(_model(chat, 0), chat, task, env, it.evaluate, CFG, progress=it.progress, save=save, save_every=3)
    # evaluations at 0, 8, 9 take snapshots 0, 1, 2; the overshoots at 16 and 10 go back to 8
    assert per_save == [
        (0, 1, "snapshot-0.pt"), (3, 1, None), (6, 1, None), (8, 1, "snapshot-1.pt"), (9, 1, None),
        (12, 1, None), (15, 1, None), (8, 0, "snapshot-1.pt"), (8, 0, "snapshot-1.pt"), (9, 1, "snapshot-2.pt"),
    ]  # fmt: skip
    manifest = json.loads((d / MANIFEST).read_text())
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [MANIFEST, manifest["state"], "snapshot-1.pt", "snapshot-2.pt"]
    )
    assert not {"model", "optimizer", "scheduler"} & set(torch.load(d / manifest["state"], weights_only=True))
    # what a resume reads back: the snapshot's state dicts, as copies (the optimizer keeps the
    # tensors it is given, and training on would change the snapshot's moments)
    state = ProgressStore(d, {"key": "test"}).load()
    assert (state.step, state.best.id, state.below.id) == (9, 2, 1)
    for name in ("model", "optimizer", "scheduler"):
        assert ws_progress._identical(getattr(state, name), getattr(state.best, name)), name
    assert all(state.model[k] is not t for k, t in state.best.model.items())
    assert state.optimizer["state"][0]["exp_avg"] is not state.best.optimizer["state"][0]["exp_avg"]


def test_only_a_bitwise_equal_state_is_left_to_a_snapshot():
    # -0.0 is not 0.0, a tensor of another dtype with the same values is not the same, a changed
    # optimizer moment or scheduler value is not
    z = torch.zeros(2)
    assert ws_progress._identical({"a": [z, 1.0, (2, None)]}, {"a": [z.clone(), 1.0, (2, None)]})
    assert not ws_progress._identical(z, -z)
    assert not ws_progress._identical(z, z.double())
    assert not ws_progress._identical({"lr": 0.0}, {"lr": -0.0})
    assert not ws_progress._identical({"lr": 1}, {"lr": 1.0})
    assert not ws_progress._identical({"a": 1}, {"a": 1, "b": 2})


# ---------------------------------------------------------------------------------------------
# The build: Ctrl-C keeps the progress, the next run continues to the same checkpoint


def _tiny_build_spec() -> builtin.TinyCheckpointSpec:
    """The tiny-calculator build at test size: 6 SFT steps towards an unreachable window
    (evaluations at 0, 3, 6), progress saved every 2 steps."""
    return dataclasses.replace(
        builtin.TinyCheckpointSpec(),
        model_overrides={**SMALL, "sparse_local_block": 2},
        tokenizer_vocab_size=512,
        tokenizer_corpus=300,
        num_val=4,
        warm_start=ws.WarmStartConfig(batch_size=2, max_steps=6, eval_every=3, target_low=0.99, target_high=1.0),
        eval_max_new_tokens=8,
        save_progress_every=2,
    )  # fmt: skip


def _weights(model_dir: Path) -> dict:
    return load_checkpoint(model_dir, dtype=torch.float32).state_dict()


def test_ctrl_c_keeps_the_build_progress_and_the_next_run_continues_to_the_same_checkpoint(
    tmp_path, monkeypatch, capsys
):
    spec = _tiny_build_spec()
    monkeypatch.setattr(builtin, "builtin_spec", lambda name, device="cpu": spec)
    # The build never stopped, in its own cache.
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "ref"))
    ref_dir, ref = builtin.resolve_model("builtin:tiny-calculator", progress=False)
    assert ref["built"] and [s for s, _ in ref["history"]] == [0, 3, 6]

    # Ctrl-C in SFT step 5: steps 1-4 were trained, step 4's progress saved (every 2 steps).
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    real, calls = ws.token_logprobs, []

    def ctrl_c_in_step_5(*args, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(ws, "token_logprobs", ctrl_c_in_step_5)
    with pytest.raises(SystemExit) as exc:
        builtin.resolve_model("builtin:tiny-calculator", progress=False)
    assert exc.value.code == 130
    out_dir = tmp_path / "cache" / ref_dir.name
    partial = builtin.partial_dir(out_dir)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("interrupted:")]
    assert line == (
        "interrupted: the build of builtin:tiny-calculator stopped (Ctrl-C); its warm start up to SFT step 4 "
        f"(weights, optimizer, data position, evaluations) is kept in {partial}; rerunning continues the "
        "build from step 4"
    )
    assert not out_dir.exists() and json.loads((partial / MANIFEST).read_text())["step"] == 4

    monkeypatch.setattr(ws, "token_logprobs", real)
    path, info = builtin.resolve_model("builtin:tiny-calculator", progress=True)
    assert path == out_dir and info["built"] and info["resumed_at_step"] == 4
    captured = capsys.readouterr()
    assert (
        "warm start: resuming at step 4 from the progress an interrupted build saved in" in captured.out + captured.err
    )
    assert info["history"] == ref["history"] and info["warm_start_steps"] == ref["warm_start_steps"]
    want, got = _weights(ref_dir), _weights(path)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not partial.exists()  # a finished build removes its progress
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [out_dir.name, out_dir.name + ".lock"]


def test_the_finished_checkpoint_is_on_the_disk_before_its_progress_is_removed(tmp_path, monkeypatch):
    """The build renamed its checkpoint into place unsynced and then removed the warm-start
    progress: a power cut right then could lose both. Now every file of the checkpoint and its
    directory are fsynced before the rename, the parent directory after it, and only then is the
    progress removed."""
    spec = _tiny_build_spec()
    spec = dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, max_steps=2, eval_every=2))
    events = record_fsyncs_and_renames(monkeypatch)  # ("fsync", (device, inode)), ("rename", dst)
    real_save, real_remove = builtin.save_checkpoint, ws_progress.ProgressStore.remove

    def save(*args, **kw):
        events.append(("save", None))  # the checkpoint's writing begins: the progress saves are over
        return real_save(*args, **kw)

    def remove(store):
        events.append(("remove", (store.dir, (store.dir / MANIFEST).is_file())))
        real_remove(store)

    monkeypatch.setattr(builtin, "save_checkpoint", save)
    monkeypatch.setattr(ws_progress.ProgressStore, "remove", remove)
    out = tmp_path / "cache" / "tiny-calculator-test"
    partial = builtin.partial_dir(out)
    builtin.build_checkpoint(spec, out, progress=False)

    kinds = [e for e, _ in events]
    i_save, i_rename = kinds.index("save"), events.index(("rename", out))
    i_remove = events.index(("remove", (partial, True)))  # the progress was there until then
    assert i_save < i_rename < i_remove and kinds.count("remove") == 1 and not partial.exists()
    before = {what for e, what in events[i_save:i_rename] if e == "fsync"}
    files = sorted(out.iterdir())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "tokenizer.json", "build_report.json"}
    assert [p.name for p in files if inode(p) not in before] == []
    assert inode(out) in before  # its names
    assert ("fsync", inode(out.parent)) in events[i_rename:i_remove]  # the rename


# ---------------------------------------------------------------------------------------------
# Two processes, one build

HOLDER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from m3_rollout.jobs import builtin

    real = builtin.build_checkpoint

    def build(*args, **kw):
        # Inside the build lock: the holder acknowledges, then builds only once the test says so.
        if os.environ.get("HOLD"):
            Path(os.environ["ACK"]).write_text(str(os.getpid()))
            while not Path(os.environ["GO"]).exists():
                time.sleep(0.05)
        Path(os.environ["BUILT"]).write_text("")
        return real(*args, **kw)

    builtin.build_checkpoint = build
    path, info = builtin.resolve_model("builtin:tiny-random", progress=False)
    print(json.dumps({"path": str(path), "built": info["built"]}), flush=True)
    """
)


def _start(tmp_path, tag: str, **env) -> subprocess.Popen:
    full = {**os.environ, "M3_ROLLOUT_CACHE": str(tmp_path / "cache"), "GO": str(tmp_path / "go"),
            "ACK": str(tmp_path / f"ack_{tag}"), "BUILT": str(tmp_path / f"built_{tag}"), **env}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_ack(proc: subprocess.Popen, ack: Path) -> None:
    """Until ``proc`` wrote ``ack`` (it holds the build lock); fails if it ends first."""
    while not ack.exists():
        if proc.poll() is not None:
            pytest.fail(f"the first process ended before it acknowledged: {proc.communicate()[1][-3000:]}")
        try:
            proc.wait(0.05)
        except subprocess.TimeoutExpired:
            pass


def test_a_second_process_waits_for_the_first_ones_build_and_uses_it(tmp_path):
    first = _start(tmp_path, "first", HOLD="1")
    second = None
    try:
        _wait_for_ack(first, tmp_path / "ack_first")
        second = _start(tmp_path, "second")
        # Its acknowledgement: the waiting line (an old builder would build, print its result, end).
        lines = []
        for ln in second.stderr:
            lines.append(ln)
            if ln.startswith("waiting for"):
                break
        assert (
            lines and lines[-1] == f"waiting for another process building builtin:tiny-random (pid {first.pid})...\n"
        ), "".join(lines)[-3000:]
        (tmp_path / "go").write_text("")
        out1, err1 = first.communicate()
        out2, err2 = second.communicate()
    finally:
        (tmp_path / "go").write_text("")
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert first.returncode == 0 and second.returncode == 0, err1[-3000:] + err2[-3000:]
    r1, r2 = json.loads(out1.splitlines()[-1]), json.loads(out2.splitlines()[-1])
    assert r1["built"] and not r2["built"] and r1["path"] == r2["path"]
    assert (tmp_path / "built_first").exists() and not (tmp_path / "built_second").exists()


def test_the_lock_of_a_killed_builder_does_not_block(tmp_path, monkeypatch, capsys):
    first = _start(tmp_path, "first", HOLD="1")
    try:
        _wait_for_ack(first, tmp_path / "ack_first")
        lock = tmp_path / "cache" / f"tiny-random-{builtin.builtin_spec('tiny-random').key()}.lock"
        assert lock.read_text() == f"{first.pid}\n"  # it holds the lock
    finally:
        first.kill()  # SIGKILL: no cleanup runs; the file still names it
        first.wait()
    assert lock.read_text() == f"{first.pid}\n"
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    path, info = builtin.resolve_model("builtin:tiny-random", progress=False)
    assert info["built"] and (path / "build_report.json").is_file()
    assert "waiting for" not in capsys.readouterr().err
    assert lock.read_text() == ""  # released by this build


def test_ctrl_c_while_waiting_for_another_build_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    # Another process holds the lock (the non-blocking try fails); Ctrl-C arrives in the blocking wait.
    def flock(fd, op):
        if op & build_lock_mod.fcntl.LOCK_NB:
            os.pwrite(fd, b"4242\n", 0)
            raise BlockingIOError
        raise KeyboardInterrupt

    monkeypatch.setattr(build_lock_mod.fcntl, "flock", flock)
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        builtin.resolve_model("builtin:tiny-random", progress=False)
    assert exc.value.code == 130
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "waiting for another process building builtin:tiny-random (pid 4242)...",
        "interrupted: stopped waiting (Ctrl-C) for another process building builtin:tiny-random (pid 4242); "
        "this run built nothing of it, and that build goes on",
    ]
