"""The three ways the benchmark generates: Hugging Face ``generate``, the engine in-process, and the
HTTP server over SSE. Each returns a ``Run`` with per-token arrival times, so all are measured alike."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from transformers.generation.streamers import BaseStreamer

from engine.cpu.memory import high_water_bytes
from engine.engine import SpecEngine
from engine.request import Request
from engine.sampling import SamplingParams

# Tokens that arrive within this long of the first arrived with it: one ``put`` of a generate
# streamer, or the SSE chunks of one engine step read back to back. A forward takes 25 ms or more.
SAME_ARRIVAL_S = 0.001


@dataclass(slots=True)
class Run:
    started: float
    token_times: list[float] = field(default_factory=list)  # arrival time of each generated token
    token_ids: list[int] | None = None
    text: str | None = None
    acceptance_rate: float | None = None
    tokens_per_forward: float | None = None  # mean accepted length + 1 (the target's own token)
    target_forwards: int | None = None  # decode-time forwards of the target, prefill excluded
    num_draft_tokens: float | None = None
    steps_by_drafter: dict[str, int] = field(default_factory=dict)  # auto's choices: who drafted each step
    cached_tokens: int = 0
    peak_rss_mb: float | None = None
    position: tuple[int, int] = (0, 0)  # (prompt, turn) of its type it ran: its repeats are pooled (report.pooled_rate)

    @property
    def num_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.started

    @property
    def decode_seconds(self) -> float:
        return self.token_times[-1] - self.token_times[0]

    @property
    def request_seconds(self) -> float:
        """The whole request's time, prefill included, to its last token."""
        return self.token_times[-1] - self.started if self.token_times else 0.0

    @property
    def request_tokens_per_s(self) -> float:
        """Tokens over the whole request, prefill included (prefix reuse counts here)."""
        return self.num_tokens / self.request_seconds if self.request_seconds > 0 else 0.0

    @property
    def first_arrival(self) -> int:
        """How many tokens arrived with the first (assisted generate streams its whole first round,
        the draft's prefill included, as one ``put``)."""
        return sum(1 for t in self.token_times if t - self.token_times[0] <= SAME_ARRIVAL_S)

    @property
    def decoded_tokens(self) -> int:
        """The tokens after the first arrival (decode_seconds made them)."""
        return self.num_tokens - self.first_arrival

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first arrival over the time since it: decoding speed, prefill excluded.
        Counting the first arrival's extra tokens as decoded in no time would credit a system with
        tokens it made before its first one arrived (an earlier run read hf:assisted at 3.9x
        target-only on agentic that way, with a TTFT of 8.6 s)."""
        later = self.decoded_tokens
        return later / self.decode_seconds if later > 0 and self.decode_seconds > 0 else 0.0

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


class PeakRSS:
    """A process's peak resident memory, reset before each run (Linux: /proc/PID/clear_refs)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def reset(self) -> None:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux, or not allowed: the figure is then the process's lifetime peak

    def read_mb(self) -> float | None:
        peak = high_water_bytes(self.pid)
        return None if peak is None else peak / 2**20


class _Arrivals(BaseStreamer):
    """A ``generate`` streamer that timestamps every new token (the first ``put`` is the prompt)."""

    def __init__(self, run: Run) -> None:
        self.run, self.token_ids, self._prompt_seen = run, [], False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter()
        ids = value.reshape(-1).tolist()
        self.token_ids += ids
        self.run.token_times += [now] * len(ids)

    def end(self) -> None:
        pass


