"""Stopping the server process (``python -m m3_rollout.serve``) with SIGTERM or SIGINT: it exited
143 printing nothing on SIGTERM (uvicorn raised the signal again after its shutdown, at Python's
default handler), and 0 printing nothing on a SIGINT ignored at start (a shell's ``&`` job). Now
each is a graceful shutdown: one line naming the signal, a stream in flight finishes, exit 0."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from server_util import (  # tests/ on sys.path
    ROOT,
    ScriptedBackend,
    free_port,
    save_tiny_checkpoint,
    served_model,
    start_server_process,
    tiny_model,
    tiny_tokenizer,
)

from m3_rollout.engine.interface import StreamDelta
from m3_rollout.server.app import build_app
from m3_rollout.server.cli import GracefulServer
from m3_rollout.server.runner import EngineRunner

MAX_LEN = 256


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), tok, tiny_model(len(tok), max_len=MAX_LEN))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig,ignored",
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT", "SIGINT-ignored-at-start"],
)
def test_a_stop_signal_shuts_down_gracefully_with_one_line_and_exit_0(checkpoint, sig, ignored):
    proc, url, client = start_server_process(
        checkpoint, ["--served-model-name", "tiny-m3"], 300, preexec_fn=_ignore_sigint if ignored else None
    )
    client.close()
    try:
        body = {"model": "tiny-m3", "prompt": "hello", "max_tokens": 48, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:  # the stream is under way: stop the server now
                    proc.send_signal(sig)
                events.append(line.removeprefix("data: "))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the stream in flight finished (a finish reason, then [DONE]) before the server exited
    finishes = _finish_reasons(events)
    assert finishes in (["length"], ["stop"]), events
    name = signal.Signals(sig).name + (" (Ctrl-C)" if sig == signal.SIGINT else "")
    line = f"m3-rollout server: {name} received, shutting down (requests in flight finish, then the engine stops)"
    assert proc.returncode == 0, out
    assert out.splitlines().count(line) == 1, out


def _finish_reasons(events: list[str]) -> list[str]:
    """The finish reasons of a completed stream's data events; the stream must end with [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    return [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]


def _stream_events(url: str, body: dict, events: list) -> None:
    """POST a streamed completion; its data events (text after ``data: ``) go to ``events``."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))


@contextlib.contextmanager
def _request_held_open(url: str, client):
    """A client that sent a request's headers and not its body (its wait never ends on its own),
    open for the ``with`` block; ``client`` has made a later request (so the first one was read)
    and is closed."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        _poll(lambda: client.health()["status"] == "ok", "answered")
        client.close()
        yield


def _poll(condition, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_stop_signal_ends_the_requests_a_pause_holds(checkpoint, tok, mode):
    """SIGTERM to a paused server hung it: the graceful shutdown waits for the requests in flight,
    and a request frozen by ``/pause`` mode keep, or held at the admission gate of a paused server,
    never finishes (only SIGKILL ended the process). Now the stop ends them as ``/abort`` does: the
    stream ends with finish reason abort and [DONE], the line says so, exit 0."""
    proc, url, client = start_server_process(checkpoint, ["--served-model-name", "tiny-m3"], 300)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    # greedy, the end-of-text token barred: the stream runs its max_tokens unless stopped
    body = {"model": "tiny-m3", "prompt": "hello", "max_tokens": 200, "temperature": 0, "stream": True}
    body["logit_bias"] = {str(eos): -100}
    events: list[str] = []
    streamer = threading.Thread(target=_stream_events, args=(url, body, events), daemon=True)
    try:
        if mode == "keep":  # a stream under way, then frozen
            streamer.start()
            _poll(lambda: events, "streamed")
            assert client.pause("keep")["running"] == 1
        else:  # paused first: the stream waits at the gate
            client.pause("abort")
            streamer.start()
            _poll(lambda: client.metrics()["m3:num_requests_waiting"] == 1, "held at the gate")
        assert client.health()["paused"] is True
        client.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)  # it hung here: stopped by the kill below
        streamer.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    finishes = _finish_reasons(events)
    assert finishes == ["abort"], events
    line = (
        "m3-rollout server: SIGTERM received, shutting down (requests in flight finish, then the engine stops); "
        "1 paused request(s) end with finish reason abort"
    )
    assert proc.returncode == 0, out
    assert out.splitlines().count(line) == 1, out


def test_a_second_ctrl_c_cuts_the_wait_short_and_still_stops_the_engine(checkpoint):
    """A second Ctrl-C while the shutdown waits for a request in flight is uvicorn's forced exit: it
    skipped the app's shutdown (the engine was never stopped, and the app's lifespan, cancelled as
    the event loop closed, logged a CancelledError traceback) and each request cut off logged one
    more. Now the forced exit still stops the engine, and says in one line how many requests it cut
    off: no traceback, exit 0. The request in flight is a client that sent a request's headers and
    not its body: the wait for it never ends on its own."""
    proc, url, client = start_server_process(checkpoint, ["--served-model-name", "tiny-m3"], 300)
    try:
        with _request_held_open(url, client):
            proc.send_signal(signal.SIGINT)
            lines = []
            while not any("received, shutting down" in x for x in lines):  # the first one was handled
                lines.append(proc.stdout.readline())
                assert lines[-1], "".join(lines)
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    first = (
        "m3-rollout server: SIGINT (Ctrl-C) received, shutting down (requests in flight finish, then the engine stops)"
    )
    assert proc.returncode == 0, out
    assert out.splitlines().count(first) == 1, out
    assert out.splitlines().count("m3-rollout server: second Ctrl-C, 1 request(s) in flight cut off") == 1, out
    assert "Traceback" not in out and "CancelledError" not in out, out


