"""LLMEngine: the public API. Requests in, one scheduler iteration plus one forward per step, results out.

A step is four calls: Scheduler.schedule() decides the batch, the runner's execute() computes it,
Scheduler.update_from_output() records the result and returns the requests' outputs, and the engine
adds the stats and a snapshot. The engine itself holds no request or block state.

Threads: add_request and abort_request may be called from any thread while another thread steps. One
lock covers a step and each of those calls, so a call made during a step waits for it (at most one
step) and then sees the engine between steps, as a single-threaded caller would. step() itself, and
generate(), belong to one thread: each step's outputs go to whoever called it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Callable

from kvscope.engine.config import EngineConfig, RequestError, SamplingParams, _checked
from kvscope.engine.observer import EngineObserver
from kvscope.engine.outputs import CacheSnapshot, RequestOutput, StepResult
from kvscope.engine.prompt import PromptTokenizer, TokenizedPrompt
from kvscope.engine.request import Request
from kvscope.engine.request_knobs import bad_word_token_ids, check_vocabulary
from kvscope.engine.runner import Runner, RunnerInfo, RunnerOutput, SampledWithLogprobs
from kvscope.engine.scheduler import Scheduler
from kvscope.engine.snapshot import PhaseTimes, build_snapshot, build_stats

_PREVIEW_CHARS = 80

# A server stamps arrivals on one thread and the engine reads the clock on another: time.time() may step back a
# little between the two (a VM's clock being set), which must not refuse the request.
CLOCK_SKEW_S = 1.0


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None, runner: Runner | None = None) -> None:
        self.config = config
        if runner is None:
            from kvscope.engine.model.model_runner import ModelRunner  # torch and transformers load only when needed
            runner = ModelRunner.built_apart(config, model=model, tokenizer=tokenizer)
        self.runner = runner
        self.info: RunnerInfo = runner.info
        self.tokenizer = tokenizer if tokenizer is not None else runner.tokenizer
        info = self.info
        self.prompts = PromptTokenizer(self.tokenizer, info.vocab_size, info.max_model_len)
        self.scheduler = Scheduler(config, num_blocks=info.num_device_blocks, num_host_blocks=info.num_host_blocks,
                                   block_size=info.block_size, max_model_len=info.max_model_len,
                                   kv_cache_groups=info.kv_cache_groups)
        self.step_counter = 0
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        # Final outputs made between steps (aborts) or by a failed step, reported by the next step. A request id
        # stays in use until its final output has been returned.
        self._pending: dict[str, RequestOutput] = {}
        self._lock = threading.RLock()
        self._stepping = False
        # Told of every accepted request and every step, e.g. a run log (app.runlog.record_run).
        self.observers: list[EngineObserver] = []

    # The runner decides these (RunnerInfo); the engine only reads them out, so they cannot disagree.
    banner = property(lambda self: self.info.banner)
    block_size = property(lambda self: self.info.block_size)
    max_model_len = property(lambda self: self.info.max_model_len)
    num_blocks = property(lambda self: self.info.num_device_blocks)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a prompt: str, token ids, chat messages, or a TokenizedPrompt from ``tokenize`` (taken as is).
        RequestError if refused; then nothing changed.

        ``arrival_time`` (time.time()): when the request reached whoever hands it on, as vLLM's add_request takes
        it; a server that queues requests for the engine's thread passes the moment it got them, so that the
        wait for the step in progress counts in the request's queue time and time to first token. Default: now.

        The engine keeps a checked copy of ``params``: changing the object afterwards changes nothing.
        ``max_tokens=None`` becomes what is left after the prompt (``reply_room``).
        """
        if not isinstance(prompt, TokenizedPrompt):
            prompt = self.tokenize(prompt)     # before the lock: a long prompt does not hold up the steps
        with self._lock:
            request = self._make_request(prompt, params, request_id, arrival_time)
            self.scheduler.add(request)
            if self.observers:
                request_id, n, num_tokens = request.request_id, request.params.n, len(prompt.token_ids)
                self._notify(lambda observer: observer.request_added(request_id, prompt.text, num_tokens, n))
        return request.request_id

    def tokenize(self, prompt) -> TokenizedPrompt:
        """The prompt as ``add_request`` takes it (the chat template applied to messages), changing nothing;
        RequestError if it is malformed or too long to fit even before counting its tokens. Safe from any
        thread while another steps: a server tokenizes here, off its engine thread."""
        return self.prompts.tokenize(prompt)

    def prompt_token_ids(self, prompt) -> list[int]:
        """The token ids ``add_request`` would give ``prompt``, without adding it. RequestError as there."""
        return list(self.tokenize(prompt).token_ids)

    def max_request_tokens(self, n: int = 1) -> int:
        """The longest prompt plus reply one request of ``n`` samples may have here (max_model_len and the
        pool, the contiguous allocator's reservation included); 0 when none fits."""
        return self.scheduler.max_request_tokens(n)

    def reply_room(self, num_prompt_tokens: int, n: int = 1) -> int:
        """The longest reply that fits after a prompt of ``num_prompt_tokens``: what ``max_tokens=None`` means."""
        return self.max_request_tokens(n) - num_prompt_tokens

    def add_observer(self, observer: EngineObserver) -> Callable[[], None]:
        """Tell ``observer`` of every accepted request and every step; returns the call that stops it (safe to
        call twice, or after the engine dropped an observer that raised)."""
        with self._lock:
            self.observers.append(observer)

        def detach() -> None:
            with self._lock:
                if observer in self.observers:
                    self.observers.remove(observer)
        return detach

    def _make_request(self, prompt: TokenizedPrompt, params: SamplingParams | None, request_id: str | None,
                      arrival_time: float | None = None) -> Request:
        """Check everything about a new request, changing nothing; the Request if it is acceptable."""
        now = time.time()
        arrival_time = _checked("arrival_time", arrival_time, float | None, RequestError)
        if arrival_time is not None and not 0 < arrival_time <= now + CLOCK_SKEW_S:
            raise RequestError(f"arrival_time must be a time.time() no later than now, got {arrival_time!r}",
                               "arrival_time")
        if request_id is not None:
            self._check_request_id(request_id)
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params.normalized()
        token_ids = list(prompt.token_ids)
        if params.max_tokens is None:
            params = self._resolve_max_tokens(len(token_ids), params)
        self._check_fits(len(token_ids), params)
        stop_token_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else self.info.eos_token_ids)
        knobs = {}
        if params.reads_more_than_logits:
            check_vocabulary(params, self.info.vocab_size)
            knobs = {"bad_words": bad_word_token_ids(self.tokenizer, params.bad_words),
                     "grammar": self._grammar(params)}
        return Request(request_id if request_id is not None else self._new_request_id(), token_ids, params,
                       next(self._arrivals), min(arrival_time or now, now), tokenizer=self.tokenizer,
                       prompt_preview=prompt.preview,
                       stop_token_ids=stop_token_ids,
                       max_num_tokens=min(len(token_ids) + params.max_tokens, self.max_model_len), **knobs)

    def _grammar(self, params: SamplingParams):
        """The compiled grammar of a constrained request (engine/structured.py), or None."""
        if params.structured_output is None:
            return None
        from kvscope.engine import structured  # the grammar engine loads only when a request needs it
        return structured.compile_grammar(self.tokenizer, self.info.vocab_size, params.structured_output)

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        room = self.reply_room(num_prompt_tokens, params.n)
        if room < 1:
            raise RequestError(f"the prompt is {num_prompt_tokens} tokens, which leaves no room for a reply "
                               f"(max_model_len {self.max_model_len}, {self.num_blocks} blocks of "
                               f"{self.block_size} for n={params.n})", "prompt")
        return dataclasses.replace(params, max_tokens=room)

    def _check_request_id(self, request_id) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        if request_id in self.scheduler.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        if request_id in self._pending:
            raise RequestError(f"request id {request_id!r} is still in use: its final output has not been "
                               "reported yet; call step() first", "request_id")

    def _notify(self, tell: Callable[[EngineObserver], None]) -> None:
        """Tell every observer; one that raises is dropped with a warning, and the engine goes on."""
        for observer in list(self.observers):
            try:
                tell(observer)
            except Exception as exc:
                self.observers.remove(observer)
                warnings.warn(f"kvscope: removed the engine observer {observer!r}: it raised {exc!r}",
                              RuntimeWarning, stacklevel=3)

    def _new_request_id(self) -> str:
        while True:
            request_id = str(next(self._request_ids))
            if request_id not in self.scheduler.requests and request_id not in self._pending:
                return request_id

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                               f"{total} exceeds max_model_len ({self.max_model_len})", "prompt")
        needed = self.scheduler.max_blocks_needed(num_prompt_tokens, params.max_tokens, params.n)
        if needed > self.num_blocks:
            contiguous = "" if self.config.allocator != "contiguous" else (
                f"; the contiguous allocator reserves max_model_len ({self.max_model_len} tokens) per sample: a "
                "smaller --max-model-len fits more")
            raise RequestError(f"request could never fit in the KV cache: it may need {needed} blocks "
                               f"(n={params.n}, {total} tokens, block_size={self.block_size}) but "
                               f"num_blocks is {self.num_blocks}{contiguous}", "prompt")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if it is unknown or already finished.

        Its final output (finish_reason "abort") comes with the next step; until then the id stays in use.
        """
        with self._lock:
            output = self.scheduler.abort(request_id)
            if output is None:
                return False
            self._pending[request_id] = output
            return True

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a final output has yet to be returned by step()."""
        return bool(self._pending) or self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, as vLLM's reset_prefix_cache does: only while no request holds a block
        (False, changing nothing, otherwise). The next step reports it as AllBlocksCleared in kv_events."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()

    def snapshot(self) -> CacheSnapshot:
        """The pool and the queues as they are now, between steps: a request added since the last step
        shows as waiting (what a paused window shows when a load is launched)."""
        with self._lock:
            return build_snapshot(self.scheduler, self.scheduler.cache_state(advance=False), self.step_counter,
                                  self.config.allocator)

    def generate(self, prompts,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion; final outputs in input order. All or nothing: if a prompt is
        refused, or a step raises, every request this call added is aborted and the error raised."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise RequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts", "params")
        else:
            params = [params] * len(prompts)
        request_ids: list[str] = []
        try:
            for prompt, sampling in zip(prompts, params, strict=True):
                request_ids.append(self.add_request(prompt, sampling))
            final = self._run_until_final(request_ids)
        except BaseException:
            self._withdraw(request_ids)
            raise
        return [final[request_id] for request_id in request_ids]

    def _run_until_final(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        wanted = set(request_ids)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            if not self.has_unfinished_requests():
                raise RuntimeError("engine went idle before every generate() request finished")
            for output in self.step().outputs:
                if output.finished and output.request_id in wanted:
                    final[output.request_id] = output
        return final

    def _withdraw(self, request_ids: list[str]) -> None:
        """Abort requests and drop their final outputs unreported, as if they had never been added."""
        with self._lock:
            for request_id in request_ids:
                self.abort_request(request_id)
                self._pending.pop(request_id, None)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One scheduler iteration and one forward. If any part of it raises, every request the step touched
        finishes with finish_reason "error" (final outputs with the next step), the others go on untouched,
        the block pool is left consistent, and the exception propagates."""
        with self._lock:
            if self._stepping:
                raise RuntimeError("step() called from inside step(), e.g. by an observer")
            self._stepping = True
            try:
                result = self._step()
                if self.observers:
                    self._notify(lambda observer: observer.step(result))
            finally:
                self._stepping = False
        return result

    def _step(self) -> StepResult:
        start = time.perf_counter()
        self.step_counter += 1
        scheduler = self.scheduler
        try:
            output = scheduler.schedule()
            scheduled = time.perf_counter()
            runner_output = self._execute(output.batch)
            executed = time.perf_counter()
            if isinstance(runner_output, SampledWithLogprobs):     # before the tokens they go with are appended
                for index, found in runner_output.logprobs.items():
                    output.scheduled[index][0].record_logprobs(output.batch.items[index].sample_indices, found)
            update = scheduler.update_from_output(output, runner_output)
            updated = time.perf_counter()
            cache = scheduler.cache_state()
            snapshot = build_snapshot(scheduler, cache, self.step_counter, self.config.allocator)
        except BaseException as exc:
            self._recover(exc)
            raise
        times = PhaseTimes(start, scheduled, executed, updated, time.perf_counter())
        outputs, finished = update.outputs, update.finished
        if self._pending:   # final outputs, every one
            outputs = [*self._pending.values(), *outputs]
            finished = [*self._pending.values(), *finished]
            self._pending.clear()
        stats = build_stats(scheduler, cache, self.step_counter, time.time(), output.batch, times,
                            update.num_generated)
        events, kv_events = scheduler.take_events()
        return StepResult.knowing_finished(finished, outputs, stats, snapshot, events, kv_events)

    def _execute(self, batch) -> RunnerOutput:
        if batch.items or batch.blocks_to_swap_out or batch.blocks_to_swap_in or batch.blocks_to_copy:
            return self.runner.execute(batch)
        return []

    def _recover(self, exc: BaseException) -> None:
        """The step raised: let the scheduler fail what it touched, and queue their final outputs."""
        error = f"the engine step failed: {type(exc).__name__}: {exc}"
        for output in self.scheduler.fail_step(error):
            self._pending[output.request_id] = output
