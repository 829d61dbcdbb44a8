"""No process takes kvscope's ``kernels/`` for Hugging Face's ``kernels`` distribution, or the reverse.

transformers >= 5.25 installs the hub's ``kernels`` and imports it. A process started in the checkout has the
working directory (or the script's folder, the checkout root) on ``sys.path`` ahead of site-packages, so a
``kernels/__init__.py`` there used to win and transformers died importing it. ``kernels/`` is now a namespace
portion, which a regular package anywhere on the path outranks. Each way a user starts Python in the checkout
runs here from the checkout root, with the hub package installed (as the lock installs it) and hidden (as on a
machine without it), and each loads a transformers model class through kvscope's engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# What a process reports: where each `kernels` came from, whether transformers thinks the hub's is there, and
# that a transformers model class ran a step through kvscope's kernels.
PROBE = textwrap.dedent("""
    import json, importlib.util, kernels
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils.import_utils import is_kernels_available
    from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
    from kvscope.engine.model.loader import resolve_model_path
    import kvscope.kernels.dispatch

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    engine = LLMEngine(EngineConfig(num_blocks=16, dtype="float32"), model=LlamaForCausalLM(config).eval(),
                       tokenizer=tokenizer)
    [output] = engine.generate([[{"role": "user", "content": "What is 2+2?"}]],
                               SamplingParams(max_tokens=2, temperature=0.0))
    print(json.dumps({"hub": getattr(kernels, "__file__", None), "available": is_kernels_available(),
                      "ours": kvscope.kernels.dispatch.__file__, "tokens": len(output.token_ids)}))
""")

# Put on PYTHONPATH, this makes a process see no hub `kernels` (neither its module nor its distribution), as
# on a machine where transformers < 5.25 never installed it.
HIDE_HUB = textwrap.dedent("""
    import importlib.machinery, sys

    class _WithoutHubKernels(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "kernels":
                path = [entry for entry in sys.path if "site-packages" not in entry]
            return super().find_spec(name, path, target)

        @classmethod
        def find_distributions(cls, *args, **kwargs):
            return (found for found in super().find_distributions(*args, **kwargs)
                    if found.metadata["Name"] != "kernels")

    sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = _WithoutHubKernels
""")


def _environment(tmp_path: Path, hub: bool) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if not hub:
        (tmp_path / "sitecustomize.py").write_text(HIDE_HUB)
        env["PYTHONPATH"] = str(tmp_path)
    return env


def _probe(command: list[str], tmp_path: Path, hub: bool) -> dict:
    result = subprocess.run(command, cwd=ROOT, env=_environment(tmp_path, hub), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_each_kernels_is_its_own(report: dict, hub: bool) -> None:
    assert Path(report["ours"]).parent == ROOT / "kernels"
    assert report["tokens"] == 2
    if hub:
        assert "site-packages" in report["hub"], report
        assert report["available"] is True
    else:   # at most our folder, as an empty namespace, which transformers does not take for the hub's
        assert report["hub"] is None, report
        assert report["available"] is False


@pytest.fixture(params=[True, False], ids=["hub-kernels-installed", "hub-kernels-absent"])
def hub(request) -> bool:
    return request.param


def test_hub_kernels_is_installed_by_the_lock():
    from importlib.metadata import version

    assert version("kernels")   # else the "installed" cases below would test nothing new


def test_python_c_from_the_checkout_root(tmp_path, hub):
    _assert_each_kernels_is_its_own(_probe([sys.executable, "-c", PROBE], tmp_path, hub), hub)


def test_a_script_in_the_checkout_root(tmp_path, hub):
    script = ROOT / f"probe_{uuid.uuid4().hex}.py"   # its folder, the checkout root, leads sys.path
    script.write_text(PROBE)
    try:
        _assert_each_kernels_is_its_own(_probe([sys.executable, str(script)], tmp_path, hub), hub)
    finally:
        script.unlink()


def test_python_m_kvscope_and_the_console_script_answer_from_the_checkout_root(tmp_path, hub):
    """The user's own commands, on the default model (SmolLM2, a LlamaForCausalLM)."""
    for command in ([sys.executable, "-m", "kvscope"], [str(BIN / "kvscope")]):
        result = subprocess.run([*command, "chat", "What is 2+2?", "--max-tokens", "3", "--no-log"], cwd=ROOT,
                                env=_environment(tmp_path, hub), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip(), result.stderr[-3000:]


def test_pytest_from_the_checkout_root(tmp_path, hub):
    test_file = tmp_path / "test_probe.py"
    test_file.write_text(textwrap.dedent("""
        import subprocess, sys

        def test_probe():
            import kernels, transformers.models.llama.modeling_llama
            from transformers.utils.import_utils import is_kernels_available
            import kvscope.kernels.dispatch
            assert is_kernels_available() == (getattr(kernels, "__file__", None) is not None)
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "--rootdir", str(ROOT), str(test_file)], cwd=ROOT, env=_environment(tmp_path, hub),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
