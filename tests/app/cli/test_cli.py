"""The command line: flags, version, and one clear line (exit 2, no traceback) for each bad input."""

import dataclasses
import errno
import os
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error, run_cli
from transformers import BertConfig, MambaConfig

from kvscope.app.cli import build_parser, main
from kvscope.app.flags import config_from_args
from kvscope.engine import EngineConfig
from kvscope.engine.model import loader


def test_help_lists_subcommands_and_vllm_named_flags():
    text = build_parser().format_help()
    for word in ("fetch-model", "chat", "bench", "runs", "screenshots", "--block-size", "--num-blocks",
                 "--kv-cache-memory", "--gpu-memory-utilization", "--swap-space", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--preemption-mode", "--device", "--dtype", "--seed"):
        assert word in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("kvscope ")


def test_missing_model_path(capsys, tmp_path):
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(tmp_path / "nope"))
    assert_one_line_error(status, err, "does not exist", str(tmp_path / "nope"))


def test_missing_gguf_file(capsys, tmp_path):
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(tmp_path / "model.gguf"))
    assert_one_line_error(status, err, "does not exist")


def test_file_that_is_not_a_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 10)
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(bogus))
    assert_one_line_error(status, err, "not a readable GGUF")


def test_directory_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(tmp_path))
    assert_one_line_error(status, err, "not a transformers model directory")


def test_encoder_only_architecture(capsys, tmp_path):
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path)
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(tmp_path))
    assert_one_line_error(status, err, "unsupported architecture", "bert")


def test_architecture_without_attention_interface(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.model.model_runner import ModelRunner

    model = AutoModelForCausalLM.from_config(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=64))
    with pytest.raises(loader.ModelError, match="AttentionInterface"):
        ModelRunner(EngineConfig(num_blocks=4), model=model, tokenizer=object())


def test_hub_id_without_network(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = run_cli(capsys, "chat", "hi", "--model", "someone/some-model-kvscope-test")
    assert_one_line_error(status, err, "cannot fetch", "someone/some-model-kvscope-test")


def test_hub_id_with_the_hub_unreachable_fails_at_once_without_a_network_request(capsys, monkeypatch):
    import huggingface_hub.file_download
    from huggingface_hub import constants

    # A port nobody listens on, as a machine without network refuses: the hub client, which would retry for
    # about 30 s, is never asked to fetch anything.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(loader, "HUB_CONNECT_TIMEOUT_S", 0.2)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("the hub was asked over the network")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    status, _, err = run_cli(capsys, "chat", "hi", "--model", "someone/some-model-kvscope-test")
    assert_one_line_error(status, err, "cannot be reached", "someone/some-model-kvscope-test")


def test_stablelm_is_refused_in_kvscopes_words_naming_the_family_and_why(capsys, tmp_path):
    """StableLM's transformers attention does not go through AttentionInterface, so it cannot reach the kernels."""
    from transformers import StableLmConfig

    StableLmConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=64).save_pretrained(tmp_path)
    status, _, err = run_cli(capsys, "chat", "hi", "--model", str(tmp_path))
    assert_one_line_error(status, err, "kvscope cannot serve 'stablelm' models", "AttentionInterface")
    assert "attn_implementation" not in err


def test_a_saved_gemma2_with_a_window_shorter_than_the_context_chats(capsys, tmp_path):
    """Soft-capped logits and sliding windows once made kvscope refuse Gemma 2; a directory saved by transformers
    now loads with --model and answers, its window (24 tokens) shorter than --max-model-len."""
    from models import tiny_model

    model, tokenizer = tiny_model("gemma2")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    status, out, err = run_cli(capsys, "chat", "Tell me a story about a dragon and a knight, please.",
                               "--model", str(tmp_path), "--max-model-len", "128", "--max-tokens", "4",
                               "--dtype", "float32", "--no-log")
    assert status == 0, err
    assert out   # a random model's four tokens (often blank ones); their values are tested in tests/engine/model


def test_no_space_for_the_model_cache(capsys, tmp_path, monkeypatch):
    from models import tiny_model

    # Skip the slow dequantisation: the write is what runs out of space.
    model, tokenizer = tiny_model()
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_load_gguf", lambda gguf: (model, tokenizer))

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    status, _, err = run_cli(capsys, "fetch-model")
    assert_one_line_error(status, err, "no space left on device", str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "models" / loader.DEFAULT_MODEL_NAME).exists()


def test_bad_block_size(capsys):
    status, _, err = run_cli(capsys, "chat", "hi", "--block-size", "12")
    assert_one_line_error(status, err, "block_size", "power of two")


