"""/v1/completions: text (or token-id) prompts, several in one request if asked, the reply as text.

A reply without max_tokens is 16 tokens long, OpenAI's and vLLM's default for this endpoint. ``echo`` puts the
prompt before the reply, and with ``logprobs`` the prompt's own log-probabilities before the reply's (the first
prompt token has none), as vLLM does: that is how lm-evaluation-harness scores a continuation.
"""

from __future__ import annotations

from typing import Literal

from kvscope.app.serve import protocol
from kvscope.app.serve.generation import EngineFacts, Job, StreamDelta
from kvscope.app.serve.logprobs import CompletionLogprobs, PromptLogprob, completion_logprobs, prompt_logprobs
from kvscope.engine.outputs import RequestOutput, SampleOutput

DEFAULT_MAX_TOKENS = 16


class CompletionChoice(protocol.Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None   # vLLM's


class Completion(protocol.Envelope):
    """The whole body, and each streamed chunk (whose usage is null unless it is the usage chunk)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionJob(Job):
    prompt_field = "prompt"
    id_prefix = "cmpl"
    response_type = Completion
    chunk_type = Completion
    request: protocol.CompletionRequest

    def make_prompts(self, facts: EngineFacts) -> list:
        return self.request.prompts()

    def max_tokens(self) -> int | None:
        asked = self.request.max_tokens
        return asked if asked is not None else DEFAULT_MAX_TOKENS

    def choice(self, index: int, sample: SampleOutput, output: RequestOutput) -> CompletionChoice:
        echo = self._echo(index, output)
        logprobs = None
        if sample.logprobs is not None:
            logprobs = completion_logprobs(sample.logprobs, sample.token_ids, self.token_text, 0)
            if self.request.echo:
                logprobs = self._with_prompt(output, logprobs)
        return CompletionChoice(index=index, text=echo + sample.text, finish_reason=sample.finish_reason,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs(output.prompt_logprobs,
                                                                                   self.token_text))

    def delta_choices(self, index: int, output: RequestOutput, new: StreamDelta) -> list[CompletionChoice]:
        if new.text is None and not (new.first and self.request.echo):
            return []
        echo = self._echo(index, output) if new.first else ""
        logprobs = None
        if self.request.logprobs is not None:
            token_ids = [entry.token_id for entry in new.logprobs]
            logprobs = completion_logprobs(new.logprobs, token_ids, self.token_text, 0)
            if echo:
                logprobs = self._with_prompt(output, logprobs)
        return [CompletionChoice(index=index, text=echo + (new.text or ""), finish_reason=new.finish_reason,
                                 logprobs=logprobs)]

    def _echo(self, index: int, output: RequestOutput) -> str:
        """The prompt as the reply repeats it: the text sent, or the token ids' decoding."""
        if not self.request.echo:
            return ""
        prompt = self.prompts[index // self.n]
        return prompt if isinstance(prompt, str) else self.token_text.decode(list(output.prompt_token_ids))

    def _with_prompt(self, output: RequestOutput, reply: CompletionLogprobs) -> CompletionLogprobs:
        prompt = completion_logprobs(output.prompt_logprobs or [None] * len(output.prompt_token_ids),
                                     output.prompt_token_ids, self.token_text, 0)
        shift = sum(len(token) for token in prompt.tokens)
        return CompletionLogprobs(text_offset=prompt.text_offset + [offset + shift for offset in reply.text_offset],
                                  token_logprobs=prompt.token_logprobs + reply.token_logprobs,
                                  tokens=prompt.tokens + reply.tokens,
                                  top_logprobs=prompt.top_logprobs + reply.top_logprobs)
