"""specserve against Hugging Face transformers on the same model, machine and prompts.

    make bench          # every configuration, every prompt of bench/prompts.yaml, 3 repeats, 6 sampled (~40 min)
    make bench-quick    # one prompt per type, one repeat, 64 tokens

Configurations, run in interleaved order so machine noise hits all alike (each round starting one
configuration further on, so none always runs right after the same other one):
  hf:generate, hf:assisted (bfloat16 copy as assistant), hf:prompt-lookup (5 tokens), in this process;
  llama.cpp (llama-cpp-python on the same GGUF file, same thread count), when it imports;
  serve:default (no speculative settings: the server's default), serve:<drafter>[+adaptive],
  through a ``specserve serve`` subprocess's streaming API (SSE);
  serve-float32:none and serve-float32:default (``--other-drafters``), a second server on the same
  file with the activations the first did not take (``--activations float32`` beside a default
  server that took int8; serve-int8:* beside one that took float32), started once the first is ready
  and then up beside it: the int8 and float32 targets side by side, their greedy outputs each
  checked against their own target-only;
  engine:<drafter>[+adaptive], the engine in this process, to price the HTTP layer (make bench runs
  engine:none: the target alone without the server, as llama.cpp's rows run, for a like-for-like ratio).
Prompt types agentic and multi-turn are conversations run turn by turn, each turn's request
carrying the assistant turns that configuration generated before; each configuration sends its
own ``user``, so what the server keeps across requests (the suffix cache) never crosses them.
Greedy decoding unless --temperature (the server's runs only, with --serve-only); every greedy output
is checked against the target-only output. The types of --sampled-types (chat, open prose) also run
sampled at --sampled-temperature (0.8) on the servers, as "chat@0.8", seeded by the repeat: a seed
means the target's text under every drafter, so those outputs are checked too. --sampled-repeats
runs them more often than --repeats (each seed writes another text, so their rates scatter more);
the repeats past --repeats run in scopes (``user``) where nothing else ran.

Writes bench/results/<name>.json after every round of configurations (marked "partial", with how
far it got, until the end), then the .png and .md (every table), and prints the summary; with
--update-readme the full run also rewrites the README's benchmark section. Each run prints its
progress with an estimate of the time left. The server's log goes to bench/out/ (not tracked).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from host import cpu, measure_read_bandwidth  # noqa: E402
from report import plot, sampled_at, sampled_type, summarise, summary, tables, update_readme  # noqa: E402
from runners import (  # noqa: E402
    Conversation,
    EngineRunner,
    HFRunner,
    LlamaCppRunner,
    Run,
    ServerRunner,
    chat_ids,
    close_servers_on_terminate,
)

from engine.config import EngineConfig  # noqa: E402
from engine.factory import build_engine  # noqa: E402
from engine.model.loader import embedded_gguf, eos_token_ids, load, load_draft  # noqa: E402
from server.settings import DEFAULT_DRAFT  # noqa: E402

BENCH = Path(__file__).resolve().parent
HF_ASSISTANT = "copy:bfloat16"
DRAFTERS = "none,default,suffix,model,ngram,staged,eagle3"  # default is auto: no separate auto row


@dataclass(frozen=True, slots=True)
class Config:
    label: str  # "hf:generate", "llama.cpp", "serve:ngram+adaptive", "engine:none"
    system: str  # hf, llama.cpp, serve or engine
    mode: str  # the HF mode, or the drafter
    adaptive_k: bool = False


def configurations(args: argparse.Namespace) -> list[Config]:
    configs = [] if args.serve_only else [Config(f"hf:{mode}", "hf", mode) for mode in HFRunner.MODES]
    if args.llama_cpp and not args.serve_only:
        configs.append(Config("llama.cpp", "llama.cpp", "llama.cpp"))
    adaptive = set(args.adaptive.split(","))
    for drafter in args.drafters.split(","):
        configs.append(Config(f"serve:{drafter}", "serve", drafter))
        if drafter in adaptive and drafter != "none":
            configs.append(Config(f"serve:{drafter}+adaptive", "serve", drafter, True))
    for drafter in filter(None, args.other_drafters.split(",")):
        configs.append(Config(f"{args.other}:{drafter}", args.other, drafter))
    for name in filter(None, args.in_process.split(",")):
        drafter, _, suffix = name.partition("+")
        configs.append(Config(f"engine:{name}", "engine", drafter, suffix == "adaptive"))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="speed", help="results file stem under bench/results")
    parser.add_argument("--quick", action="store_true", help="one prompt per type, one repeat, 64 tokens")
    parser.add_argument("--drafters", default=DRAFTERS, help="drafters measured through the server")
    parser.add_argument("--adaptive", default="", help="also run these with adaptive k")
    parser.add_argument("--in-process", default="", help="also run these in this process, e.g. none")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="specserve's draft (HF assisted keeps a bfloat16 copy)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per run (default 96; quick 64)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per prompt (default 1)")
    parser.add_argument("--sampled-repeats", type=int, default=None, help="runs per sampled prompt (default --repeats)")
    parser.add_argument("--types", default="chat,prose,code,summarise,long,agentic,multi-turn")
    parser.add_argument(
        "--sampled-types", default="chat,prose", help="also sampled at --sampled-temperature, through the servers"
    )
    parser.add_argument("--sampled-temperature", type=float, default=0.8)
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="the server's sampling (0: greedy, checked)")
    parser.add_argument("--serve-only", action="store_true", help="no HF or llama.cpp rows (sampled runs)")
    parser.add_argument("--server-args", default="", help="more `specserve serve` flags, e.g. '--gguf-blocks off'")
    parser.add_argument(
        "--other-drafters",
        default="none,default",
        help="through a second server with the activations the first did not take ('': none)",
    )
    args = parser.parse_args()
    args.repeats = args.repeats or 1
    args.max_tokens = args.max_tokens or (64 if args.quick else 96)
    prompts = yaml.safe_load((BENCH / "prompts.yaml").read_text())
    types = {kind: kind for kind in args.types.split(",")}  # measured type: the prompts' type
    if args.temperature == 0:  # a sampled run samples every type already
        types |= {
            sampled_type(kind, args.sampled_temperature): kind for kind in filter(None, args.sampled_types.split(","))
        }
    prompts = {measured: prompts[kind][:1] if args.quick else prompts[kind] for measured, kind in types.items()}
    results_dir, logs_dir = BENCH / "results", BENCH / "out"
    results_dir.mkdir(exist_ok=True)
    logs_dir.mkdir(exist_ok=True)
    out = results_dir / f"{args.name}.json"

    bandwidths = [measure_read_bandwidth()]
    close_servers_on_terminate()
    server_args = ["--draft", args.draft, "--num-draft-tokens", str(args.num_draft_tokens), "--log-level", "warning"]
    server_args += args.server_args.split()
    server = ServerRunner(server_args, logs_dir / f"{args.name}-server.log", temperature=args.temperature)
    other = None
    try:
        # The server times its steps and its draft copies at start-up: loading models here meanwhile
        # would make those timings (and what they decide) the ones of a busy host.
        server.wait_ready()
        args.drafters, args.refused = served(server, "serve", args.drafters)
        other = other_server(args, server, server_args, logs_dir) if args.other_drafters else None
        # HF assisted drafts with a bfloat16 copy, its best; the in-process engine with args.draft,
        # built from its own copies (an engine owns its models: packing or quantizing frees the
        # weights as the checkpoint held them, which HF's own runs here still need)
        models = load(EngineConfig(draft=HF_ASSISTANT, max_model_len=4096))
        engine_config = EngineConfig(
            draft=args.draft, drafter="model", num_draft_tokens=args.num_draft_tokens, max_model_len=4096
        )
        draft = copy.deepcopy(models.draft) if args.draft == HF_ASSISTANT else load_draft(engine_config, models.target)
        eos = eos_token_ids(models.target, models.tokenizer)
        engine = build_engine(engine_config, copy.deepcopy(models.target), draft, eos, None, models.target_file)
        runners = {
            "hf": HFRunner(models.target, models.draft, models.tokenizer.eos_token_id),
            "engine": EngineRunner(engine),
            "serve": server,
        }
        if other is not None:
            runners[args.other] = other
        args.llama_cpp = LlamaCppRunner.available() and engine_config.target is None
        if args.llama_cpp:
            runners["llama.cpp"] = LlamaCppRunner(embedded_gguf(), torch.get_num_threads())
        else:
            print("llama.cpp: llama-cpp-python is not importable; no anchor row", file=sys.stderr)
        bandwidths.append(measure_read_bandwidth())  # again with everything loaded and the server idle
        configs = configurations(args)

        def save(runs: dict, progress: str) -> None:  # the runs so far, should the run be cut short
            finished = {kind: by_label for kind, by_label in runs.items() if all(by_label.values())}
            partial = {**report(args, models, engine, server, configs, finished, bandwidths), "partial": True}
            out.write_text(json.dumps({**partial, "progress": progress}, indent=2) + "\n")

        runs = measure(configs, runners, prompts, models.tokenizer, args, save)
        bandwidths.append(measure_read_bandwidth())
    finally:
        server.close()
        if other is not None:
            other.close()
    print("read bandwidth GB/s: " + ", ".join(f"{b / 1e9:.1f}" for b in bandwidths), file=sys.stderr)
    final = report(args, models, engine, server, configs, runs, bandwidths)
    out.write_text(json.dumps(final, indent=2) + "\n")
    plot(final, results_dir / f"{args.name}.png")
    out.with_suffix(".md").write_text(f"# `make bench`: every table of {out.name}\n\n" + tables(final) + "\n")
    text = summary(final, f"bench/results/{args.name}.md")
    print(text)
    if args.update_readme:
        update_readme(BENCH.parent / "README.md", text, args.name)
    print(f"\nwrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.md')}", file=sys.stderr)


def other_server(args, server: ServerRunner, server_args: list[str], logs_dir: Path) -> ServerRunner | None:
    """The second server, on the same file with the activations ``server`` did not take (float32
    beside int8, int8 beside float32), once the first is ready (start-up times what it decides: two
    starting together would time a busy host); None, with the reason said and its configurations
    dropped, where it cannot serve (int8 for a target that is no GGUF file). Its label, in
    ``args.other``: "serve-float32" or "serve-int8"."""
    activations = "float32" if server.activations == "int8" else "int8"
    args.other = f"serve-{activations}"
    runner = ServerRunner(
        [*server_args, "--activations", activations],
        logs_dir / f"{args.name}-server-{activations}.log",
        temperature=args.temperature,
    )
    try:
        runner.wait_ready()
    except RuntimeError as exc:
        runner.close()
        print(f"{args.other}: not measured ({exc})", file=sys.stderr)
        args.other_drafters = ""
        return None
    args.other_drafters, _ = served(runner, args.other, args.other_drafters)
    return runner


def served(server: ServerRunner, label: str, drafters: str) -> tuple[str, dict[str, str]]:
    """Of ``drafters`` (comma-separated), those ``server`` serves, and why it refuses each other
    (a drafter named ``model`` where copy:auto kept no copy), said as it is found."""
    names = drafters.split(",")
    refused = {name: why for name in names if name != "default" and (why := server.refusal(name))}
    for name, why in refused.items():
        print(f"{label}:{name}: not measured, the server refuses it: {why}", file=sys.stderr)
    return ",".join(name for name in names if name not in refused), refused


def report(args, models, engine, server, configs: list[Config], runs: dict, bandwidths: list[float]) -> dict:
    """The results file: the host, the settings, and every configuration's metrics per prompt type."""
    # The machine is shared: its bandwidth drifts. The bound uses the best reading (what it can do).
    bandwidth = max(bandwidths)
    bound_s = engine.target.weight_bytes / bandwidth
    return {
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu": cpu(),
            "llama_cpp": args.llama_cpp,
            "torch_threads": torch.get_num_threads(),
            "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "read_bandwidth_readings_gb_s": [round(b / 1e9, 2) for b in bandwidths],
        },
        "torch": torch.__version__,
        "model": models.target_name,
        "weight_bytes": engine.target.weight_bytes,
        "bound_ms_per_forward": round(bound_s * 1e3, 2),
        "settings": {
            k: getattr(args, k)
            for k in (
                "draft",
                "num_draft_tokens",
                "max_tokens",
                "repeats",
                "sampled_repeats",
                "quick",
                "temperature",
                "server_args",
                "other_drafters",
            )
        },
        "server_draft": server.draft,  # what the server loaded (copy:auto's choice)
        "server_activations": server.activations,  # what its target's products multiply (--activations auto's choice)
        "refused": args.refused,  # drafters the server would not run (no draft kept), and why
        "date": time.strftime("%Y-%m-%d"),
        **summarise(configs, runs, bound_s),
    }


