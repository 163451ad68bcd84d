"""Server-wide default chat-template kwargs (``--default-chat-template-kwargs``).

The built-in checkpoints are trained on prompts rendered with ``thinking_mode: disabled``; the M3
template's own default is adaptive, a system prompt they never saw (a new user's first chat
request then came back garbled). The server applies a default under every request's
``chat_template_kwargs``: ``builtin:`` models get ``{"thinking_mode": "disabled"}`` unless the flag
says otherwise; a request that names a thinking mode (either key) still wins.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from server_util import MESSAGES, LiveServer, ScriptedBackend, served_model, tiny_tokenizer  # tests/ on sys.path

from m3_rollout.chat.template import ChatFormat
from m3_rollout.server.cli import default_template_kwargs
from m3_rollout.server.openai_api import chat_prompt
from m3_rollout.server.protocol import ChatCompletionRequest


def test_flag_parsing_and_the_builtin_default():
    assert default_template_kwargs(None, builtin=True) == {"thinking_mode": "disabled"}
    assert default_template_kwargs(None, builtin=False) == {}
    assert default_template_kwargs('{"thinking_mode": "enabled"}', builtin=True) == {"thinking_mode": "enabled"}
    assert default_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, match in (("{", "not JSON"), ("[1]", "JSON object"), ('{"thinking_mode": "sometimes"}', "thinking_mode")):
        with pytest.raises(ValueError, match=match) as err:
            default_template_kwargs(bad)
        assert "--default-chat-template-kwargs" in str(err.value)


def test_requests_render_with_the_default_unless_they_name_a_mode():
    tok = tiny_tokenizer()
    served = dataclasses.replace(
        served_model(tok, len(tok), 256), default_chat_template_kwargs={"thinking_mode": "disabled"}
    )
    plain = served_model(tok, len(tok), 256)

    def ids(srv, kwargs):
        req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, chat_template_kwargs=kwargs)
        return chat_prompt(srv, req).ids

    disabled = ChatFormat(tok, "disabled").prompt_ids(MESSAGES)
    enabled = ChatFormat(tok, "enabled").prompt_ids(MESSAGES)
    assert ids(served, None) == disabled != ids(plain, None)  # the template's own default differs
    assert ids(served, {"thinking_mode": "enabled"}) == enabled
    assert ids(served, {"enable_thinking": True}) == enabled  # the other key drops the default's too
    # and over HTTP, /tokenize renders the same way
    server = LiveServer(served, ScriptedBackend([[5]], stop_id=tok.convert_tokens_to_ids(tok.eos_token)))
    try:
        r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES})
        assert r.status_code == 200 and r.json()["tokens"] == disabled
    finally:
        server.stop()


def test_a_checkpoint_names_its_own_default(tmp_path):
    """A checkpoint's ``chat_template_kwargs.json`` (the builtin builds and the GRPO job's saved
    policies write it: the rendering they trained in) is the server's default when the flag is not
    given; the flag wins; a released checkpoint (no file) keeps the template's default; a broken
    file is an error naming it."""
    from m3_rollout.chat.template import CHAT_DEFAULTS_FILE, write_chat_defaults

    assert default_template_kwargs(None, model_dir=tmp_path) == {}
    write_chat_defaults(tmp_path, {"thinking_mode": "enabled"})
    assert default_template_kwargs(None, model_dir=tmp_path) == {"thinking_mode": "enabled"}
    assert default_template_kwargs(None, builtin=True, model_dir=tmp_path) == {"thinking_mode": "enabled"}
    flag = '{"thinking_mode": "disabled"}'
    assert default_template_kwargs(flag, model_dir=tmp_path) == {"thinking_mode": "disabled"}
    (tmp_path / CHAT_DEFAULTS_FILE).write_text('{"thinking_mode": "often"}')
    with pytest.raises(ValueError, match=CHAT_DEFAULTS_FILE):
        default_template_kwargs(None, model_dir=tmp_path)
    with pytest.raises(ValueError, match="thinking_mode"):
        write_chat_defaults(tmp_path, {"thinking_mode": "often"})


def test_the_grpo_jobs_checkpoint_carries_the_mode_it_trained_in(tmp_path):
    """CheckpointManager.save writes the run's chat-template kwargs next to the policy's weights."""
    import torch

    from m3_rollout.chat.template import read_chat_defaults
    from m3_rollout.model import M3ForCausalLM, tiny_config
    from m3_trainers.checkpoint import CheckpointManager

    class _Policy:  # what save reads: the model, optimizer and scheduler
        model = M3ForCausalLM(tiny_config())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    path = CheckpointManager(tmp_path / "ckpt").save(3, _Policy(), None, {}, {}, {"thinking_mode": "disabled"})
    assert read_chat_defaults(path / "policy") == {"thinking_mode": "disabled"}
