"""Shared fixtures: a real `specserve serve` process on tiny local models."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.tiny import byte_tokenizer, perturbed_copy, tiny_llama

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def plan_cache_folder(tmp_path_factory) -> Path:
    """The matmul plans this session's engines and servers store (engine/cpu/plan_cache.py) go to a cache
    folder of its own, not the user's; Hugging Face's cache stays where it was."""
    os.environ.setdefault(
        "HF_HOME", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface")
    )
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    return Path(os.environ["XDG_CACHE_HOME"]) / "specserve" / "matmul-plans"


# the embedded target with its shipped EAGLE-3 head, as tests load it (each load reads the GGUF: about 20 s)
EMBEDDED_FLOAT32 = {
    "drafter": "eagle3",
    "num_draft_tokens": 2,
    "max_model_len": 512,
    "device": "cpu",
    "forward": "eager",
    "activations": "float32",
}
EMBEDDED_INT8 = {**EMBEDDED_FLOAT32, "num_draft_tokens": 4, "activations": "int8"}


@pytest.fixture(scope="session")
def embedded() -> Iterator:
    """``embedded(**fields)``: the embedded model loaded with these EngineConfig fields, once a session
    (a test that changes what it holds puts it back)."""
    from engine.config import EngineConfig
    from engine.factory import load_engine

    loaded: dict = {}

    def load(**fields):
        key = tuple(sorted(fields.items()))
        if key not in loaded:
            loaded[key] = load_engine(EngineConfig(**fields), show_progress=False)
        return loaded[key]

    yield load
    loaded.clear()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    health_seen: set[int]  # /health status codes seen while waiting for it to come up

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def start_server(
    args: list[str], log: Path, timeout: float = 180.0, env: dict | None = None, faults: bool = False
) -> Server:
    """``specserve serve ARGS`` in a process of its own; ``faults``: with the fault hook installed
    (tests/fault_server.py), so that a prompt may ask to fail inside the engine."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    module = "tests.fault_server" if faults else "server.cli"
    command = [sys.executable, "-m", module, "serve", "--port", str(port), *args]
    handle = log.open("w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            status = httpx.get(f"{url}/health", timeout=1).status_code
            seen.add(status)
            if status == 200:
                return Server(url, process, log, seen)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not come up in {timeout}s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(20)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random target and a noisy copy of it as the draft, with a byte-level tokenizer."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = byte_tokenizer()
    target = tiny_llama(seed=11, vocab_size=len(tokenizer), hidden=64, init=0.15)
    draft = perturbed_copy(target, noise=0.05, seed=12)
    for name, model in (("target", target), ("draft", draft)):
        model.config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="session")
def server(tiny_model_dirs, tmp_path_factory) -> Iterator[Server]:
    target, draft = tiny_model_dirs
    log = tmp_path_factory.mktemp("logs") / "server.log"
    running = start_server(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--device",
            "cpu",
            "--max-model-len",
            "256",
            "--num-draft-tokens",
            "3",
            # the model drafter, not the server default (auto), whose choices follow measured timings:
            # these tests count drafts and repeat seeded outputs (auto has tests of its own)
            "--drafter",
            "model",
            "--served-model-name",
            "tiny",
            "--seed",
            "0",
        ],
        log,
        faults=True,  # lets tests fail one request inside the engine
    )
    yield running
    stop_server(running)


def copies_read_while_timing(choice_log: str, keeps_bfloat16: bool) -> int:
    """Copies copy:auto reads whole on a start that times its forms (not one that reads its choice
    back), by its log from the timing line to its choice: a form whose estimated step could not pay
    is not read at all; with both left, one read is timed as bfloat16, then as int8 rows, and a
    second is read only to keep bfloat16."""
    ruled_out = choice_log.count("no k pays even if every draft passed")
    return {0: 2 if keeps_bfloat16 else 1, 1: 1, 2: 0}[ruled_out]


def compose_environment(service: str, dotenv: Path = REPO / ".env.example") -> dict[str, str]:
    """The variables ``docker compose`` gives ``service`` of docker-compose.yml, with ``dotenv``
    as the .env file beside it: the service's environment (anchors merged by the YAML loader),
    each ``${NAME:-default}`` read as compose reads it (the default where NAME is unset or empty)."""
    values = {}
    for line in dotenv.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()

    def resolve(text: str) -> str:
        def one(match: re.Match) -> str:
            name, default = match.group(1), match.group(3) or ""
            return values.get(name) or default if match.group(2) else values.get(name, "")

        return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, text)

    environment = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"][service]["environment"]
    return {name: resolve(str(value)) for name, value in environment.items()}


def pytest_collection_finish(session) -> None:
    """Freeze what importing and collecting made (torch, transformers, the tests: 400k objects), so
    that the full collections start-up makes at each stage (``release_freed_memory``, 0.2 s each
    here) walk only what the tests since made: an engine is built hundreds of times in a session."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session) -> None:
    """Thawed before the interpreter exits: frozen objects are never finalized, and triton's
    bindings then print a leak report of each of theirs."""
    import gc

    gc.unfreeze()
