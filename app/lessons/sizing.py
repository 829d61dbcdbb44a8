"""Lesson: sizing the pool. What one token's K and V cost, the pool a memory budget makes, and how many requests
of max_model_len it holds at once: vLLM's "Maximum concurrency" line, worked out and then run.

Per-token bytes come from the running model's own config (layers, KV heads, head
dim) and dtype: 2 x layers x KV heads x head_dim x bytes. A budget divided by a
block's bytes is the pool; the pool's tokens divided by max_model_len is the
concurrency vLLM prints. Each engine of the lesson is built from a budget
(--kv-cache-memory) rather than a block count, so every pool on screen is the
engine's own, and twelve requests of nearly max_model_len tokens then show how
many really run at once at full length: the printed figure, rounded down. The
budget, the block size and the dtype each change in turn.
"""

from __future__ import annotations

from kvscope.app.lessons.cues import after_steps
from kvscope.app.lessons.load import read
from kvscope.app.lessons.script import Beat, Highlight, Lesson, Moment, closing, select
from kvscope.app.lessons.words import plural
from kvscope.app.widgets.formatting import mebibytes

MIB = 2**20
BUDGET = 32 * MIB
MAX_MODEL_LEN = 128     # short requests keep the lesson's twelve prefills quick on a CPU
NUM_REQUESTS = 12
MAX_TOKENS = 16
PROBE = "r0"


def probe(ctx) -> list:
    return [read(PROBE, ctx, 40, 4, offset=120)]


def long_requests(ctx) -> list:
    """Twelve plain-text requests whose prompt and reply nearly fill max_model_len."""
    prompt = ctx.max_model_len - MAX_TOKENS - 4
    return [read(f"r{i + 1}", ctx, prompt, MAX_TOKENS, offset=37 * i) for i in range(NUM_REQUESTS)]