_ENGINE_STOPPED = "test: EngineRunner.shutdown returned"
_SAYS_ENGINE_STOPPED = f"""
from m3_rollout.server.runner import EngineRunner
_shutdown = EngineRunner.shutdown
def _says(self):
    _shutdown(self)
    print({_ENGINE_STOPPED!r}, flush=True)
EngineRunner.shutdown = _says
"""


def test_sigterm_does_not_wait_forever_for_a_client_that_holds_its_connection(checkpoint):
    """A client that sent a request's headers and never its body kept a SIGTERM's graceful shutdown
    waiting forever (uvicorn's ``timeout_graceful_shutdown`` was None): only SIGKILL ended the
    process, so the engine's stop never ran. Now ``--graceful-shutdown-timeout`` bounds the wait:
    the request is cut off, one more line says so, the engine stops, exit 0 as any graceful stop.
    (A client that sent only part of the headers has no request yet: uvicorn closes it as the
    shutdown begins, with or without the bound.)"""
    args = ["--served-model-name", "tiny-m3", "--graceful-shutdown-timeout", "1"]
    proc, url, client = start_server_process(checkpoint, args, 300, prelude=_SAYS_ENGINE_STOPPED)
    try:
        with _request_held_open(url, client):
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)  # it hung here (stopped by the kill below)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = "m3-rollout server: SIGTERM received, shutting down (requests in flight finish, then the engine stops)"
    cut = "m3-rollout server: --graceful-shutdown-timeout 1 s passed, 1 request(s) in flight cut off"
    assert proc.returncode == 0, out
    assert out.splitlines().count(first) == 1, out
    assert out.splitlines().count(cut) == 1, out
    assert out.splitlines().count(_ENGINE_STOPPED) == 1, out  # the app's shutdown ran
    assert "Traceback" not in out and "CancelledError" not in out and "ERROR" not in out, out


class _EndlessBackend(ScriptedBackend):
    """Streams token 10 until the request is cut off; ``shutdown`` (the engine's stop) says it began
    (``stopping``) and waits for ``release``."""

    def __init__(self, stop_id: int):
        super().__init__([[10]], stop_id)
        self.stopping, self.release = threading.Event(), threading.Event()

    async def stream(self, req):
        while True:
            await asyncio.sleep(0.01)
            yield StreamDelta(req.request_id, req.sample_index, [10], [-0.01], [5])

    def shutdown(self) -> None:
        self.stopping.set()
        assert self.release.wait(60)


def test_a_second_ctrl_c_after_the_timeout_cut_the_requests_counts_none_again(tok, capsys):
    """The timeout cut a stream off (one line counting it), then a second Ctrl-C came while the
    engine stopped (slow with EP workers, the moment a user presses it again): the line for the
    second Ctrl-C counted the same request, cut off already, once more. Now it says nothing: it
    cut nothing off, and the engine's stop goes on."""
    served = served_model(tok, len(tok), MAX_LEN)
    backend = _EndlessBackend(served.stop_token_ids[0])
    app = build_app(served, EngineRunner(backend))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=0.2)
    server = GracefulServer(config, app.state.controller.stop)
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    _poll(lambda: server.started, "started")
    events, client_error = [], []

    def client():
        body = {"model": "tiny-m3", "prompt": "hello", "max_tokens": 10_000, "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    events.append(line)
        except httpx.HTTPError as exc:
            client_error.append(exc)

    reader = threading.Thread(target=client, daemon=True)
    reader.start()
    _poll(lambda: events, "a first chunk")
    server.handle_exit(signal.SIGINT, None)
    assert backend.stopping.wait(60)  # the timeout passed, the request was cut, the engine stops
    server.handle_exit(signal.SIGINT, None)  # the second Ctrl-C, while it stops
    backend.release.set()
    thread.join(60)
    reader.join(60)
    assert not thread.is_alive() and server.force_exit
    assert client_error and "data: [DONE]" not in events  # the stream was cut short
    err = capsys.readouterr().err.splitlines()
    cut = "m3-rollout server: --graceful-shutdown-timeout 0.2 s passed, 1 request(s) in flight cut off"
    assert err.count(cut) == 1, err
    assert not [line for line in err if "second Ctrl-C" in line], err


def _session_processes(sid: int) -> list[str]:
    """``pid args`` of the processes left in session ``sid``."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(sid)], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_sigterm_while_starting_is_one_line_exit_143_and_stops_the_ep_workers(checkpoint):
    """SIGTERM while the server starts (here: its engine worker process loading the model) killed
    it at Python's default, printing nothing (status -15), and a worker left loading went on until it
    found the driver gone. Now it is a stop as a Ctrl-C then is: one line naming SIGTERM, exit 143,
    the workers ended with it (none left in the process's session)."""
    code = (
        "import os, signal, sys\n"
        "from m3_rollout.service import launchers\n"
        "collect = launchers.ProcessLauncher._collect\n"
        "def _collect(self, method, timeout_s):\n"
        "    if method == 'start':  # the workers are loading the model\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return collect(self, method, timeout_s)\n"
        "launchers.ProcessLauncher._collect = _collect\n"
        "from m3_rollout.serve import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["--model", str(checkpoint), "--port", str(free_port()), "--engine-process"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
        _poll(lambda: not _session_processes(proc.pid), "without its workers")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for left in _session_processes(proc.pid):
            os.kill(int(left.split()[0]), signal.SIGKILL)
    assert proc.returncode == 143, out
    assert "interrupted: the server stopped (SIGTERM) while starting; nothing was served" in out.splitlines(), out
    assert "Traceback" not in out and "serving" not in out, out