def test_real_process_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvscope.app.cli", "chat", "hi", "--model", str(tmp_path / "x")],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_chat_streams_an_answer_and_logs_the_run(capsys, tmp_path):
    from kvscope.app.runlog import RunLogReader

    db = tmp_path / "runs.db"
    status, out, err = run_cli(capsys, "chat", "Say hello.", "--max-tokens", "6", "--device", "cpu",
                               "--dtype", "float32", "--num-blocks", "64", "--db", str(db))
    assert status == 0, err
    answer = out.strip()
    assert answer
    (run,) = RunLogReader(db).list_runs()
    assert run["source"] == "chat" and run["status"] == "finished"
    (request,) = RunLogReader(db).rows("requests", run["id"])
    assert request["prompt_text"] == "user: Say hello." and request["output_text"].strip() == answer


def test_chat_refuses_bad_sampling_flags_before_loading_the_model(capsys):
    status, _, err = run_cli(capsys, "chat", "hi", "--temperature", "-1", "--model", "/nonexistent/model")
    assert_one_line_error(status, err, "temperature must be a finite number >= 0")


@pytest.mark.parametrize("argv", [[], ["chat", "hi"]])
def test_every_engine_config_field_has_a_flag_with_the_same_default(argv):
    args = build_parser().parse_args(argv)
    for spec in dataclasses.fields(EngineConfig):
        assert getattr(args, spec.name) == spec.default, spec.name
        flag = "--" + spec.name.replace("_", "-")
        assert flag in build_parser().format_help() and spec.metadata["help"]
    assert config_from_args(args) == EngineConfig()


def test_flags_reach_the_config_with_their_types():
    args = build_parser().parse_args([
        "--device", "cuda:1", "--dtype", "bfloat16", "--block-size", "32", "--num-blocks", "100",
        "--kv-cache-memory", "256MiB", "--gpu-memory-utilization", "0.5", "--swap-space", "0",
        "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--no-enable-prefix-caching", "--preemption-mode", "swap", "--allocator", "contiguous", "--seed", "7"])
    assert config_from_args(args) == EngineConfig(
        device="cuda:1", dtype="bfloat16", block_size=32, num_blocks=100, kv_cache_memory="256MiB",
        gpu_memory_utilization=0.5, swap_space=0, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
        enable_prefix_caching=False, preemption_mode="swap", allocator="contiguous", seed=7)


def test_cuda_n_is_accepted_and_refused_only_when_that_gpu_is_missing(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)     # as on a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status, _, err = run_cli(capsys, "chat", "hi", "--device", "cuda:1", "--num-blocks", "8")
    assert_one_line_error(status, err, "device cuda:1 does not exist", "1 CUDA GPU")


@pytest.mark.parametrize("flag, value, message", [
    ("--device", "gpu", "device must be auto, cpu, cuda or cuda:N"),
    ("--swap-space", "-1", "swap_space"),
    ("--kv-cache-memory", "lots", "kv_cache_memory"),
    ("--gpu-memory-utilization", "2", "gpu_memory_utilization"),
])
def test_bad_engine_flags_are_one_line_errors(capsys, flag, value, message):
    status, _, err = run_cli(capsys, "chat", "hi", flag, value)
    assert_one_line_error(status, err, message)


def test_bench_takes_the_generated_model_and_device_flags():
    args = build_parser().parse_args(["bench", "throughput", "--device", "cuda:1", "--model", "m"])
    assert (args.device, args.model) == ("cuda:1", "m")


# A reply that tries to set the terminal's title, write its clipboard (OSC 52) and clear the screen (CSI as
# the C1 control U+009B), around text whose UTF-8 bytes include 0x80-0x9F: stripping works on characters.
EVIL_REPLY = "Hi \x1b]0;pwned\x07 é€… \x1b]52;c;ZXZpbA==\x07 ok\x9b2J"


def test_chat_prints_the_models_text_without_control_sequences(capsys, monkeypatch, tmp_path):
    import kvscope.engine
    from kvscope.engine.fake_runner import FakeRunner

    class EvilRunner(FakeRunner):
        """Greedy decoding that spells EVIL_REPLY a byte per token, then ends."""
        reply = list(EVIL_REPLY.encode())

        def _next_token(self, context_hash, sample_index, params):
            return self.reply.pop(0) if self.reply else self.tokenizer.eos_token_id

    real = kvscope.engine.LLMEngine
    monkeypatch.setattr(kvscope.engine, "LLMEngine", lambda config: real(config, runner=EvilRunner(config)))
    status, out, err = run_cli(capsys, "chat", "Say something nasty.", "--max-tokens", "64",
                               "--db", str(tmp_path / "runs.db"))
    assert status == 0, err
    assert out == "Hi ]0;pwned é€… ]52;c;ZXZpbA== ok2J\n"


