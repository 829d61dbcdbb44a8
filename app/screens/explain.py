"""The help screen: what each panel means, in plain words, and the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from kvscope.app.widgets.key_bar import KeyBar

EXPLAIN = """\
# What you are looking at

kvscope runs a language model inside this window and shows how it uses memory while it
writes. The model keeps a **key-value (KV) cache**: for every token it has read or written,
a few vectors per layer. That cache is cut into **blocks** of a fixed number of tokens
(the *block size*), like pages of memory in an operating system.

## Block map
One cell is one physical block of the pool. A coloured cell is **in use**, and its colour
is the request that owns it (each request keeps its colour). The glyph's height shows how
full the block is: only a request's *last* block is ever partly filled. **╌** is a block a
request holds but has not written yet: the contiguous allocator reserves whole rows of
them up front. A **digit on a coloured background** is a block **shared** by that many
block tables (a common prompt prefix, or the samples of an `n > 1` request); **+** means ten or
more. **░** is a
**cached** block: nobody uses it, but it still holds a prompt prefix that a new request can
reuse until the block is needed for something else. **·** is free. The bottom line shows the
**host pool**, where swapped-out requests' blocks (**▚**) wait. When the pool has more blocks
than the panel has cells, one cell stands for several blocks; the caption says how many. Then
**z** zooms into the blocks around the cursor, one cell per block (the arrows scroll on
through the pool), and **f** shows only the selected request's blocks, one cell per block in
the order of its block table; the same key again, or **Esc**, shows the whole pool.
Move the cursor (arrows, or the mouse) to inspect a block; **Enter** (or a click) selects its
request: every other block dims, so the selected request's blocks stand out wherever they
are, and the block table below lists them in order; **Esc** on the map clears it. The chat
reply's blocks are tinted while it streams. A model with **sliding-window** layers keeps its
layers in KV-cache groups, one block table each: **w** shows one attention kind's blocks at a
time (full attention, then the sliding window), the rest dimmed. A sliding window holds only
its last few blocks of a request and gives the older ones back as the request advances.

## Block table
The selected request's **block table**: logical block 0, 1, 2… of its sequence and the
physical block each one lives in. The blocks need not be next to each other; that is the
point of paging. `*` marks a shared block.

## Queues
**Running** requests are in the batch now. **Waiting** ones have not started (or were
pushed out and will recompute). **Swapped** ones had their blocks moved to the host pool.
*prefill* is how much of the prompt is computed, *cached* how many prompt tokens came from
the prefix cache, *preempt* how often the request was pushed out.

## Counters
**Free blocks** (cached ones count as free), **KV usage** (blocks in use), **token
utilisation** (slots holding a token, out of the slots handed out), the **prefix-cache hit
rate** in tokens, **preemptions**, blocks **swapped** out and back in, and **CoW/evicted**: blocks
copied on write (a sample about to write into a block other samples share gets its own copy)
and cached blocks evicted to make room, least recently used first. With KV-cache groups:
the blocks each attention kind **holds**, and the blocks sliding windows have **freed**.

## Paged vs contiguous
Before paging, servers reserved one contiguous region of `max_model_len` tokens for every
request, whatever it actually wrote. This panel shows what that would reserve for the
requests alive now, and how much of it would be empty, next to what paging holds.

## Throughput and System
Prompt and generated tokens per second, the time of one engine step, and KV usage over the
last steps. System shows CPU, memory and (with an NVIDIA GPU) GPU figures.

## Chat and load
Type in the chat box and press **Enter**; the reply streams in and its blocks are tinted in
the map. Ask a follow-up: the conversation so far is sent again, and its blocks come back
from the prefix cache. The load generator sends a **burst** of questions, many requests
sharing one **long system prompt**, **long prompts** (their prefill is split into chunks),
**parallel sampling** (`n = 4`, copy-on-write), or enough work to **overload** the pool and
force preemption.

## Event line and status line
Under the map, one line says what the last step did: how many decodes and prefill chunks
ran, blocks copied on write, cached blocks evicted, requests preempted, swapped, admitted
or finished. The line at the bottom is the one vLLM logs every ten seconds, under vLLM's
own names: average prompt and generation throughput, running and waiting requests, KV
cache usage and prefix-cache hit rate.

## Teaching controls
**F2** pauses and resumes, **F3** runs exactly one step, **F4/F5** lower and raise a
steps-per-second cap so a class can follow. **F7** switches preemption between *recompute*
and *swap*, **F8** turns the prefix cache on or off (each restarts the engine). **F9** opens
the run history and replay. **L** lists the **lessons**: scripted scenarios that pause at the
moments worth seeing (Space: next, Backspace: back). **M**, **R** and **C** move the focus to
the map, the requests and the chat; **Esc** in the chat aborts the reply. **Ctrl+N** starts a
new conversation, **Ctrl+S** saves an SVG screenshot, **Ctrl+T** switches the theme, **?**
lists every key, **Ctrl+P** every action. **q** or **F10** quits.
"""


class ExplainScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="explain"):
            yield Markdown(EXPLAIN)
        yield KeyBar(own_only=True, id="keys")