class HFRunner:
    """Hugging Face ``generate`` in its three modes, on the very models the engine wraps."""

    MODES = ("generate", "assisted", "prompt-lookup")

    def __init__(self, target: torch.nn.Module, assistant: torch.nn.Module | None, eos_token_id: int) -> None:
        self.target, self.assistant, self.eos_token_id = target, assistant, eos_token_id
        self.rss = PeakRSS(os.getpid())

    def run(self, mode: str, prompt_ids: list[int], max_tokens: int) -> Run:
        extra: dict = {}
        if mode == "assisted":
            extra["assistant_model"] = self.assistant
        elif mode == "prompt-lookup":
            extra["prompt_lookup_num_tokens"] = 5
        input_ids = torch.tensor([prompt_ids], device=self.target.device)
        self.rss.reset()
        run = Run(time.perf_counter())
        streamer = _Arrivals(run)
        with torch.inference_mode():
            self.target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.eos_token_id,
                streamer=streamer,
                **extra,
            )
        run.token_ids = streamer.token_ids[:max_tokens]
        run.peak_rss_mb = self.rss.read_mb()
        return run


@dataclass(frozen=True, slots=True)
class Conversation:
    opening: tuple[dict, ...]  # messages before the first measured turn (a system prompt)
    turns: tuple[str, ...]  # user messages, one request each

    @staticmethod
    def of(entry: str | dict) -> Conversation:
        """A single prompt is a one-turn conversation; a sequence has a system prompt and turns."""
        if isinstance(entry, str):
            return Conversation((), (entry,))
        opening = ({"role": "system", "content": entry["system"]},) if entry.get("system") else ()
        return Conversation(opening, tuple(entry["turns"]))

    def first_request(self) -> list[dict]:
        """The messages of its first request: the opening, then the first user turn."""
        return [*self.opening, {"role": "user", "content": self.turns[0]}]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation as the chat template renders it, ready for the assistant's turn: token ids."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


class EngineRunner:
    """The engine in this process, from an empty cache each run (no prefix reuse)."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.rss = PeakRSS(os.getpid())

    def run(
        self,
        drafter: str,
        adaptive_k: bool,
        prompt_ids: list[int],
        max_tokens: int,
        user: str = "",
        sampling: dict | None = None,
    ) -> Run:
        """``sampling``: the request's sampling fields (temperature, top_p, seed...); None: greedy."""
        self.engine.reset()
        params = SamplingParams(max_tokens=max_tokens, **(sampling or {"temperature": 0.0}))
        drafter = None if drafter == "default" else drafter
        request = Request("bench", prompt_ids, params, drafter=drafter, adaptive_k=adaptive_k, tenant=user)
        self.rss.reset()
        run = Run(time.perf_counter())
        run.token_ids = []
        for output in self.engine.generate(request):
            now = time.perf_counter()
            run.token_ids += output.token_ids
            run.token_times += [now] * len(output.token_ids)
        _take_stats(run, output.stats.to_dict())
        run.peak_rss_mb = self.rss.read_mb()
        return run


def _take_stats(run: Run, spec: dict) -> None:
    """``spec``: the request's speculative statistics, as ``usage.speculative`` reports them."""
    run.acceptance_rate, run.tokens_per_forward = spec["acceptance_rate"], spec["mean_tokens_per_forward"]
    run.target_forwards = max(spec["target_forwards"] - 1, 0)  # the prefill's forward comes before the first token
    run.num_draft_tokens = spec["mean_num_draft_tokens"]
    run.steps_by_drafter = dict(spec.get("steps_by_drafter") or {})


