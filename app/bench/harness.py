"""Runs the chosen systems over the chosen workloads, in one process, on one set of weights per dtype.

Every system of an invocation sees the same model weights, dtype, torch threads,
prompts and output lengths. Each gets one small untimed generation first (warm-up),
then the workload's requests all at once, timed until the last token. On a greedy workload each row then
gets its accuracy (app/bench/accuracy.py): its tokens against transformers' fp32 ``generate`` on a sample of
the requests, and how many of those it answers as it does the same request run alone (untimed).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvscope.app.bench.accuracy import BELOW_BAR, TOKENS, Reference, Sample, greedy_alone
from kvscope.app.bench.floor import ForwardFloor
from kvscope.app.bench.hf_cb import ContinuousBatchRun, ContinuousSettings
from kvscope.app.bench.hf_static import StaticBatchRun, StaticSettings
from kvscope.app.bench.kvscope_system import OVERHEAD_BATCH, VARIANTS, KvscopeRun, engine_config, run_alone
from kvscope.app.bench.metrics import PeakRss, RunRecord, summarise
from kvscope.app.bench.peak import model_flops, utilisation
from kvscope.app.bench.systems import HF_CB, HF_STATIC, PAGED, SYSTEMS, VLLM, systems_for
from kvscope.app.bench.vllm_system import SystemUnavailable, VllmRun, VllmSettings
from kvscope.app.bench.workloads import BenchRequest, Workload, warm_up_request
from kvscope.engine.model import patches

FLOOR_SYSTEM = PAGED


@dataclass
class BenchOptions:
    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    systems: tuple[str, ...] | None = None     # None: each workload's defaults
    static: StaticSettings = field(default_factory=StaticSettings)
    continuous: ContinuousSettings = field(default_factory=ContinuousSettings)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    forward_floor: bool = True
    # Block size and step budget for kvscope and vLLM alike; None: each system's own defaults.
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    cpu_threads_bind: str = "none"              # kvscope's thread pinning (engine/model/threads.py)
    # The machine's matmul GFLOP/s in this dtype (app/bench/peak.py), for each row's model FLOP utilisation.
    peak_gflops: float | None = None


class Bench:
    """Runs every (workload, system) pair for one dtype and returns report rows and notes.

    ``open_log(engine)`` records each kvscope run (``runlog.record_run``), or is None;
    ``progress`` receives one line per finished system; ``references`` holds, by workload name, the fp32
    reference its rows' accuracy is scored against (none: no accuracy columns for that workload).
    """

    def __init__(self, model, tokenizer, options: BenchOptions, open_log: Callable | None = None,
                 progress: Callable[[str], None] | None = None,
                 references: dict[str, Reference] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.open_log = open_log
        self.progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
        self.pad_token_id = pad_token_id(model, tokenizer)
        self.floor = ForwardFloor(model) if options.forward_floor else None
        self.flops = model_flops(model)
        self.notes: dict[tuple[str, str], list[str]] = {}
        self.references = references or {}
        self._transformers_alone: dict[str, dict[int, list[int]]] = {}

    def run(self, workloads: list[Workload]) -> list[dict]:
        rows = []
        for workload in workloads:
            reference = self.references.get(workload.name)
            self._note(workload, accuracy_note(workload, reference))
            for system in systems_for(workload.name, self.options.systems):
                try:
                    record = self.run_system(system, workload, reference.sample if reference else None)
                except SystemUnavailable as exc:
                    rows.append(self._unavailable_row(system, workload, str(exc)))
                    continue
                row = summarise(record, workload.name, self.options.dtype, len(workload.requests))
                row["settings"] = record.settings
                row["mfu"] = utilisation(self.flops, workload.num_prompt_tokens, record.num_output_tokens,
                                         record.wall_s, self.options.peak_gflops)
                if reference is not None:
                    if record.alone_outputs is None and record.outputs is not None:
                        record.alone_outputs = self._alone(system, workload, reference.sample)
                    row |= reference.row_fields(record.outputs, record.alone_outputs)
                if system == FLOOR_SYSTEM and self.floor is not None:
                    self._add_floor(row, record, workload)
                rows.append(row)
                self.progress(f"  {workload.name} {self.options.dtype} {system}: "
                              f"{row['output_tokens_per_s']:.1f} output tok/s in {row['wall_s']:.1f}s")
                self._note(workload, f"{system} settings: {_settings_text(record.settings)}")
                self._note_findings(workload, row)
        return rows

    def run_system(self, system: str, workload: Workload, sample: Sample | None = None) -> RunRecord:
        """One timed run; ``sample``: the requests vLLM also runs alone (it cannot be restarted cheaply)."""
        warm_up = warm_up_request(workload.requests[0].n)
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        with PeakRss() as rss:
            record = self._dispatch(system, workload, warm_up, sample)
            gc.collect()
        if record.peak_rss_mb is None:  # a system in another process measures its own
            record.peak_rss_mb = rss.peak_mb
        if record.num_output_tokens != workload.num_output_tokens:
            raise RuntimeError(f"{system} produced {record.num_output_tokens} output tokens on "
                               f"{workload.name}, expected {workload.num_output_tokens}")
        return record

    def _dispatch(self, system: str, workload: Workload, warm_up: BenchRequest, sample: Sample | None) -> RunRecord:
        if system not in VARIANTS:
            patches.restore(self.model)  # stock transformers for its systems; a kvscope engine prepares it again
        if system == HF_STATIC:
            return StaticBatchRun(self.model, self.pad_token_id, self.options.static).run(workload, warm_up)
        if system == HF_CB:
            run = ContinuousBatchRun(self.model, self.pad_token_id, self.options.continuous)
            return run.run(workload, warm_up)
        if system == VLLM:
            from kvscope.engine.model.loader import resolve_model_path

            run = VllmRun(resolve_model_path(self.options.model), self.options.dtype, torch.get_num_threads(),
                          self.options.vllm, block_size=self.options.block_size,
                          max_num_batched_tokens=self.options.max_num_batched_tokens)
            return run.run(workload, warm_up, sample)
        return KvscopeRun(VARIANTS[system], self.make_engine, self.open_log).run(
            workload, warm_up, self._engine_config(system, workload))

    def _engine_config(self, system: str, workload: Workload):
        return engine_config(VARIANTS[system], workload, model=self.options.model, device=self.options.device,
                             dtype=self.options.dtype, block_size=self.options.block_size,
                             max_num_batched_tokens=self.options.max_num_batched_tokens,
                             cpu_threads_bind=self.options.cpu_threads_bind)

    def _alone(self, system: str, workload: Workload, sample: Sample) -> dict[int, list[int]]:
        """The sampled requests' tokens, each run alone by ``system``: a fresh kvscope engine, or transformers'
        ``generate`` one request at a time (both of its systems are that, run alone)."""
        if system in VARIANTS:
            return run_alone(self.make_engine(self._engine_config(system, workload)), workload, sample)
        if workload.name not in self._transformers_alone:
            patches.restore(self.model)
            self._transformers_alone[workload.name] = greedy_alone(self.model, sample, workload, self.pad_token_id)
        return self._transformers_alone[workload.name]

    def make_engine(self, config):
        from kvscope.engine import LLMEngine

        return LLMEngine(config, model=self.model, tokenizer=self.tokenizer)

    def _add_floor(self, row: dict, record: RunRecord, workload: Workload) -> None:
        seconds = self.floor.seconds(record.step_shapes)
        floor_tok_s = record.num_output_tokens / seconds if seconds else None
        row["forward_floor_output_tokens_per_s"] = floor_tok_s
        row["fraction_of_floor"] = row["output_tokens_per_s"] / floor_tok_s if floor_tok_s else None
        if floor_tok_s:
            self._note(workload, f"forward-only floor for the {len(record.step_shapes)} batches "
                                 f"{FLOOR_SYSTEM} ran: {floor_tok_s:.1f} output tok/s; "
                                 f"{FLOOR_SYSTEM} reached {row['fraction_of_floor']:.0%} of it")

    def _unavailable_row(self, system: str, workload: Workload, reason: str) -> dict:
        self.progress(f"  {workload.name} {self.options.dtype} {system}: not run ({reason})")
        self._note(workload, f"{system}: not run: {reason}")
        return {"workload": workload.name, "system": system, "dtype": self.options.dtype,
                "requests": len(workload.requests), "output_tokens": workload.num_output_tokens,
                "output_tokens_per_s": None, "not_run": reason}

    def _note_findings(self, workload: Workload, row: dict) -> None:
        system = row["system"]
        if row.get("load_s") is not None:
            self._note(workload, f"{system} load and compile: {row['load_s']:.1f}s (outside its timed run)")
        wasted = row.get("wasted_token_fraction")
        if wasted is not None:
            self._note(workload, f"{system} generated {row['generated_tokens']:,} tokens for "
                                 f"{row['output_tokens']:,} useful: {wasted:.0%} wasted")
        if row.get("engine_overhead") is not None:
            at_full = row.get(f"engine_overhead_at_{OVERHEAD_BATCH}")
            full = f", {at_full:.1%} at a running batch >= {OVERHEAD_BATCH}" if at_full is not None else ""
            self._note(workload, f"{system} time outside the model forward: "
                                 f"{row['engine_overhead']:.1%} of step time{full}")

    def _note(self, workload: Workload, text: str) -> None:
        self.notes.setdefault((workload.name, self.options.dtype), []).append(text)


def accuracy_note(workload: Workload, reference: Reference | None) -> str:
    """The line under a table that says what its accuracy columns measured."""
    if reference is None:
        why = f"sampled at temperature {workload.temperature}" if workload.temperature > 0 else "no reference"
        return f"accuracy: not measured ({why}; it needs greedy tokens)"
    return (f"accuracy on {len(reference.sample.indices)} sampled requests, their first {TOKENS} tokens at most, "
            f"against transformers fp32 generate: first = first token equal, lead = mean leading tokens equal; "
            f"transformers bf16 scores {reference.bf16.text()}, and {BELOW_BAR} marks a row below it. "
            f"= alone: requests whose tokens equal the same request run alone by the same system")


def pad_token_id(model, tokenizer) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), model.generation_config.pad_token_id,
                      getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0


def _settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def environment_line() -> str:
    import platform

    import transformers

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{torch.get_num_threads()} torch threads, {platform.processor() or platform.machine()}, "
            f"python {platform.python_version()}")