def measure(
    configs: list[Config], runners: dict, prompts: dict, tokenizer, args, save
) -> dict[str, dict[str, list[Run]]]:
    """runs[prompt type][config label] -> every run of that pair, prompts (or turns) x repeats.
    ``save(runs, progress)`` is called after every round of configurations."""
    by_kind = {kind: kind_configs(configs, kind) for kind in prompts}
    runs: dict[str, dict[str, list[Run]]] = {kind: {c.label: [] for c in by_kind[kind]} for kind in prompts}
    repeats = {kind: repeats_of(kind, args) for kind in prompts}
    total = sum(
        repeats[kind] * len(Conversation.of(entry).turns) * len(by_kind[kind])
        for kind, entries in prompts.items()
        for entry in entries
    )
    done, started = 0, time.monotonic()
    for repeat in range(max(repeats.values(), default=0)):
        for kind, entries in prompts.items():
            if repeat >= repeats[kind]:
                continue
            # a sampled type ("chat@0.8"): seeded, so every drafter of a target writes that target's text
            temperature = sampled_at(kind)
            sampling = None if temperature is None else {"temperature": temperature, "seed": repeat}
            for index, entry in enumerate(entries):
                conversation = Conversation.of(entry)
                histories = {config.label: list(conversation.opening) for config in by_kind[kind]}
                for turn, user_text in enumerate(conversation.turns):
                    # interleaved: every configuration on this turn, then the next; each round starts one
                    # configuration further on, so none always runs right after the same other one
                    for config in rotated(by_kind[kind], repeat + index + turn):
                        messages = histories[config.label] + [{"role": "user", "content": user_text}]
                        prompt_ids = chat_ids(tokenizer, messages)
                        user = f"{config.label}#{repeat}"  # one tenant per configuration and repeat
                        run = run_one(config, runners, prompt_ids, args.max_tokens, user, sampling)
                        run.position = (index, turn)
                        if run.text is None:
                            run.text = tokenizer.decode(run.token_ids, skip_special_tokens=True)
                        histories[config.label] = messages + [{"role": "assistant", "content": run.text}]
                        runs[kind][config.label].append(run)
                        done += 1
                        print(
                            f"[{done}/{total}, {_eta(started, done, total)} left] {kind}#{index}.{turn} "
                            f"{config.label:24s} {run.decode_tokens_per_s:6.1f} tok/s  ttft {run.ttft_s * 1e3:6.0f} ms",
                            file=sys.stderr,
                        )
                    save(runs, f"{done} of {total} runs")
    return runs


