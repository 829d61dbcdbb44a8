"""``python -m kvscope``: the same command as the ``kvscope`` console script."""

from kvscope.app.cli import console_main

console_main()
