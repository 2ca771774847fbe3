"""The command line: presets, overrides, and refusals at start-up."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from functools import partial

import httpx
import pytest

from engine.config import ConfigError
from server.settings import DEFAULT_DRAFT, ServeSettings
from tests.conftest import REPO, free_port
from tests.faults import fault_marker
from tests.tiny import byte_tokenizer, save_tiny


def test_embedded_preset_loads_and_flags_override_it():
    settings = ServeSettings.load(str(REPO / "configs/smollm2-135m.yaml"), {"num_draft_tokens": 6, "port": 9000})
    assert settings.target is None and settings.resolved_draft == "copy:auto"
    assert settings.num_draft_tokens == 6 and settings.port == 9000 and settings.max_model_len == 4096


@pytest.mark.parametrize("preset", ["qwen2.5-7b.yaml", "llama3.1-8b.yaml"])
def test_gpu_presets_name_a_target_and_a_draft(preset):
    settings = ServeSettings.load(str(REPO / "configs" / preset), {})
    assert settings.target and settings.resolved_draft and settings.device == "cuda"


def test_default_draft_only_for_the_embedded_model():
    assert ServeSettings.load(None, {}).resolved_draft == DEFAULT_DRAFT
    assert ServeSettings.load(None, {"target": "some/model"}).resolved_draft is None
    assert ServeSettings.load(None, {"draft": "none"}).resolved_draft is None


def test_invalid_settings_are_named():
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        ServeSettings.load(None, {"num_draft_tokens": -1})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )


def test_draft_with_a_different_vocabulary_is_refused(tmp_path):
    target = save_tiny(tmp_path / "target", 0, byte_tokenizer())
    draft = save_tiny(tmp_path / "draft", 1, byte_tokenizer(extra_tokens=["<extra>"]))
    result = run_cli("--target", str(target), "--draft", str(draft), "--device", "cpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "vocabulary differs" in result.stderr


def test_missing_model_folder_is_a_clear_error():
    result = run_cli("--target", "./no/such/folder", "--port", str(free_port()))
    assert result.returncode == 2 and "model folder not found" in result.stderr


def test_drafter_flag_selects_the_default_drafter(tiny_model_dirs, tmp_path):
    from openai import OpenAI

    from tests.conftest import start_server, stop_server

    target, _ = tiny_model_dirs
    server = start_server(["--target", str(target), "--drafter", "ngram", "--max-model-len", "128"], tmp_path / "log")
    try:
        client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        response = client.completions.create(model="", prompt="abcabcabcabc", max_tokens=8, temperature=0)
        assert response.usage.model_extra["speculative"]["drafter"] == "ngram"
    finally:
        stop_server(server)
    assert "draft none | drafter ngram" in server.log.read_text()  # no draft model was loaded


def test_every_flag_of_every_command_has_help():
    from server.cli import _parser

    parser = _parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    for name, command in commands.items():
        assert command.description or command.format_usage(), name
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"specserve {name} {action.option_strings[0]} has no help"
        assert f"usage: specserve {name}" in command.format_help()
    # and from a shell, once (each run imports the server: seconds)
    result = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: specserve serve" in result.stdout


def test_the_terminal_chat_client_streams_replies_and_stats(server):
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "chat", "--url", server.url, "--temperature", "0", "--max-tokens", "12"],
        input="hello\n\nand again\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    stats = [line for line in result.stdout.splitlines() if line.startswith("[12 tokens")]
    assert len(stats) == 2 and "accepted" in stats[0]
    assert "HTTP Request" not in result.stdout + result.stderr  # only the conversation and its stats


def _read_until(fd: int, wanted: bytes, timeout: float = 60) -> str:
    """What a terminal shows until ``wanted`` appears (or ``timeout``, or the other side closes)."""
    seen, deadline = b"", time.monotonic() + timeout
    while wanted not in seen and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the program ended
                break
    return seen.decode(errors="replace")


def test_ctrl_c_stops_a_reply_and_at_the_prompt_ends_the_chat_without_a_traceback(server):
    """In a terminal: a prompt marker, Ctrl-C (SIGINT) while a reply streams stops that reply and
    keeps the chat; Ctrl-C at the prompt ends it, exit 0, and neither prints a traceback. Started
    with SIGINT ignored, as a shell starts a background job: the chat takes Ctrl-C back (a full CI
    run once saw a reply run to its end after Ctrl-C, which an inherited ignore would explain)."""
    terminal, child = pty.openpty()
    command = [sys.executable, "-m", "server.cli", "chat", "--url", server.url, "--temperature", "0"]
    ignoring = partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
    chat = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, preexec_fn=ignoring)
    os.close(child)
    try:
        shown = _read_until(terminal, b"> ")
        os.write(terminal, f"tell me more {fault_marker('stall', 2)}\n".encode())  # its step 2 takes 3 s
        time.sleep(1.5)
        chat.send_signal(signal.SIGINT)
        shown += _read_until(terminal, b"[stopped]")
        assert "[stopped]" in shown
        if "> " not in shown.rsplit("[stopped]", 1)[1]:  # the prompt again, unless it came with the line
            shown += _read_until(terminal, b"> ")
        # A person's Ctrl-C comes well after the prompt. One sent the instant it shows can land after
        # readline printed it and before readline waits on the terminal; CPython's readline raises
        # KeyboardInterrupt only when that wait is interrupted, so it then waits for a key (a full CI
        # run once timed out here, 20 s).
        time.sleep(0.3)
        chat.send_signal(signal.SIGINT)
        assert chat.wait(timeout=20) == 0
        shown += _read_until(terminal, b"never shown", timeout=1)
        assert "Traceback" not in shown and "KeyboardInterrupt" not in shown, shown
        assert shown.count("> ") >= 2  # the prompt marker, again after the stopped reply
    finally:
        chat.kill()
        os.close(terminal)


def test_the_chat_client_reports_an_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "chat", "--url", url], input="", capture_output=True, text=True
    )
    assert result.returncode == 1 and "cannot reach" in result.stderr


def test_json_logs_and_the_startup_summary(tiny_model_dirs, tmp_path):
    import json

    from tests.conftest import start_server, stop_server

    target, draft = tiny_model_dirs
    args = ["--target", str(target), "--draft", str(draft), "--device", "cpu", "--log-format", "json"]
    server = start_server(args + ["--max-model-len", "128"], tmp_path / "server.log")
    httpx.get(f"{server.v1}/models", timeout=10)  # an access line (health polls are debug lines)
    stop_server(server)
    records = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= set(record) for record in records)
    summary = next(record["message"] for record in records if record["message"].startswith("ready:"))
    for part in (
        "target on cpu",
        "float32",
        "drafter auto",
        "k=4",
        "KV caches",
        "peak RSS",
        "RSS now",
        "http://127.0.0.1:",
    ):
        assert part in summary, summary
    assert any(record["logger"] == "uvicorn.access" for record in records)  # access lines share the format


def test_loading_reports_each_stage_with_its_size(tiny_model_dirs):
    from engine.config import EngineConfig
    from engine.model.loader import load

    target, draft = tiny_model_dirs
    stages: list[str] = []
    load(EngineConfig(target=str(target), draft=str(draft), device="cpu"), stages.append)
    assert [stage.split()[0] for stage in stages] == ["tokenizer", "target", "draft"]
    assert "params" in stages[1] and "MB float32 on cpu" in stages[2]