def test_chat_leaves_no_loading_bars_prints_the_banner_as_vllm_does_and_marks_a_cut_reply(tmp_path):
    """Issue 25 defect 12: transformers' "Loading weights" bars stayed on the terminal, the banner read 93200 and
    8192, and a reply cut by --max-tokens just stopped."""
    result = subprocess.run([sys.executable, "-m", "kvscope.app.cli", "chat", "What is a KV cache?", "--max-tokens",
                             "6", "--no-log", "--num-blocks", "2912", "--max-model-len", "1024"],
                            capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "Loading weights" not in result.stderr and "%|" not in result.stderr
    assert "KV cache size: 46,592 tokens (2,912 blocks x 16" in result.stderr
    assert "Maximum concurrency for 1,024 tokens per request: 45.50x" in result.stderr
    assert result.stderr.rstrip().endswith("[max tokens]")           # on stderr: the answer itself stays clean
    assert result.stdout.strip() and "[max tokens]" not in result.stdout


def test_a_reader_that_stops_early_ends_runs_export_quietly(tmp_path):
    """`kvscope runs export 1 | head` printed "cannot write the output: Broken pipe"."""
    from cli_helpers import log_run

    run_id, _ = log_run(tmp_path / "runs.db", 400, seed=1)      # an export far bigger than a pipe's buffer
    export = subprocess.Popen([sys.executable, "-m", "kvscope.app.cli", "runs", "export", str(run_id), "--db",
                               str(tmp_path / "runs.db")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=tmp_path)
    assert export.stdout.read(100)
    export.stdout.close()                                           # as head does once it has its lines
    assert export.wait(timeout=120) == 141
    with export.stderr:
        assert export.stderr.read() == b""


def test_a_reader_that_stops_early_ends_chat_quietly_and_the_run_log_says_aborted(tmp_path):
    from kvscope.app.runlog import RunLogReader

    chat = subprocess.Popen([sys.executable, "-m", "kvscope.app.cli", "chat", "Tell me a long story.", "--max-tokens",
                             "60", "--num-blocks", "64", "--db", str(tmp_path / "runs.db")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert chat.stdout.read(1)
    chat.stdout.close()
    assert chat.wait(timeout=300) == 141
    with chat.stderr:
        assert "Broken pipe" not in chat.stderr.read().decode()
    (run,) = RunLogReader(tmp_path / "runs.db").list_runs()
    (request,) = RunLogReader(tmp_path / "runs.db").rows("requests", run["id"])
    assert run["status"] == "finished" and request["finish_reason"] == "abort"


def test_chat_on_a_pool_smaller_than_one_request_says_so_at_start_naming_the_flag(capsys):
    """As vLLM refuses to start on such a pool, kvscope says at once which flag fits the model to it."""
    status, out, err = run_cli(capsys, "chat", "Hi", "--max-tokens", "2", "--dtype", "float32",
                               "--num-blocks", "8", "--block-size", "16", "--no-log")
    assert status == 0, err
    assert "less than one request of max_model_len" in err and "--max-model-len 128" in err


def test_chat_refuses_a_bad_knob_naming_its_flag_before_loading_the_model(capsys):
    status, _, err = run_cli(capsys, "chat", "hi", "--top-p", "1.5", "--model", "/nonexistent/model")
    assert_one_line_error(status, err, "--top-p: top_p must be in (0, 1]")


def test_the_window_refuses_a_bad_knob_naming_its_flag_before_loading_the_model(capsys):
    status, _, err = run_cli(capsys, "--repetition-penalty", "0", "--model", "/nonexistent/model")
    assert_one_line_error(status, err, "--repetition-penalty: repetition_penalty must be a finite number > 0")


def test_serve_does_not_take_the_chats_knobs(capsys):
    """A server's clients choose their own sampling per request: the chat's knobs are refused there in one line."""
    status, _, err = run_cli(capsys, "serve", "--temperature", "0.5")
    assert_one_line_error(status, err, "does not take --temperature")


def test_the_chats_knobs_reach_its_request_over_the_models_defaults(capsys, tmp_path, monkeypatch):
    from kvscope.engine import LLMEngine

    requested = []
    add_request = LLMEngine.add_request
    def spy(self, prompt, params, **kw):
        requested.append(params)
        return add_request(self, prompt, params, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    status, out, err = run_cli(capsys, "chat", "Say hello.", "--max-tokens", "4", "--device", "cpu",
                               "--num-blocks", "64", "--no-log", "--temperature", "0.7", "--top-k", "20",
                               "--min-p", "0.05", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
                               "--frequency-penalty", "0.25", "--top-p", "0.9")
    assert status == 0, err
    (params,) = requested
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 20, 0.05)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.5, 0.25)
    assert params.max_tokens == 4
