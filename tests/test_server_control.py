"""The control plane's admission gate and pause modes (``m3_rollout/server/control.py``), driven
in process on one event loop so the order of control calls and waiting requests is exact: a
request held at the gate never starts while the server is paused, and a drain pause that a
/resume lifted stops waiting."""

import asyncio

from server_util import ScriptedBackend  # tests/ on sys.path

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.server.control import Controller
from m3_rollout.server.runner import EngineRunner

STOP = 9


def _run(body) -> object:
    """``body(ctl)`` on a fresh event loop over a scripted backend's runner."""
    runner = EngineRunner(ScriptedBackend([[7, 8, STOP]], STOP))
    try:
        return asyncio.run(body(Controller(runner)))
    finally:
        runner.shutdown()


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6], SamplingParams(max_new_tokens=3))


async def _until(predicate) -> None:
    """Yield to the loop until ``predicate()`` holds (an acknowledgement, not a timing)."""
    while not predicate():
        await asyncio.sleep(0)


def test_a_request_waiting_at_the_gate_does_not_start_when_a_pause_follows_a_resume_at_once():
    """Breaker finding: /resume then /pause before the held request ran (two control calls in one
    loop iteration): the request woke from the gate and ran while the server was paused."""

    async def body(ctl: Controller):
        await ctl.pause("abort")

        async def client():
            return [item async for item in ctl.stream(_request("held"), stream=False)]

        task = asyncio.ensure_future(client())
        await _until(lambda: ctl.waiting == 1)
        await ctl.resume()
        await ctl.pause("abort")  # before the held request ran
        for _ in range(20):  # let every ready callback run
            await asyncio.sleep(0)
        held = (ctl.waiting, dict(ctl.live), task.done())
        await ctl.resume()
        return held, await asyncio.wait_for(task, 60)

    held, outs = _run(body)
    assert held == (1, {}, False)  # still at the gate, not live
    assert [(o.output_ids, o.finish_reason) for o in outs if isinstance(o, SampleOutput)] == [([7, 8, STOP], "stop")]


def test_a_drain_pause_that_a_resume_lifted_returns_not_paused_instead_of_waiting_on():
    """Breaker finding: /pause mode=drain kept waiting for the running requests after a /resume
    had lifted it (with traffic it never returned), then answered paused=true on a server that
    was not paused."""

    async def body(ctl: Controller):
        stream = ctl.stream(_request("running"), stream=True)
        first = await stream.__anext__()  # live until its iteration ends: held open here
        draining = asyncio.ensure_future(ctl.pause("drain"))
        await _until(lambda: ctl.pause_mode == "drain")
        assert not draining.done() and dict(ctl.live) == {"running": 1}
        await ctl.resume()
        reply = await asyncio.wait_for(draining, 60)  # hung before
        rest = [item async for item in stream]
        return first, reply, rest, ctl.pause_mode

    first, reply, rest, mode = _run(body)
    assert reply == {"paused": False, "mode": "drain", "aborted": 0, "running": 1} and mode is None
    deltas = [first] + rest[:-1]  # a handler that fell behind gets merged deltas: their tokens in order
    assert [t for d in deltas for t in d.token_ids] == [7, 8, STOP] and rest[-1].finish_reason == "stop"