def at_full_length(result) -> bool:
    """Every running request holds all the blocks it will ever need (its whole max_model_len-sized run), and no
    request waits for its first blocks while blocks are free for it."""
    running = [v for v in result.snapshot.requests if v.queue == "running"]
    if not running:
        return False
    size = result.snapshot.block_size
    return all(len(v.block_tables[0]) >= -(-(v.num_prompt_tokens + v.max_tokens - 1) // size) for v in running)


def _pool(moment: Moment) -> dict:
    """The engine's figures, as the caption and the closing table quote them."""
    info = moment.info
    layout = info.runner.kv_layout
    block_bytes = layout.bytes_per_token * info.runner.block_size
    budget = info.config.kv_cache_memory or info.runner.num_device_blocks * block_bytes
    return {"info": info, "layout": layout, "block_bytes": block_bytes, "budget": budget,
            "tokens": info.num_tokens, "concurrency": info.num_tokens / info.runner.max_model_len}


def _queues(moment: Moment) -> dict[str, int]:
    counts = {"running": 0, "waiting": 0, "swapped": 0}
    for view in moment.snapshot.requests:
        counts[view.queue] = counts.get(view.queue, 0) + 1
    return counts


def say_token(moment: Moment) -> str:
    pool = _pool(moment)
    runner, layout = pool["info"].runner, pool["layout"]
    view = moment.view(PROBE)
    held = view.num_prompt_tokens + view.num_output_tokens if view else 0
    return (f"For every token, each of {runner.model_name}'s [b]{layout.num_layers} layers[/b] keeps a key and a value "
            f"for each of its [b]{layout.num_kv_heads} KV heads[/b]: [b]{layout.head_dim}[/b] numbers of "
            f"[b]{layout.element_bytes} bytes[/b] ({runner.dtype}) each. From the model's own config:\n\n"
            f"  2 × {layout.num_layers} × {layout.num_kv_heads} × {layout.head_dim} × {layout.element_bytes} B "
            f"= [b]{layout.bytes_per_token:,} bytes a token[/b]\n"
            f"  × {runner.block_size} tokens = {pool['block_bytes']:,} bytes a block\n\n"
            f"{PROBE} holds {held} tokens: {held * layout.bytes_per_token:,} bytes of K and V, in "
            f"{plural(len(view.block_tables[0]) if view else 0, 'block')}.")


def _say_pool(moment: Moment, change: str) -> str:
    pool = _pool(moment)
    runner, queues = pool["info"].runner, _queues(moment)
    running = queues["running"]
    return (f"{change}kv_cache_memory {mebibytes(pool['budget'])}: {pool['budget']:,} B ÷ {pool['block_bytes']:,} B "
            f"a block = [b]{runner.num_device_blocks} blocks[/b] ({pool['tokens']:,} tokens). vLLM prints it as\n\n"
            f"  Maximum concurrency for {runner.max_model_len:,} tokens per request: {pool['concurrency']:.2f}x\n\n"
            f"{NUM_REQUESTS} requests of {_length(moment)} tokens were sent: holding their whole length, "
            f"[b]{running} run at once[/b] ({queues['waiting']} waiting, {queues['swapped']} swapped, "
            f"{moment.stats.num_preemptions} preempted so far): {pool['concurrency']:.2f}, rounded down.")


def _length(moment: Moment) -> int:
    """Prompt and reply of the longest request in the engine: what each asks of max_model_len."""
    return max((v.num_prompt_tokens + v.max_tokens for v in moment.snapshot.requests), default=0)


def say_budget(moment: Moment) -> str:
    return _say_pool(moment, "")


def say_more_budget(moment: Moment) -> str:
    return _say_pool(moment, "[b]Twice the budget[/b], same model and blocks: ")


def say_blocks(moment: Moment) -> str:
    block_size = moment.info.runner.block_size
    return (_say_pool(moment, f"[b]Blocks of {block_size}[/b], the first budget: ") + " The tokens barely "
            f"change; what does is the waste: a request's last block may now leave up to {block_size - 1} "
            "slots empty.")


def say_dtype(moment: Moment) -> str:
    layout = moment.info.runner.kv_layout
    return (_say_pool(moment, f"[b]{moment.info.runner.dtype}[/b]: {layout.element_bytes} bytes a number, "
                              f"{layout.bytes_per_token:,} B a token. ")
            + " Halving the bytes doubles the pool; a quantised KV cache (fp8) would halve it again.")


RUNS = (("budget", "first"), ("more-budget", "2×budget"), ("blocks", "block 32"), ("dtype", "bf16"))


def say_figures(moment: Moment) -> str:
    """The engines side by side, one column each (the lesson panel is about 44 columns wide)."""
    columns = []
    for key, label in RUNS:
        result, info = moment.earlier[key], moment.info_at(key)
        runner = info.runner
        block_bytes = runner.kv_layout.bytes_per_token * runner.block_size
        budget = info.config.kv_cache_memory or runner.num_device_blocks * block_bytes
        running = sum(1 for v in result.snapshot.requests if v.queue == "running")
        columns.append((label, mebibytes(budget), f"{runner.kv_layout.bytes_per_token:,}",
                        str(runner.num_device_blocks),
                        f"{info.num_tokens:,}", f"{info.num_tokens / runner.max_model_len:.2f}x", str(running)))
    labels = ("", "budget", "B/token", "blocks", "tokens", "printed", "ran")
    table = "\n".join(f"{label:<7}" + "".join(f"{column[i]:>9}" for column in columns)
                      for i, label in enumerate(labels))
    return ("[b]The figures of this run[/b]\n"
            f"{table}\n\n"
            "printed: vLLM's maximum concurrency; ran: requests at full length at once, measured.\n\n"
            "On a GPU, vLLM's budget is gpu_memory_utilization × the card's memory, less the weights and the peak "
            "of one profiled forward; the same division then makes the pool. --kv-cache-memory sets the budget "
            "itself, here and in vLLM.")


def _longest(moment: Moment) -> Highlight:
    running = [v for v in moment.snapshot.requests if v.queue == "running"]
    return Highlight(running[0].request_id if running else None)


LESSON = Lesson(
    name="sizing",
    title="Sizing the pool: bytes a token, blocks a budget, concurrency",
    summary="Per-token KV bytes from the model's config, the pool a memory budget makes, and how many requests "
            "of max_model_len it runs at once, as the budget, block size and dtype change.",
    config={"num_blocks": None, "kv_cache_memory": BUDGET, "max_model_len": MAX_MODEL_LEN, "dtype": "float32"},
    beats=(
        Beat("token", "What one token costs", say_token, until=after_steps(1), load=probe,
             point=select(PROBE)),
        Beat("budget", "A budget makes the pool", say_budget, until=at_full_length, load=long_requests,
             point=_longest),
        Beat("more-budget", "Twice the budget", say_more_budget, until=at_full_length,
             config={"kv_cache_memory": 2 * BUDGET}, load=long_requests, point=_longest),
        Beat("blocks", "Bigger blocks", say_blocks, until=at_full_length, config={"block_size": 32},
             load=long_requests, point=_longest),
        Beat("dtype", "Half the bytes", say_dtype, until=at_full_length, config={"dtype": "bfloat16"},
             load=long_requests, point=_longest),
        closing("What sizes a pool", say_figures),
    ),
)
