"""The private Textual and atexit APIs kvscope leans on, each pinned by what kvscope needs of it.

They have no public equivalent: ``Screen._modal_binding_chain`` and ``App._check_action_state`` are what the
key bar reads (``active_bindings`` merges by key, so a widget's hidden Esc would hide the screen's shown one),
a node's ``_bindings`` is what the keys panel lists, and ``atexit._run_exitfuncs`` is how ``kvscope`` runs its
exit handlers before skipping the interpreter's teardown. A Textual or Python upgrade that removes or changes
one fails here, by name, before the key bar or the run log quietly stops working.
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from contextlib import asynccontextmanager

import pytest
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input

pytestmark = pytest.mark.anyio


class Shown(Screen):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("x", "hidden_action", "Never shown")]

    def compose(self) -> ComposeResult:
        yield Input(id="field")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return action != "hidden_action"


class Probe(App):
    BINDINGS = [Binding("q", "quit", "Quit")]

    def on_mount(self) -> None:
        self.push_screen(Shown())


@asynccontextmanager
async def started_probe():
    """A started Probe: its Shown screen on top, the input in focus."""
    app = Probe()
    async with app.run_test() as pilot:
        await pilot.pause()
        yield app


async def test_the_modal_binding_chain_runs_from_the_focused_widget_up_to_the_app():
    async with started_probe() as app:
        screen = app.screen
        assert hasattr(screen, "_modal_binding_chain"), "Textual removed Screen._modal_binding_chain (key_bar.py)"
        chain = list(screen._modal_binding_chain)
        nodes = [node for node, _bindings in chain]
        assert nodes[0] is screen.focused and screen in nodes and nodes[-1] is app
        for _node, bindings in chain:
            for key, binding in bindings:          # a BindingsMap iterates as (key, Binding) pairs
                assert isinstance(key, str) and isinstance(binding, Binding)


async def test_check_action_state_asks_the_node_that_owns_the_binding():
    async with started_probe() as app:
        screen = app.screen
        assert hasattr(app, "_check_action_state"), "Textual removed App._check_action_state (key_bar.py)"
        assert app._check_action_state("hidden_action", screen) is False
        assert app._check_action_state("app.pop_screen", screen) is True
        assert app._check_action_state("quit", app) is True


async def test_a_nodes_own_bindings_map_its_keys_to_bindings():
    """The keys panel (widgets/keys_panel.py) lists each node's own bindings, the App's first: ``_bindings``'s
    ``key_to_bindings``, which the chain's merged views would hide behind the focused input's."""
    async with started_probe() as app:
        for node in (app, app.screen, app.screen.query_one(Input)):
            assert hasattr(node, "_bindings") and hasattr(node._bindings, "key_to_bindings"), type(node)
            for key, bound in node._bindings.key_to_bindings.items():
                assert isinstance(key, str) and all(isinstance(binding, Binding) for binding in bound)
        assert [b.action for b in app._bindings.key_to_bindings["q"]] == ["quit"]


def test_run_exitfuncs_runs_the_registered_handlers_before_os_exit(tmp_path):
    assert callable(getattr(atexit, "_run_exitfuncs", None)), "atexit._run_exitfuncs is gone (app/cli.py)"
    script = "import atexit, os; atexit.register(print, 'handler ran'); atexit._run_exitfuncs(); os._exit(0)"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "handler ran"
