"""The first ten minutes (issue 12): start-up that fails in a line, threads that fit the machine,
drafters that stay available, and output a person can read."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from engine.cpu.threads import cgroup_cpu_limit, usable_cpus
from server.settings import DEFAULT_DRAFT, ServeSettings
from tests.conftest import REPO, free_port, start_server, stop_server

CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # no HF_HUB_OFFLINE: as a user's shell


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``.venv/bin/specserve serve ARGS`` as a user runs it: directly, not through make."""
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--port", str(free_port()), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**CLEAN_ENV, **(env or {})},
    )


def refused_in_a_few_lines(result: subprocess.CompletedProcess, *fragments: str) -> list[str]:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and 1 <= len(lines) <= 4, result.stderr
    assert all(line.startswith("specserve: ") for line in lines), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    return lines


def test_a_hub_model_that_is_not_cached_is_named_with_how_to_get_it(tmp_path):
    result = serve("--target", "Qwen/Qwen2.5-0.5B-Instruct", env={"HF_HOME": str(tmp_path)})
    lines = refused_in_a_few_lines(result, "'Qwen/Qwen2.5-0.5B-Instruct' is not in the local Hugging Face cache")
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in lines[0] and "folder" in lines[0]


def test_a_gpu_preset_on_this_machine_says_what_it_needs(tmp_path):
    result = serve("--config", "configs/llama3.1-8b.yaml", env={"HF_HOME": str(tmp_path)})
    refused_in_a_few_lines(
        result,
        "no CUDA GPU can be used",
        "'meta-llama/Llama-3.1-8B-Instruct' is not in the local Hugging Face cache",
        "configs/llama3.1-8b.yaml needs a CUDA GPU with about 24 GB",
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--drafter", "bogus"], "unknown drafter 'bogus'; available:"),
        (["--self-layers", "0,1,99"], "self_layers: [99] out of range; the target's layers are 0..29"),
        (["--medusa-heads", "no-such-dir"], "medusa_heads: no Medusa head checkpoint at no-such-dir"),
        (["--device", "cuda"], "device 'cuda': no CUDA GPU can be used"),
        (["--threads", "0"], "threads"),
        (["--prefix-cache-gb", "100000"], "prefix_cache_gb 100000 is more than the"),
    ],
)
def test_setting_mistakes_are_caught_before_the_model_loads(args, message):
    result = serve(*args)
    refused_in_a_few_lines(result, message)


def test_a_failure_while_loading_is_one_line_unless_debugging(tmp_path):
    from tests.tiny import byte_tokenizer, save_tiny

    folder = save_tiny(tmp_path / "model", 0, byte_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))  # 32 % 3 != 0
    quiet = serve("--target", str(folder), "--device", "cpu")
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert quiet.stderr.strip().splitlines()[-1].startswith("specserve: ")
    loud = serve("--target", str(folder), "--device", "cpu", "--log-level", "debug")
    assert loud.returncode == 2 and "Traceback" in loud.stderr


# ---- threads -------------------------------------------------------------------------------------