def repeats_of(kind: str, args) -> int:
    """Runs per prompt of a type: --repeats, and --sampled-repeats for a sampled one ("chat@0.8"),
    whose seeds write a different text each repeat, so its rates scatter more."""
    return args.sampled_repeats if args.sampled_repeats and sampled_at(kind) is not None else args.repeats


def rotated(configs: list, shift: int) -> list:
    """``configs`` starting ``shift`` places on (wrapping round)."""
    shift %= max(len(configs), 1)
    return configs[shift:] + configs[:shift]


def _eta(started: float, done: int, total: int) -> str:
    """The time the remaining runs should take at the pace so far, as "4m05s"."""
    seconds = round((time.monotonic() - started) / done * (total - done))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def kind_configs(configs: list[Config], kind: str) -> list[Config]:
    """The configurations a prompt type runs on: a sampled type ("chat@0.8") on the servers only
    (transformers' and llama.cpp's rows decode greedily here)."""
    return [config for config in configs if sampled_at(kind) is None or config.system.startswith("serve")]


def run_one(
    config: Config, runners: dict, prompt_ids: list[int], max_tokens: int, user: str, sampling: dict | None = None
) -> Run:
    runner = runners[config.system]
    if config.system in ("hf", "llama.cpp"):
        return runner.run(config.mode, prompt_ids, max_tokens)
    return runner.run(config.mode, config.adaptive_k, prompt_ids, max_tokens, user, sampling)


if __name__ == "__main__":
    main()
