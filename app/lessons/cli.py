"""`kvscope lesson [NAME]`: open the app on a lesson (or on the list of lessons); `--list` prints their names."""

from __future__ import annotations

import argparse

from kvscope.app.lessons import LESSONS


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "lesson", help="run a lesson: a scripted scenario on the real model that pauses where it matters",
        description="Run a lesson on the teaching pool (--teach). Space moves to the next beat, Backspace goes "
                    "back by replaying the run log, Esc leaves the lesson for the app. With no NAME, pick one "
                    "from the list.")
    parser.add_argument("name", nargs="?", choices=list(LESSONS), metavar="NAME",
                        help=f"one of: {', '.join(LESSONS)}")
    parser.add_argument("--list", action="store_true", help="print the lesson names, one per line, and exit")
    parser.add_argument("--model", default="default", help="as for the app (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true",
                        help="do not keep the lesson's runs (Backspace then replays from a temporary log)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.list:
        for name in LESSONS:
            print(name)
        return 0
    from kvscope.app.app import run_app
    from kvscope.app.cli import first_engine
    from kvscope.app.lessons.load import teach_config
    from kvscope.engine.config import EngineConfig

    engine = first_engine(teach_config(EngineConfig(model=args.model, device=args.device, dtype=args.dtype)))
    if engine is None:
        return 2
    return run_app(engine.config, db_path=args.db, log_enabled=not args.no_log, engine=engine,
                   lesson=args.name or "")
