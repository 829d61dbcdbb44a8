"""Turning a prefix tree's first token ids back into text, when the model's tokenizer is at hand.

vLLM's /v1/models names the directory the server loaded the model from. When
kvscope runs on the same machine (or the user passes ``--tokenizer``) and that
directory holds a ``tokenizer.json``, the prefix panel shows text; otherwise it
shows token ids and says why. The ``tokenizers`` library reads the file
directly: importing transformers would add seconds to the attach for nothing.
The directory the server names is the server's word, not the user's: only a
``tokenizer.json`` inside it is read, never the path itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

PreviewText = Callable[[tuple[int, ...]], str]


def find_tokenizer_file(given: str | None, server_root: str | None = None) -> Path | None:
    """``given`` (a directory or the file itself), else ``tokenizer.json`` in the server's model directory."""
    if given:
        path = Path(given).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path
        if path.is_file():
            return path
    if server_root and Path(server_root).is_absolute():
        path = Path(server_root) / "tokenizer.json"
        if path.is_file():
            return path
    return None


def load_preview_text(given: str | None, server_root: str | None = None) -> tuple[PreviewText | None, str]:
    """(token ids -> text, a note for the panel). The function is None when no tokenizer could be read."""
    path = find_tokenizer_file(given, server_root)
    if path is None:
        return None, "no local tokenizer for this model (pass --tokenizer DIR to see text)"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # a corrupt or foreign file: the panel falls back to token ids
        return None, f"cannot read {path} ({exc}); showing token ids"

    def preview(token_ids: tuple[int, ...]) -> str:
        try:
            return tokenizer.decode(list(token_ids), skip_special_tokens=False)
        except Exception:  # ids from another vocabulary
            return ""

    return preview, f"text from {path.parent.name}'s tokenizer"
