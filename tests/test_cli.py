"""The command line: presets, overrides, and refusals at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import ConfigError
from server.settings import DEFAULT_DRAFT, ServeSettings
from tests.conftest import REPO, free_port
from tests.tiny import byte_tokenizer, save_tiny


def test_embedded_preset_loads_and_flags_override_it():
    settings = ServeSettings.load(str(REPO / "configs/smollm2-135m.yaml"), {"num_draft_tokens": 6, "port": 9000})
    assert settings.target is None and settings.resolved_draft == "copy:bfloat16"
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
    assert "draft None, drafter ngram" in server.log.read_text()  # no draft model was loaded
