"""Chatting on the teaching pool with the real default model (issue 25, defect 1).

`kvscope --teach` has max_model_len 256. A chat question is sized against it with the engine's own count of
the templated prompt; len() of what transformers 5's apply_chat_template returns (a BatchEncoding: 2 keys)
made every question "exceed max_model_len" by the template's 35 tokens.
"""

from __future__ import annotations

import pytest
from app_harness import FixedSampler, type_chat, until

from kvscope.app import cli
from kvscope.app.app import KVScopeApp
from kvscope.app.worker.factory import build_engine

pytestmark = pytest.mark.anyio

QUESTION = "What is a KV cache?"


async def test_a_question_on_the_teaching_pool_is_answered_by_the_real_model():
    engines = []

    def factory(config, previous=None):
        engines.append(build_engine(config, previous))
        return engines[-1]

    config = cli.engine_config(cli.parse_args(["--teach"]))
    assert config.max_model_len == 256
    app = KVScopeApp(config, log_enabled=False, engine_factory=factory, system_sampler=FixedSampler())
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.main.engine_info is not None, timeout=300)
        chat = app.main.chat
        # SmolLM2's generation_config asks for no sampling: the app chats greedily, as `kvscope chat` and vLLM do.
        assert chat.border_subtitle == "greedy · generation_config"
        await type_chat(pilot, QUESTION)
        # The first words streamed are enough to know it was accepted; the whole reply would take minutes here.
        await until(pilot, lambda: len(chat._reply.split()) >= 2 or chat.current_request is None, timeout=300)
        bubble = " ".join(str(chat.query(".bubble.assistant").last().render()).split())
        assert "⚠" not in bubble and "exceeds" not in bubble, bubble    # answered, not refused
        request = engines[-1].scheduler.requests[chat.current_request]
        prompt = engines[-1].prompt_token_ids([{"role": "user", "content": QUESTION}])
        assert list(request.prompt_token_ids) == prompt and len(prompt) == 37
        assert request.params.max_tokens == 256 - 37    # all the room max_model_len leaves
        await pilot.press("ctrl+g")         # stop the reply (Esc only leaves the input)
        await until(pilot, lambda: chat.current_request is None)
