"""Stopping the server process (``python -m m3_rollout.serve``) with SIGTERM or SIGINT: it exited
143 printing nothing on SIGTERM (uvicorn raised the signal again after its shutdown, at Python's
default handler), and 0 printing nothing on a SIGINT ignored at start (a shell's ``&`` job). Now
each is a graceful shutdown: one line naming the signal, a stream in flight finishes, exit 0."""

import json
import signal

import httpx
import pytest
from server_util import save_tiny_checkpoint, start_server_process, tiny_model, tiny_tokenizer  # tests/ on sys.path

MAX_LEN = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = tiny_tokenizer()
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
    assert events[-1] == "[DONE]", events[-3:]
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes in (["length"], ["stop"]), events
    name = signal.Signals(sig).name + (" (Ctrl-C)" if sig == signal.SIGINT else "")
    line = f"m3-rollout server: {name} received, shutting down (requests in flight finish, then the engine stops)"
    assert proc.returncode == 0, out
    assert out.splitlines().count(line) == 1, out
