"""LLMEngine: the public API. Requests in, one scheduler iteration plus one forward per step, results out."""

from __future__ import annotations

import itertools
import time
import warnings

from kvscope.engine.config import EngineConfig, RequestError, SamplingParams
from kvscope.engine.outputs import (
    CacheSnapshot,
    EngineEvent,
    RequestOutput,
    RequestView,
    SampleOutput,
    StepResult,
    StepStats,
)
from kvscope.engine.request import Request, RequestStatus, Sequence
from kvscope.engine.scheduler import Scheduler

_PREVIEW_CHARS = 80
_RUNNER_FAILED = "the model runner produced no token for this request (non-finite logits?)"


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, runner=None) -> None:
        self.config = config
        if runner is None:
            from kvscope.engine.model_runner import ModelRunner  # torch and transformers load only when needed
            runner = ModelRunner(config, model=model, tokenizer=tokenizer)
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else getattr(runner, "tokenizer", None)
        self.banner: str = runner.banner
        self.block_size: int = runner.block_size
        self.max_model_len: int = runner.max_model_len
        self.scheduler = Scheduler(config, num_blocks=runner.num_device_blocks,
                                   num_host_blocks=runner.num_host_blocks, block_size=runner.block_size,
                                   max_model_len=runner.max_model_len)
        self._eos_token_ids = runner.eos_token_ids
        self.step_counter = 0
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []    # aborts between steps, reported by the next step
        self._now = 0.0
        # Told of every accepted request and every step, e.g. a run log (app.runlog.record_run). Anything
        # with request_added(request_id, prompt_text, num_prompt_tokens, n) and step(result) methods.
        self.observers: list = []

    @property
    def num_blocks(self) -> int:
        return self.runner.num_device_blocks

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt: str, token ids or chat messages. RequestError if refused; then nothing changed."""
        params = params if params is not None else SamplingParams()
        params.validate()
        if request_id is None:
            request_id = self._new_request_id()
        elif request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids, preview = self._tokenize(prompt)
        self._check_fits(len(token_ids), params)
        stop_token_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self._eos_token_ids)
        request = Request(request_id, token_ids, params, next(self._arrivals), time.time(),
                          tokenizer=self.tokenizer, prompt_preview=preview, stop_token_ids=stop_token_ids,
                          max_num_tokens=min(len(token_ids) + params.max_tokens, self.max_model_len))
        self.scheduler.add(request)
        if self.observers:
            text = self._prompt_text(prompt, token_ids)
            self._notify("request_added", request_id, text, len(token_ids), params.n)
        return request_id

    def _prompt_text(self, prompt, token_ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], dict):
            return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else f"<{len(token_ids)} token ids>"

    def _notify(self, method: str, *args) -> None:
        """Call every observer; one that raises is dropped with a warning, and the engine goes on."""
        for observer in list(self.observers):
            try:
                getattr(observer, method)(*args)
            except Exception as exc:
                self.observers.remove(observer)
                warnings.warn(f"kvscope: removed the engine observer {observer!r}: its {method}() raised {exc!r}",
                              RuntimeWarning, stacklevel=3)

    def _new_request_id(self) -> str:
        while True:
            request_id = str(next(self._request_ids))
            if request_id not in self.scheduler.requests:
                return request_id

    def _tokenize(self, prompt) -> tuple[list[int], str]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            token_ids = list(self._need_tokenizer("a text prompt").encode(prompt))
            preview = prompt
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            token_ids = self._apply_chat_template(list(prompt))
            preview = str(prompt[-1].get("content", ""))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = [int(t) for t in prompt]
            preview = self.tokenizer.decode(token_ids[:_PREVIEW_CHARS]) if self.tokenizer is not None else ""
        else:
            raise RequestError("prompt must be a string, a list of token ids or a list of chat messages")
        if not token_ids:
            raise RequestError("prompt is empty")
        vocab_size = self.runner.vocab_size
        if any(t < 0 or t >= vocab_size for t in token_ids):
            raise RequestError(f"prompt token ids must be in [0, vocab_size={vocab_size})")
        return token_ids, " ".join(preview.split())[:_PREVIEW_CHARS]

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        if any("role" not in m or "content" not in m for m in messages):
            raise RequestError("each chat message needs a 'role' and a 'content'")
        tokenizer = self._need_tokenizer("chat messages")
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(encoded, "keys"):    # transformers 5 returns a BatchEncoding by default
            encoded = encoded["input_ids"]
        return list(encoded)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise RequestError(f"{what} needs a tokenizer; pass token ids instead")
        return self.tokenizer

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                               f"{total} exceeds max_model_len ({self.max_model_len})")
        needed = self.scheduler.kv.max_blocks_needed(num_prompt_tokens, params.max_tokens, params.n)
        if needed > self.num_blocks:
            raise RequestError(f"request could never fit in the KV cache: it may need {needed} blocks "
                               f"(n={params.n}, {total} tokens, block_size={self.block_size}) but "
                               f"num_blocks is {self.num_blocks}")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if it is unknown or already finished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        blocks = tuple(b for seq in request.seqs for b in seq.block_table)
        self._end_request(request, "abort", time.time())
        self.scheduler.events.append(EngineEvent("abort", request_id, blocks))
        self._pending_outputs.append(self._make_output(request, ()))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def generate(self, prompts,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion; final outputs in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        request_ids: list[str] = []
        try:
            for prompt, sampling in zip(prompts, params, strict=True):
                request_ids.append(self.add_request(prompt, sampling))
        except RequestError:
            for request_id in request_ids:
                self.abort_request(request_id)
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in request_ids]
            raise
        wanted = set(request_ids)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            if not self.has_unfinished_requests() and not self._pending_outputs:
                raise RuntimeError("engine went idle before every generate() request finished")
            for output in self.step().outputs:
                if output.finished and output.request_id in wanted:
                    final[output.request_id] = output
        return [final[request_id] for request_id in request_ids]

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> StepResult:
        start = time.perf_counter()
        self.step_counter += 1
        batch, scheduled = self.scheduler.schedule()
        forward_start = time.perf_counter()
        if batch.items or batch.blocks_to_swap_out or batch.blocks_to_swap_in or batch.blocks_to_copy:
            results = self.runner.execute(batch)
        else:
            results = []
        forward_duration = time.perf_counter() - forward_start
        self._now = time.time()
        outputs = self._pending_outputs
        self._pending_outputs = []
        num_generated = self._process_results(scheduled, batch.items, results, outputs)
        events = tuple(self.scheduler.events)
        self.scheduler.events.clear()
        snapshot = self._snapshot()
        duration = time.perf_counter() - start
        stats = self._stats(batch, duration, forward_duration, num_generated)
        result = StepResult(outputs=outputs, stats=stats, snapshot=snapshot, events=events)
        if self.observers:
            self._notify("step", result)
        return result

    def _process_results(self, scheduled, items, results, outputs: list[RequestOutput]) -> int:
        """Commit computed tokens, append sampled ones, apply stop rules; returns tokens generated."""
        failed = self._fail_requests(scheduled, results, outputs) if None in results else ()
        commit = self.scheduler.kv.commit
        now = self._now
        grouped: dict[Request, int | None] = {}   # n > 1 requests that sampled, with sample 0's token
        num_generated = 0
        for (request, seq, num_new), item, sampled in zip(scheduled, items, results, strict=True):
            if failed and request in failed:
                continue
            commit(seq, num_new)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            sample_indices = item.sample_indices
            if not sample_indices:
                continue    # mid-prefill
            num_generated += len(sampled)
            if len(request.seqs) == 1:
                token = sampled[0]
                self._append_token(request, seq, token)
                outputs.append(self._make_output(request, (token,)))
                continue
            if not request.forked:
                self._fork(request)
            grouped.setdefault(request, None)
            for sample_index, token in zip(sample_indices, sampled, strict=True):
                self._append_token(request, request.seqs[sample_index], token)
                if sample_index == 0:
                    grouped[request] = token
        for request, token in grouped.items():
            outputs.append(self._make_output(request, () if token is None else (token,)))
        return num_generated

    def _fail_requests(self, scheduled, results, outputs: list[RequestOutput]) -> set[Request]:
        """Requests the runner returned None for finish with an error; the rest of the batch goes on."""
        failed = {request for (request, _, _), sampled in zip(scheduled, results, strict=True)
                  if sampled is None}
        for request in failed:
            request.error = _RUNNER_FAILED
            blocks = tuple(b for seq in request.seqs for b in seq.block_table)
            self.scheduler.events.append(EngineEvent("error", request.request_id, blocks, _RUNNER_FAILED))
            self._end_request(request, "error", self._now)
            outputs.append(self._make_output(request, ()))
        return failed

    def _fork(self, request: Request) -> None:
        parent = request.seqs[0]
        for child in request.seqs[1:]:
            self.scheduler.kv.fork(parent, child)
        request.forked = True

    def _append_token(self, request: Request, seq: Sequence, token: int) -> None:
        token_ids = seq.token_ids
        token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = self._now
        detokenizer = seq.detokenizer
        by_stop_string = detokenizer is not None and detokenizer.add_token(token)
        if by_stop_string or token in request.stop_token_ids:
            reason = "stop"
        elif len(token_ids) >= request.max_num_tokens:
            reason = "length"
        else:
            return
        blocks = tuple(seq.block_table)
        self._finish_sample(seq, reason, by_stop_string)
        if all(s.finish_reason is not None for s in request.seqs):
            request.finished_time = self._now
            self.scheduler.finish(request)
            self.scheduler.events.append(EngineEvent("finish", request.request_id, blocks, reason))

    def _finish_sample(self, seq: Sequence, reason: str, by_stop_string: bool = False) -> None:
        seq.finish_reason = reason
        if seq.detokenizer is not None:
            seq.detokenizer.finish(by_stop_string)
        self.scheduler.kv.free_sequence(seq)

    def _end_request(self, request: Request, reason: str, now: float) -> None:
        for seq in request.seqs:
            if seq.finish_reason is None:
                self._finish_sample(seq, reason)
        request.finished_time = now
        self.scheduler.finish(request)

    # ---- results --------------------------------------------------------------------------------

    def _make_output(self, request: Request, new_token_ids: tuple[int, ...]) -> RequestOutput:
        seqs = request.seqs
        samples = (_sample_output(seqs[0]),) if len(seqs) == 1 else tuple(_sample_output(s) for s in seqs)
        first = samples[0]
        detokenizer = seqs[0].detokenizer
        # Positional: this runs for every request every step, and keywords cost a third more.
        return RequestOutput(
            request.request_id, request.prompt_token_ids, new_token_ids,
            detokenizer.take_delta() if detokenizer else "", first.token_ids, first.text,
            request.status == RequestStatus.FINISHED, first.finish_reason, request.num_cached_tokens,
            request.num_preemptions, request.metrics(), samples, request.error)

    def _snapshot(self) -> CacheSnapshot:
        scheduler = self.scheduler
        pool, host = scheduler.kv.block_pool, scheduler.kv.host_pool
        queues = (scheduler.running, scheduler.swapped, scheduler.waiting)
        views = [self._view(request) for queue in queues for request in queue]
        return CacheSnapshot(step=self.step_counter, block_size=self.block_size, num_blocks=pool.num_blocks,
                             allocator=self.config.allocator, block_state=pool.state.copy(),
                             ref_counts=pool.ref_counts.copy(), block_fill=pool.fill.copy(),
                             block_hashes=pool.hashes.copy(), requests=tuple(views),
                             num_host_blocks=host.num_blocks, num_free_host_blocks=host.num_free_blocks)

    def _view(self, request: Request) -> RequestView:
        """The request as the block map sees it; rebuilt only when the scheduler touched the request."""
        view = request.view
        if view is not None:
            return view
        first = request.seqs[0]
        if len(request.seqs) == 1:
            block_tables = (first.table_tuple(),)
            host_block_tables = (tuple(first.host_block_table),) if first.host_block_table else ()
            reserved = len(first.block_table) * self.block_size
            used = first.num_computed_tokens if first.block_table else 0
        else:
            live = request.live_seqs()
            block_tables = tuple(seq.table_tuple() for seq in live)
            host_block_tables = tuple(tuple(seq.host_block_table) for seq in live if seq.host_block_table)
            reserved, used = self._shared_slots(live)
        view = request.view = RequestView(    # positional, as in _make_output
            request.request_id, request.status, request.arrival_index, block_tables, host_block_tables,
            first.num_prompt_tokens, len(first.token_ids) - first.num_prompt_tokens, request.params.max_tokens,
            first.num_computed_tokens, request.num_cached_tokens, request.num_preemptions, request.params.n,
            reserved, used, request.prompt_preview)
        return view

    def _shared_slots(self, live: list[Sequence]) -> tuple[int, int]:
        """(slots held in device blocks, slots holding computed tokens), counting shared blocks once."""
        blocks = list({b for seq in live for b in seq.block_table})
        fill = self.scheduler.kv.block_pool.fill
        return len(blocks) * self.block_size, int(fill[blocks].sum()) if blocks else 0

    def _stats(self, batch, duration: float, forward_duration: float, num_generated: int) -> StepStats:
        scheduler = self.scheduler
        kv = scheduler.kv
        pool, host = kv.block_pool, kv.host_pool
        used = pool.num_used_blocks
        slots = used * self.block_size
        return StepStats(
            step=self.step_counter, time=self._now, duration=duration,
            num_prefill_tokens=batch.num_prefill_tokens, num_decode_tokens=batch.num_decode_tokens,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped), num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks, num_total_blocks=pool.num_blocks,
            kv_usage=used / pool.num_blocks,
            kv_token_utilisation=kv.num_tokens_held() / slots if slots else 0.0,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions, num_swapped_out_blocks=kv.num_swapped_out_blocks,
            num_swapped_in_blocks=kv.num_swapped_in_blocks,
            prompt_tokens_per_s=batch.num_prefill_tokens / duration if duration > 0 else 0.0,
            generation_tokens_per_s=num_generated / duration if duration > 0 else 0.0,
            forward_duration=forward_duration, num_host_blocks=host.num_blocks,
            num_free_host_blocks=host.num_free_blocks)


def _sample_output(seq: Sequence) -> SampleOutput:
    detokenizer = seq.detokenizer
    return SampleOutput(seq.index, tuple(seq.token_ids[seq.num_prompt_tokens:]),
                        detokenizer.output_text if detokenizer else "", seq.finish_reason)

