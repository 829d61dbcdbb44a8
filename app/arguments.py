"""One rule for the top-level flags: they mean the same before a subcommand as after it.

argparse lets a subcommand's defaults overwrite the values typed before it, so
`kvscope --dtype float32 chat hi` ran in the default dtype, silently. Here every
flag of a parser that has subcommands is unset until typed (its default is
applied after parsing), and a flag typed before a subcommand is handed to that
subcommand as if typed first among its own arguments (so the same flag typed
after it wins). A subcommand that has no use for a flag refuses it in one line, on either
side: `kvscope runs --dtype float32` and `kvscope --dtype float32 runs` get the
same error. A flag typed before a command group (`kvscope --model m bench throughput`) is handed on to the
subcommand named after it, which takes it or refuses it as if typed there.
"""

from __future__ import annotations

import argparse
from typing import Any

_COMMAND = "_command_prog"     # the namespace attribute naming the innermost subcommand parsed
_HANDED = "_handed_down"       # the namespace attribute: flags typed before a subcommand, to hand on to its own


class FlagRefused(Exception):
    """A flag the subcommand does not take; the message is the one line the user sees."""


def refusal(option: str, prog: str) -> FlagRefused:
    return FlagRefused(f"`{prog}` does not take {option} (`{prog} --help` lists what it takes)")


class CommandLine(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands receive the flags typed before them (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", Subcommands)
        self.typed_defaults: dict[str, Any] = {}

    def flags_unset_until_typed(self) -> None:
        """Make every flag absent from the namespace unless typed; parse_args() applies the defaults afterwards.
        Call once every flag is added (subcommands then see only what the user typed before them)."""
        for action in self._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS:
                self.typed_defaults[action.dest] = action.default
                action.default = argparse.SUPPRESS

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        """argparse's, with the top-level defaults applied afterwards and a misplaced flag refused (FlagRefused)."""
        args, extras = self.parse_known_args(args, namespace)
        prog = getattr(args, _COMMAND, None)
        if extras:
            flag = next((e for e in extras if self._top_level_option(e)), None)
            if flag is not None and prog is not None:
                raise refusal(flag.split("=", 1)[0], prog)
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        for dest, value in self.typed_defaults.items():
            if not hasattr(args, dest):
                setattr(args, dest, value)
        for private in (_COMMAND, _HANDED):
            if hasattr(args, private):
                delattr(args, private)
        return args

    def _top_level_option(self, text: str) -> bool:
        return text.startswith("-") and text.split("=", 1)[0] in self._option_string_actions


class Subcommands(argparse._SubParsersAction):
    """Hands the flags typed before the subcommand to it, as if typed first among its own arguments: they start
    the subcommand's namespace, so its defaults leave them alone and the same flag typed after it wins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name, rest = values[0], list(values[1:])
        sub = self._name_parser_map.get(name)
        if sub is None:     # argparse's own "invalid choice"
            super().__call__(parser, namespace, values, option_string)
            return
        _refuse_misplaced(parser, sub, rest)
        # Typed before this subcommand: this parser's own flags, and those an outer subcommand handed down
        # (`kvscope --model m bench throughput`: bench hands --model on to throughput), each with its spelling.
        spelled = dict(getattr(namespace, _HANDED, {}))
        for action in parser._actions:
            if action.option_strings and action.default is argparse.SUPPRESS and hasattr(namespace, action.dest):
                spelled[action.dest] = _spelling(action, getattr(namespace, action.dest))
        typed = {dest: getattr(namespace, dest) for dest in spelled}
        for dest, option in spelled.items():
            if not _takes_dest(sub, dest, rest):
                raise refusal(option, _innermost(sub, rest).prog)
        if self.dest is not argparse.SUPPRESS:
            setattr(namespace, self.dest, name)
        setattr(namespace, _COMMAND, sub.prog)
        subnamespace, extras = sub.parse_known_args(rest, argparse.Namespace(**typed, **{_HANDED: spelled}))
        for key, value in vars(subnamespace).items():
            setattr(namespace, key, value)
        if extras:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, [])
            getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR).extend(extras)


def _refuse_misplaced(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, rest: list[str]) -> None:
    """FlagRefused for a flag of ``parser`` typed after ``sub`` that ``sub`` does not take: argparse would leave it
    over and read its value as a positional argument (an invalid choice). Words after the name of a subcommand of
    ``sub`` are that subcommand's to check."""
    child = _named_child(sub, rest)
    for text in rest:
        if text == "--" or text is child:
            return
        option = text.split("=", 1)[0]
        if option.startswith("-") and option in parser._option_string_actions and not _takes(sub, option):
            raise refusal(option, sub.prog)


def _named_child(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """The first of ``words`` that names a subcommand of ``parser`` (the word itself), or None."""
    names = {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
             for name in action.choices}
    return next((word for word in words if word in names), None)


def _child(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(action.choices[name] for action in parser._actions
                if isinstance(action, argparse._SubParsersAction) and name in action.choices)


def _innermost(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The deepest subcommand ``words`` name below ``parser`` (``parser`` itself if they name none)."""
    child = _named_child(parser, words)
    return parser if child is None else _innermost(_child(parser, child), words[words.index(child) + 1:])


def _takes(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def _takes_dest(parser: argparse.ArgumentParser, dest: str, rest: list[str]) -> bool:
    """Whether ``parser`` has a flag for ``dest``, or the subcommand of it that ``rest`` names does (which then
    checks again, with what follows it)."""
    if any(a.dest == dest and a.option_strings for a in parser._actions):
        return True
    child = _named_child(parser, rest)
    return child is not None and _takes_dest(_child(parser, child), dest, rest[rest.index(child) + 1:])


def _spelling(action: argparse.Action, value) -> str:
    """The flag as it was typed, for a refusal: --no-log rather than --log for a negative."""
    negative = isinstance(action, argparse.BooleanOptionalAction) and value is False
    return action.option_strings[-1 if negative else 0]
