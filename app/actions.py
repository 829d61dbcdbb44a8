"""The app's actions: each key, its footer label and its command-palette entry, in one table.

The App binds the keys from it and lists the same entries in the command palette,
so a key and its palette entry can never disagree; Textual's own palette entries
that kvscope replaces are named here too, so each is listed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class AppAction:
    """One user action: its key (if any), footer label and command-palette help."""

    keys: str | None
    action: str
    title: str
    help: str

    def binding(self) -> Binding:
        return Binding(self.keys, self.action, self.title, tooltip=self.help)


ACTIONS = (
    AppAction("q,f10", "quit", "Quit", "Quit kvscope (asks first while requests are in flight); F10 as in htop"),
    AppAction("question_mark", "show_keys", "Keys", "Show every key of the panel in focus and of the app"),
    AppAction("f1", "explain", "Explain", "What each panel means, in plain words"),
    AppAction("f2", "toggle_pause", "Pause", "Pause or resume the engine"),
    AppAction("f3", "single_step", "Step", "Pause and run exactly one engine step"),
    AppAction("f4", "slower", "Slower", "Lower the steps-per-second cap so a class can follow"),
    AppAction("f5", "faster", "Faster", "Raise the steps-per-second cap, up to no cap"),
    AppAction("f6", "launch_preset", "Load", "Send the load preset selected in the load generator"),
    AppAction("f7", "toggle_preemption", "Preempt mode",
              "Switch preemption between recompute and swap (restarts the engine)"),
    AppAction("f8", "toggle_prefix_caching", "Prefix cache",
              "Turn prefix caching on or off (restarts the engine)"),
    AppAction("f9", "history", "History", "Browse logged runs and replay one step by step"),
    AppAction("l", "lessons", "Lessons", "Pick a lesson: a scripted scenario that pauses at each moment worth seeing"),
    AppAction("m", "focus_panel('block-map')", "Map", "Move the focus to the block map"),
    AppAction("r", "focus_panel('queues')", "Requests", "Move the focus to the queues of requests"),
    AppAction("c", "focus_panel('chat-input')", "Chat", "Move the focus to the chat input"),
    AppAction("ctrl+g", "abort_reply", "Stop reply",
              "Stop the chat's reply while it streams; its blocks go back to the pool"),
    AppAction("ctrl+n", "new_conversation", "New chat",
              "Start a new conversation: the model no longer sees the earlier turns"),
    AppAction("ctrl+t", "toggle_theme", "Theme", "Switch between the kvscope dark and light themes"),
    AppAction("ctrl+s", "screenshot_svg", "Screenshot", "Save an SVG screenshot of the window"),
    AppAction(None, "toggle_allocator", "Switch allocator",
              "Switch between the paged and the contiguous allocator (restarts the engine)"),
    AppAction(None, "abort_all", "Abort all requests", "Abort every running, waiting and swapped request"),
    AppAction(None, "restart_engine", "Restart engine", "Build a fresh engine with the current settings"),
)
# Textual's own palette entries that kvscope replaces with its own (so each is listed once).
REPLACED_SYSTEM_COMMANDS = {"Theme", "Quit", "Keys", "Screenshot"}

# The footer's order of need: at a width too small for every key, the last of these go first. OWN_KEYS ("*") is
# where the screen's and the focused panel's own keys rank; the App's keys not listed go last.
FOOTER_RANKS = (
    "quit", "show_keys", "abort_reply", "lessons", "focus_panel('chat-input')", "focus_panel('block-map')",
    "focus_panel('queues')", "explain", "toggle_pause", "single_step", "history", "*", "launch_preset", "slower",
    "faster", "new_conversation", "toggle_preemption", "toggle_prefix_caching", "toggle_theme", "screenshot_svg",
)


def bindings(*actions: str) -> list[Binding]:
    """The key bindings of ``actions`` (all of the table's keyed ones when none is named), in the table's order."""
    return [a.binding() for a in ACTIONS if a.keys and (not actions or a.action in actions)]


# The attached window's keys: the app's own where they mean the same, so q quits and Ctrl+S saves a screenshot
# in both windows.
ATTACH_ACTIONS = ("quit", "show_keys", "history", "toggle_theme", "screenshot_svg")
