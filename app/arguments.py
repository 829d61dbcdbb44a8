"""One rule for the top-level flags: they mean the same before a subcommand as after it.

argparse lets a subcommand's defaults overwrite the values typed before it, so
`kvscope --dtype float32 chat hi` ran in the default dtype, silently. Here every
flag of a parser that has subcommands is unset until typed (its default is
applied after parsing), and a flag typed before a subcommand is handed to that
subcommand as if typed first among its own arguments (so the same flag typed
after it wins). A subcommand that has no use for a flag refuses it in one line, on either
side: `kvscope runs --dtype float32` and `kvscope --dtype float32 runs` get the
same error.
"""

from __future__ import annotations

import argparse
from typing import Any

_COMMAND = "_command_prog"     # the namespace attribute naming the innermost subcommand parsed


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
        if hasattr(args, _COMMAND):
            delattr(args, _COMMAND)
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
        typed = {a.dest: getattr(namespace, a.dest) for a in parser._actions
                 if a.option_strings and a.default is argparse.SUPPRESS and hasattr(namespace, a.dest)}
        for dest, value in typed.items():
            _check_taken(parser, dest, value, sub)
        if self.dest is not argparse.SUPPRESS:
            setattr(namespace, self.dest, name)
        setattr(namespace, _COMMAND, sub.prog)
        subnamespace, extras = sub.parse_known_args(rest, argparse.Namespace(**typed))
        for key, value in vars(subnamespace).items():
            setattr(namespace, key, value)
        if extras:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, [])
            getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR).extend(extras)


def _refuse_misplaced(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, rest: list[str]) -> None:
    """FlagRefused for a flag of ``parser`` typed after ``sub`` that neither ``sub`` nor a subcommand of it
    takes: argparse would leave it over and read its value as a positional argument (an invalid choice)."""
    for text in rest:
        if text == "--":
            return
        option = text.split("=", 1)[0]
        if option.startswith("-") and option in parser._option_string_actions and not _takes(sub, option):
            raise refusal(option, sub.prog)


def _takes(parser: argparse.ArgumentParser, option: str) -> bool:
    if option in parser._option_string_actions:
        return True
    nested = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return any(_takes(child, option) for action in nested for child in action.choices.values())


def _check_taken(parser: argparse.ArgumentParser, dest: str, value, sub: argparse.ArgumentParser) -> None:
    """FlagRefused, naming the flag as it was typed, when ``sub`` has no flag for ``dest``."""
    if any(a.dest == dest and a.option_strings for a in sub._actions):
        return
    action = next(a for a in parser._actions if a.dest == dest and a.option_strings)
    negative = isinstance(action, argparse.BooleanOptionalAction) and value is False
    raise refusal(action.option_strings[-1 if negative else 0], sub.prog)