def close_servers_on_terminate() -> None:
    """Make SIGTERM (kill, pkill) end a bench through its ``finally`` blocks, which close its
    servers: by default it ends the process at once and leaves each ``specserve serve`` running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def sse_events(client: httpx.Client, path: str, body: dict) -> Iterator[dict]:
    """The JSON events of a streamed request, as they arrive; an error event raises."""
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']}")
            yield event


class ServerRunner:
    """``specserve serve`` in a subprocess, measured through its streaming completions API."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        startup_timeout: float = 300.0,
        temperature: float = 0.0,
        one_slot: bool = True,
    ) -> None:
        """``one_slot``: one sequence slot and no prefix store, so that ``run``'s forgetting request
        leaves nothing of the last prompt (bench/conversations.py measures the slots themselves)."""
        self.temperature = temperature  # every request's; 0: greedy
        if one_slot:
            args = [*args, "--max-num-seqs", "1", "--prefix-cache-gb", "0"]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *args]
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.rss = PeakRSS(self.process.pid)
        self.client = httpx.Client(base_url=self.base, timeout=600)
        self._startup_timeout = startup_timeout
        self.draft: str | None = None  # what /v1/models says the server loaded, once it is ready
        self.activations: str | None = None  # and what its target's products multiply ("float32", "int8")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self._log.name}")
            try:
                if self.client.get("/health").status_code == 200:
                    card = self.client.get("/v1/models").json()["data"][0]
                    self.draft, self.activations = card.get("draft"), card.get("activations")
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become healthy in time")

    def run(
        self,
        drafter: str,
        adaptive_k: bool,
        prompt_ids: list[int],
        max_tokens: int,
        user: str = "",
        sampling: dict | None = None,
    ) -> Run:
        """``drafter`` "default" sends no speculative settings: the server's own choice. ``user``
        scopes what drafters keep across requests (the suffix cache) to one configuration's runs.
        ``sampling``: request fields that replace the runner's temperature (a seed, say)."""
        body = {
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "repetition_penalty": 1.0,  # plain decoding, whatever the model's defaults: greedy is checked against HF's
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": user,
            **(sampling or {}),
        }
        if drafter != "default":
            body["speculative"] = {"drafter": drafter, "adaptive_k": adaptive_k}
        self._forget_prompts(prompt_ids)
        self.rss.reset()
        run = Run(time.perf_counter())
        pieces: list[str] = []
        usage = None
        for event in sse_events(self.client, "/v1/completions", body):
            if event.get("choices"):
                run.token_times.append(time.perf_counter())  # one token per chunk
                pieces.append(event["choices"][0]["text"])
            usage = event.get("usage") or usage
        run.text = "".join(pieces)
        if usage is not None:
            _take_stats(run, usage["speculative"])
            run.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        run.peak_rss_mb = self.rss.read_mb()
        return run

    def refusal(self, drafter: str) -> str | None:
        """Why the server answers a request for ``drafter`` 400 (a drafter named ``model`` where
        copy:auto kept no copy), or None where it serves it: asked with a one-token request."""
        body = {"prompt": [1], "max_tokens": 1, "user": "bench-probe", "speculative": {"drafter": drafter}}
        response = self.client.post("/v1/completions", json=body)
        if response.status_code == 400:
            return response.json()["error"]["message"]
        response.raise_for_status()
        return None

    def _forget_prompts(self, prompt_ids: list[int]) -> None:
        """Leave nothing of ``prompt_ids`` in the server's prefix cache, so that every run reads its
        whole prompt, as HF's and llama.cpp's runs do: the configurations take turns on one server,
        and each would otherwise find the prompt the one before it just read. (A one-token request
        of another token; the target alone, so no drafter's state moves.)"""
        other = 1 if prompt_ids[0] != 1 else 2
        body = {"prompt": [other], "max_tokens": 1, "user": "bench-forget", "speculative": {"drafter": "none"}}
        self.client.post("/v1/completions", json=body).raise_for_status()

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python on the same GGUF file: an anchor, not a dependency.
    ``available()`` is False unless the package imports (it builds from source in about 15 minutes)."""

    MODES = ("llama.cpp",)

    def __init__(self, gguf_path: Path, threads: int, context: int = 4096) -> None:
        from llama_cpp import Llama

        self.model = Llama(model_path=str(gguf_path), n_threads=threads, n_ctx=context, verbose=False)
        self.rss = PeakRSS(os.getpid())

    @staticmethod
    def available() -> bool:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return False
        return True

    def run(self, mode: str, prompt_ids: list[int], max_tokens: int) -> Run:
        self.model.reset()  # no prefix reuse between runs, as for the other configurations
        self.rss.reset()
        run = Run(time.perf_counter())
        pieces: list[str] = []
        for chunk in self.model.create_completion(
            prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0, top_k=1, stream=True
        ):
            run.token_times.append(time.perf_counter())
            pieces.append(chunk["choices"][0]["text"])
        run.text = "".join(pieces)
        run.peak_rss_mb = self.rss.read_mb()
        return run