def test_cgroup_quota_is_read_from_v2_and_v1_files(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_cpu_limit(v1) == 0.5
    assert 1 <= usable_cpus() <= len(__import__("os").sched_getaffinity(0))


def test_threads_flag_and_environment_reach_the_engine(tiny_model_dirs, tmp_path):
    target, _ = tiny_model_dirs
    assert ServeSettings.load(None, {}).threads is None
    server = start_server(
        ["--target", str(target), "--max-model-len", "64"], tmp_path / "log", env={"SPECSERVE_THREADS": "1"}
    )
    stop_server(server)
    assert "float32, 1 threads |" in server.log.read_text()
    affinity = subprocess.run(
        [
            "taskset",
            "-c",
            "0",
            sys.executable,
            "-c",
            "from engine.cpu.threads import usable_cpus; print(usable_cpus())",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert affinity.stdout.strip() == "1"  # a narrowed affinity mask is respected


def test_openmp_spins_briefly_unless_the_user_chose(tmp_path):
    code = "import server.cli, os; print(os.environ.get('GOMP_SPINCOUNT'))"

    def spin_count(env: dict) -> str:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env={**CLEAN_ENV, **env}
        ).stdout.strip()

    assert spin_count({}) == "3000"
    assert spin_count({"GOMP_SPINCOUNT": "5"}) == "5"
    assert spin_count({"OMP_WAIT_POLICY": "ACTIVE"}) == "None"  # the user's policy stands


def test_deployments_set_threads_to_their_cpu_limits():
    compose = (REPO / "docker-compose.yml").read_text()
    kubernetes = (REPO / "deploy/kubernetes.yaml").read_text()
    assert "SPECSERVE_THREADS" in compose and "SPECSERVE_THREADS" in kubernetes


# ---- drafters stay available -------------------------------------------------------------------------


def test_the_embedded_default_draft_is_loaded_whatever_the_startup_drafter():
    assert ServeSettings.load(None, {"drafter": "ngram"}).resolved_draft == DEFAULT_DRAFT
    assert ServeSettings.load(None, {"drafter": "self"}).resolved_draft == DEFAULT_DRAFT


@contextlib.contextmanager
def tiny_server(tiny_model_dirs, tmp_path, drafter: str):
    """A server on the tiny target and draft with ``--drafter drafter``, and a client of it."""
    target, draft = tiny_model_dirs
    args = ["--target", str(target), "--draft", str(draft), "--drafter", drafter, "--max-model-len", "128"]
    server = start_server(args, tmp_path / "log")
    try:
        yield server, OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    finally:
        stop_server(server)


def test_per_request_drafters_work_after_a_different_startup_drafter(tiny_model_dirs, tmp_path):
    with tiny_server(tiny_model_dirs, tmp_path, "ngram") as (server, client):
        for drafter in ("model", "staged", "ngram"):
            response = client.completions.create(
                model="", prompt="abcabc", max_tokens=6, temperature=0, extra_body={"speculative": {"drafter": drafter}}
            )
            assert response.usage.model_extra["speculative"]["drafter"] == drafter
        card = httpx.get(f"{server.v1}/models").json()["data"][0]
        assert card["default_drafter"] == "ngram"
        assert set(card["drafters"]) == {"auto", "model", "ngram", "self", "staged", "suffix", "none"}


def test_startup_drafter_none_serves_the_target_alone_unless_a_request_asks(tiny_model_dirs, tmp_path):
    with tiny_server(tiny_model_dirs, tmp_path, "none") as (server, client):
        plain = client.completions.create(model="", prompt="abcabc", max_tokens=6, temperature=0)
        speculative = plain.usage.model_extra["speculative"]
        assert speculative["drafter"] == "none" and speculative["target_forwards"] == 6
        asked = client.completions.create(
            model="", prompt="abcabc", max_tokens=6, temperature=0, extra_body={"speculative": {"drafter": "model"}}
        )
        assert (
            asked.usage.model_extra["speculative"]["drafter"] == "model"
            and asked.choices[0].text == plain.choices[0].text
        )
        assert httpx.get(f"{server.v1}/models").json()["data"][0]["default_drafter"] == "none"
    assert "drafter none (target alone)" in server.log.read_text()


def test_an_unavailable_drafter_is_named_with_what_can_run(tiny_model_dirs, tmp_path):
    target, _ = tiny_model_dirs  # no draft model: model and staged cannot run; no Medusa heads either
    server = start_server(["--target", str(target), "--max-model-len", "64"], tmp_path / "log")
    try:
        for drafter in ("model", "staged"):
            response = httpx.post(f"{server.v1}/completions", json={"prompt": "x", "speculative": {"drafter": drafter}})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "speculative.drafter"
            assert error["message"].startswith(f"drafter '{drafter}' cannot run here")
            runnable = error["message"].split("drafters that can run here: ")[1]
            assert runnable == "auto, ngram, self, suffix, none"
        drafters = httpx.get(f"{server.v1}/models").json()["data"][0]["drafters"]
        assert drafters == ["auto", "ngram", "self", "suffix", "none"]
    finally:
        stop_server(server)


# ---- requests --------------------------------------------------------------------------------------------


def test_a_json_body_is_read_whatever_the_content_type(server):
    body = json.dumps({"prompt": "abc", "max_tokens": 2})
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = httpx.post(f"{server.v1}/completions", content=body, headers=headers)
        assert response.status_code == 200, response.text
    response = httpx.post(f"{server.v1}/completions", content="prompt=abc", headers={"Content-Type": "text/plain"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ---- the first hour, again (issue 26) ---------------------------------------------------------------


def test_a_port_in_use_is_one_line_and_exit_2_before_torch_loads():
    """Decided before the heavy imports: no torch is imported (``-X importtime`` lists every module),
    and with two busy processes on the machine the refusal takes under 5 s."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            started = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-X", "importtime", "-m", "server.cli", "serve", "--port", str(port)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                env=CLEAN_ENV,
            )
            seconds = time.perf_counter() - started
    finally:
        for process in busy:
            process.kill()
    imported = [
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    ]
    assert "server.settings" in imported and not [name for name in imported if name.split(".")[0] == "torch"]
    result.stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    lines = refused_in_a_few_lines(result, f"port {port} on 127.0.0.1 is in use; choose another with --port")
    assert len(lines) == 1 and "loading" not in result.stderr
    assert seconds < 5, seconds


def test_a_context_past_the_models_positions_is_refused_in_one_line():
    result = serve("--max-model-len", "100000")  # the embedded model was trained on 8,192 positions
    lines = refused_in_a_few_lines(result, "max_model_len 100000 exceeds the target's 8192 positions")
    assert len(lines) == 1 and lines[0].endswith("use --max-model-len 8192 or less")


@pytest.mark.parametrize(
    "flag,hint", [("--max-model", "did you mean --max-model-len?"), ("--num-draft", "did you mean --num-draft-tokens?")]
)
def test_a_mistyped_or_abbreviated_serve_flag_is_named_with_the_serve_usage(flag, hint):
    result = serve(flag, "64")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: specserve serve [options]")
    assert f"unrecognized arguments: {flag} 64 ({hint})" in result.stderr
