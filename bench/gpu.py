"""Step costs of speculative decoding on one GPU, eager against CUDA graphs, with random-weight
models built from configs (no download).

    bash bench/gpu.sh                 # Llama-3-8B-shaped target, Llama-3.2-1B-shaped draft, bf16 and fp16
    python bench/gpu.py --smoke       # tiny models on CPU (compiled instead of captured): checks the script

Random weights make acceptance meaningless, so this measures what does not depend on it, for each
dtype and each way of running the forward (``CONFIGURATIONS``: eager; CUDA graphs as
``engine/model/runner.py`` captures them, with eager pointwise kernels; the same graphs with the pointwise
kernels compiled by ``engine/model/kernels.py``, the engine's default on a GPU):
- the target's 1-token step, its verify at k + 1 = 2..9 tokens, and the draft's 1-token step;
- the achieved fraction of the HBM bound (weight bytes over measured read bandwidth);
- tokens/s when acceptance is forced to 0.6, 0.8 and 1.0 (k = 4): each step runs the real
  forwards (k draft steps fed their own argmax on the device, one verify of k + 1 tokens, one
  transfer to the host), then rolls both caches back to a number of accepted tokens drawn from
  the truncated geometric law of that rate; and the tokens/s that the step costs predict;
- an EAGLE-3-shaped random head beside the draft (draft vocabulary 32,000): its step over the
  target's, and tokens/s at forced acceptance 0.8 drafting with it;
- what the attention window costs: the 1-token step at 4k and 32k cache sizes, near the start
  and near the end of the cache (reads should follow the live context, not the cache size).
Writes one JSON file (bench/results/gpu.json, or $OUT/gpu.json when OUT is set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.adaptive import expected_tokens
from engine.drafters.eagle3_head import Eagle3Head, default_aux_layers
from engine.model.model import CausalLM
from engine.model.runner import GraphRunner
from engine.model.timing import median_seconds, synchronize

SHAPES = {
    # Llama-3-8B and Llama-3.2-1B shapes (same 128k vocabulary)
    "target": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    "draft": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    ),
}
SMOKE_SHAPES = {
    "target": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    "draft": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
# an EAGLE-3-shaped head for the target: one layer of its shape, a 32,000-token draft vocabulary
HEAD_DRAFT_VOCAB = {"full": 32000, "smoke": 200}
ALPHAS = (0.6, 0.8, 1.0)
# name -> (forward mode, pointwise kernels): on a GPU, and with --smoke on CPU (compiled, not captured)
CONFIGURATIONS = {
    "eager": ("eager", "eager"),
    "cuda-graphs": ("cuda-graphs", "eager"),
    "cuda-graphs+compiled-kernels": ("cuda-graphs", "compiled"),
}
SMOKE_CONFIGURATIONS = {
    "eager": ("eager", "eager"),
    "compile": ("compile", "eager"),
    "compile+compiled-kernels": ("compile", "compiled"),  # the GPU default's analogue: a runner, fused kernels
}


def build(shape: dict, vocab: int, device: torch.device, dtype: torch.dtype, max_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=max(8192, max_len), rope_theta=500000.0, **shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    return model


def read_bandwidth(device: torch.device, megabytes: int) -> float:
    data = torch.ones(megabytes * 2**20 // 2, dtype=torch.bfloat16, device=device)
    return data.nbytes / median_seconds(lambda: data.sum(), device, 9)


def step_cost(model: CausalLM, context: int, new_tokens: int, device: torch.device, repeats: int) -> float:
    """Seconds for one forward of ``new_tokens`` after ``context`` cached tokens."""
    tokens = torch.ones(new_tokens, dtype=torch.long, device=device)

    def run() -> None:
        model.cache.rollback(context)
        model.extend(tokens, num_logits=new_tokens)

    return median_seconds(run, device, repeats)


def forced_acceptance(
    target: CausalLM, draft: CausalLM, context: int, k: int, alpha: float, new_tokens: int, device, seed: int
) -> float:
    """Tokens/s decoding ``new_tokens`` with real forwards, accepting truncated-geometric(alpha) drafts."""
    draws = random.Random(seed)
    target.cache.rollback(context)
    draft.cache.rollback(context)
    pending = torch.ones(1, dtype=torch.long, device=device)  # [1] the token the target has not seen
    produced = 0
    synchronize(device)
    start = time.perf_counter()
    while produced < new_tokens:
        base = target.cache.length
        drafted, token = [], pending
        for _ in range(k):  # the draft proposes k tokens, one forward each, never waiting for the host
            token = draft.extend(token).argmax(-1)  # [1]
            drafted.append(token)
        logits = target.extend(torch.cat([pending, *drafted]), num_logits=k + 1)  # [k+1, V]
        logits[:, :8].argmax(-1).tolist()  # the step's one transfer to the host (the verdict)
        accepted = 0
        while accepted < k and draws.random() < alpha:
            accepted += 1
        target.cache.rollback(base + accepted + 1)
        draft.cache.rollback(min(draft.cache.length, base + accepted + 1))
        produced += accepted + 1
    synchronize(device)
    return produced / (time.perf_counter() - start)


def random_head(target: CausalLM, draft_vocab: int) -> Eagle3Head:
    """A random EAGLE-3 head shaped for ``target``: features of layers 2, L/2 and L-3."""
    config = {
        "hidden_size": target.config.hidden_size,
        "intermediate_size": target.config.intermediate_size,
        "num_attention_heads": target.config.num_attention_heads,
        "num_key_value_heads": target.config.num_key_value_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
    }
    head = Eagle3Head(config, target, default_aux_layers(len(target.layers)), False)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    head.d2t.copy_(torch.arange(draft_vocab) * (target.vocab_size // draft_vocab) - torch.arange(draft_vocab))
    return head.finish()


def head_costs(target: CausalLM, head: Eagle3Head, args, device, target_step: float) -> dict:
    """The head's 1-token step (eager) after ``args.context`` committed entries, next to the
    target's step, and tokens/s at forced acceptance 0.8 drafting with it (the target's verify as
    the runner prepared it; each step also reads the accepted positions' features)."""
    features = target.feature_rows(0, args.context)  # [C, A*E] what the target kept for the context
    head.cache.rollback(0)
    head.step(torch.ones(args.context, dtype=torch.long, device=device), head.fuse(features))
    head.cache.append(args.context)
    feature = head.fuse(features[-1:])  # [1, H]

    def one_step() -> None:
        head.cache.rollback(args.context)
        head.step(torch.ones(1, dtype=torch.long, device=device), feature)

    step = median_seconds(one_step, device, args.repeats)
    draws, k = random.Random(7), args.k
    target.cache.rollback(args.context)
    head.cache.rollback(args.context)
    pending = torch.ones(1, dtype=torch.long, device=device)
    produced = 0
    synchronize(device)
    start = time.perf_counter()
    while produced < args.new_tokens:
        base = target.cache.length
        drafted, token, own = [], pending, feature
        for _ in range(k):
            logits, own = head.step(token, own)
            head.cache.append(1)
            token = logits.argmax(-1)  # [1]
            drafted.append(token)
        target.extend(torch.cat([pending, *drafted]), num_logits=k + 1)[:, :8].argmax(-1).tolist()
        accepted = 0
        while accepted < k and draws.random() < 0.8:
            accepted += 1
        target.cache.rollback(base + accepted + 1)
        head.cache.rollback(base)  # the head re-reads the accepted positions from the target's features
        head.step(
            torch.ones(accepted + 1, dtype=torch.long, device=device),
            head.fuse(target.feature_rows(base, base + accepted + 1)),
        )
        head.cache.append(accepted + 1)
        produced += accepted + 1
    synchronize(device)
    rate = produced / (time.perf_counter() - start)
    return {
        "head_params_m": round(sum(p.numel() for p in head.parameters()) / 1e6, 1),
        "head_step_ms": round(step * 1e3, 3),
        "head_over_target_step": round(step / target_step, 3),
        "forced_acceptance_0.8_tokens_per_s": round(rate, 1),
        "speedup_at_0.8": round(rate * target_step, 3),
    }


def prepare(model: CausalLM, mode: str, kernels: str, max_query: int, backend: str) -> None:
    """Run ``model``'s forwards in ``mode`` with ``kernels``, compiled and captured now; the cached
    context is fed again after (warming up writes scratch keys and values at the first positions)."""
    context = model.cache.length
    model.runner = None
    model.use_kernels(kernels, backend)
    if kernels == "compiled":  # before any capture, as the engine's warm-up does
        model.warm_up_kernels()
    if mode != "eager":
        model.runner = GraphRunner(model, mode, max_query=max_query, backend=backend)
        if mode == "cuda-graphs":
            model.runner.warm_up([model.all_layers])
    model.cache.rollback(0)
    if context:
        model.extend(torch.ones(context, dtype=torch.long, device=model.device))  # a prefill: eager


def kernels_per_step(model: CausalLM, device: torch.device) -> int | None:
    """CUDA kernels (and copies) one eager 1-token forward launches, by the profiler; None on CPU
    or where the profiler records no device events."""
    if device.type != "cuda":
        return None
    runner, model.runner = model.runner, None
    context = model.cache.length
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            model.extend(torch.ones(1, dtype=torch.long, device=device))
            synchronize(device)
        launched = sum(1 for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as error:  # a profiler without CUPTI, say: the count is informative, not needed
        print("kernel count unavailable:", error, flush=True)
        launched = 0
    finally:
        model.cache.rollback(context)
        model.runner = runner
    return launched or None


def measure_mode(
    target: CausalLM, draft: CausalLM, configuration: tuple[str, str], args, device, bandwidth: float
) -> dict:
    """Every step cost with forwards run in ``configuration`` (forward mode, pointwise kernels)."""
    mode, kernels = configuration
    started = time.perf_counter()
    prepare(target, mode, kernels, args.max_verify, args.backend)
    prepare(draft, mode, kernels, args.k + 2, args.backend)
    prepared = time.perf_counter() - started
    repeats = args.repeats
    one = step_cost(target, args.context, 1, device, repeats)
    verify = {n: step_cost(target, args.context, n, device, repeats) for n in range(2, args.max_verify + 1)}
    draft_step = step_cost(draft, args.context, 1, device, repeats)
    bound = target.weight_bytes / bandwidth
    k = args.k
    measured = {
        str(alpha): round(forced_acceptance(target, draft, args.context, k, alpha, args.new_tokens, device, 7), 1)
        for alpha in ALPHAS
    }
    step = k * draft_step + verify[k + 1]
    result = {
        "prepare_seconds": round(prepared, 2),
        "variants": 0 if target.runner is None else target.runner.num_variants + draft.runner.num_variants,
        "kernel_compilations": sum(sum(m.kernels.compilations.values()) for m in (target, draft)),
        # launched per eager forward with these kernels (a graph replays the same ones)
        "kernels_per_target_step": kernels_per_step(target, device),
        "kernels_per_draft_step": kernels_per_step(draft, device),
        "target_step_1_ms": round(one * 1e3, 3),
        "verify_ms": {str(n): round(s * 1e3, 3) for n, s in verify.items()},
        "draft_step_ms": round(draft_step * 1e3, 3),
        "hbm_fraction_target_step": round(bound / one, 3),
        "draft_over_target_step": round(draft_step / one, 3),
        f"verify_{k + 1}_over_target_step": round(verify[k + 1] / one, 3),
        "target_only_tokens_per_s": round(1 / one, 1),
        "predicted_tokens_per_s": {str(a): round(expected_tokens(a, k) / step, 1) for a in ALPHAS},
        "forced_acceptance_tokens_per_s": measured,
    }
    result["predicted_speedup_at_0.8"] = round(
        result["predicted_tokens_per_s"]["0.8"] / result["target_only_tokens_per_s"], 3
    )
    if args.head is not None:
        result["eagle3_head"] = head_costs(target, args.head, args, device, one)
    if device.type == "cuda":
        result["reserved_mib"] = round(torch.cuda.memory_reserved(device) / 2**20)
    return result


def targets(result: dict, k: int) -> dict:
    """Issue 14's four targets, against one configuration's measurements."""
    checks = {
        "target_step_hbm_fraction_at_least_0.70": (result["hbm_fraction_target_step"], 0.70, "min"),
        "draft_step_at_most_0.15_target_step": (result["draft_over_target_step"], 0.15, "max"),
        f"verify_{k + 1}_at_most_1.15_target_step": (result[f"verify_{k + 1}_over_target_step"], 1.15, "max"),
        "predicted_speedup_at_0.8_at_least_2": (result["predicted_speedup_at_0.8"], 2.0, "min"),
    }
    return {
        name: {"value": value, "met": value >= bound if side == "min" else value <= bound}
        for name, (value, bound, side) in checks.items()
    }


def window_costs(hf_model, device, configuration: tuple[str, str], args) -> dict:
    """The target's 1-token step near the start and near the end of 4k and 32k caches: with
    attention as the runner chooses it per window (``choose_attention``: one SDPA call, or split),
    and with one SDPA call everywhere; and the runner's per-layer attention timings."""
    out: dict = {}
    mode, kernels = configuration
    for max_len in args.window_cache_sizes:
        model = CausalLM(hf_model, max_len)
        model.use_kernels(kernels, args.backend)
        runners: dict[str, GraphRunner | None] = {"": None}
        if mode != "eager":
            chosen = GraphRunner(model, mode, max_query=1, backend=args.backend)
            chosen.choose_attention()
            fused = GraphRunner(model, mode, max_query=1, backend=args.backend)
            fused.attention = dict.fromkeys(fused.windows, 0)
            runners = {"": chosen, "_sdpa": fused}
            out[f"cache_{max_len}_attention_ms"] = {
                str(window): {
                    "sdpa": timed[0],
                    "split": timed[1],
                    "chosen": "split" if chosen.attention[window] else "sdpa",
                }
                for window, timed in chosen.attention_ms.items()
            }
        model.extend(torch.ones(min(512, max_len // 2), dtype=torch.long, device=device))
        for context in sorted({min(512, max_len // 2), max_len - 16}):
            model.runner = None  # fill the cache (prefill in chunks, eagerly)
            while model.cache.length < context:
                model.extend(torch.ones(min(2048, context - model.cache.length), dtype=torch.long, device=device))
            for suffix, runner in runners.items():
                model.runner = runner
                out[f"cache_{max_len}_context_{context}{suffix}_ms"] = round(
                    step_cost(model, context, 1, device, args.repeats) * 1e3, 3
                )
        del model, runners
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def engine_check(device: torch.device, dtypes: list[torch.dtype], graphs: str, args) -> dict:
    """The engine itself on this device: a small random-weight target and a perturbed copy as draft.
    Greedy speculative output with the runner's variants against eager target-only output (float32
    must match token for token; half precision reports agreement), and host syncs per step, counted
    by torch's sync debug mode (the verdict's one transfer should be the only one)."""
    import copy
    import traceback
    import warnings
    from collections import Counter

    from engine.config import EngineConfig
    from engine.factory import build_engine, warm_up
    from engine.request import Request
    from engine.sampling import SamplingParams

    shape = dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
    )
    results = {}
    for dtype in [torch.float32, *dtypes]:
        torch.manual_seed(1)
        target_hf = build(shape, 2048, device, dtype, 1024)
        for param in target_hf.parameters():  # larger weights: logits spread enough that greedy has few ties
            param.data.mul_(4.0)
        draft_hf = copy.deepcopy(target_hf)
        for param in draft_hf.parameters():
            param.data.add_(torch.randn_like(param) * 0.01)
        prompt = [random.Random(2).randrange(2048) for _ in range(40)]
        params = SamplingParams(max_tokens=24 if args.smoke else 96, temperature=0.0, ignore_eos=True)
        outputs, syncs = {}, {}
        for name, forward, drafter in (("eager-target-only", "eager", "none"), ("graphs-model", graphs, "model")):
            config = EngineConfig(
                drafter=drafter,
                num_draft_tokens=args.k,
                forward=forward,
                max_model_len=1024,
                compile_backend=args.backend,
            )
            engine = build_engine(config, target_hf, None if drafter == "none" else draft_hf, set())
            warm_up(engine)
            list(engine.generate(Request("warm", prompt, params, drafter=drafter)))  # compile/capture stragglers
            sites: Counter = Counter()

            def record(message, category, filename, lineno, file=None, line=None, sites=sites) -> None:
                if "synchroniz" in str(message):  # where in the engine the host waited
                    frames = [f for f in traceback.extract_stack() if "/engine/" in f.filename]
                    where = frames[-1] if frames else None
                    sites[f"{Path(where.filename).name}:{where.lineno}" if where else f"{filename}:{lineno}"] += 1

            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                out = list(engine.generate(Request("check", prompt, params, drafter=drafter)))
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            outputs[name] = [t for o in out for t in o.token_ids]
            stats = out[-1].stats
            steps = max(stats.target_forwards, 1)
            syncs[name] = {
                "steps": steps,
                "syncs_per_step": round(sum(sites.values()) / steps, 2),
                "sync_sites": dict(sites.most_common(6)),
                "tokens_per_step": round(len(outputs[name]) / steps, 2),
            }
        same = [a == b for a, b in zip(outputs["eager-target-only"], outputs["graphs-model"], strict=True)]
        results[str(dtype).removeprefix("torch.")] = {
            "identical": all(same),
            "agreeing_prefix": same.index(False) if not all(same) else len(same),
            **{f"{name}_{key}": value for name, entry in syncs.items() for key, value in entry.items()},
        }
        print("engine check", dtype, json.dumps(results[str(dtype).removeprefix("torch.")]), flush=True)
    return results


def save(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU, compiled (aot_eager) for graphs")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-verify", type=int, default=9, help="verify lengths 2..this")
    parser.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine-check-only", action="store_true", help="only the engine check (seconds)")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        device, shapes, vocab, graphs = torch.device("cpu"), SMOKE_SHAPES, 1000, "compile"
        configurations = SMOKE_CONFIGURATIONS
        args.backend, args.dtypes, args.k = "aot_eager", "float32", min(args.k, 2)  # few shapes to compile
        args.max_verify = min(args.max_verify, args.k + 1)
        args.context, args.new_tokens, args.repeats = (
            min(args.context, 64),
            min(args.new_tokens, 24),
            min(args.repeats, 3),
        )
        args.window_cache_sizes = (256, 4096)  # 4096: a window long enough to choose its attention
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --smoke on CPU")
        device, shapes, vocab, graphs = torch.device("cuda"), SHAPES, 128256, "cuda-graphs"
        configurations = CONFIGURATIONS
        args.backend, args.window_cache_sizes = "inductor", (4096, 32768)
    max_len = 4096 if not args.smoke else 256
    if args.engine_check_only:
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",") if name != "float32"]
        report = {
            "device": str(device),
            "torch": torch.__version__,
            "engine_check": engine_check(device, dtypes, graphs, args),
        }
        out = Path(args.out or "engine_check.json")
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        return
    torch.manual_seed(0)
    bandwidth = read_bandwidth(device, 64 if args.smoke else 4096)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "smoke": args.smoke,
        "torch": torch.__version__,
        "k": args.k,
        "context": args.context,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "graphs_mode": graphs,
        "dtypes": {},
    }
    report["partial"] = True  # until the last part is written
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "gpu.json"
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    target_hf = build(shapes["target"], vocab, device, dtypes[0], max_len)
    draft_hf = build(shapes["draft"], vocab, device, dtypes[0], max_len)
    report["build_seconds"] = round(time.perf_counter() - started, 1)
    for dtype in dtypes:
        target_hf.to(dtype)
        draft_hf.to(dtype)
        target, draft = CausalLM(target_hf, max_len), CausalLM(draft_hf, max_len)
        target.keep_features(default_aux_layers(len(target.layers)))  # as when serving with a head
        args.head = random_head(target, HEAD_DRAFT_VOCAB["smoke" if args.smoke else "full"])
        context = torch.ones(args.context, dtype=torch.long, device=device)
        target.extend(context)
        draft.extend(context)
        name = str(dtype).removeprefix("torch.")
        entry = {
            "target_params_b": round(sum(p.numel() for p in target_hf.parameters()) / 1e9, 3),
            "draft_params_b": round(sum(p.numel() for p in draft_hf.parameters()) / 1e9, 3),
            "bound_ms_per_target_step": round(target.weight_bytes / bandwidth * 1e3, 3),
        }
        for label, configuration in configurations.items():
            entry[label] = measure_mode(target, draft, configuration, args, device, bandwidth)
            print(name, label, json.dumps(entry[label]), flush=True)
        steps = {label: entry[label]["target_step_1_ms"] for label in configurations}
        entry["graphs_over_eager_target_step"] = round(steps[graphs] / steps["eager"], 3)
        default = list(configurations)[-1]  # what the engine runs on this device by default
        entry["default_configuration"] = default
        entry["targets"] = targets(entry[default], args.k)
        print(name, "targets", json.dumps(entry["targets"]), flush=True)
        if dtype == dtypes[0]:
            entry["windows"] = {default: window_costs(target_hf, device, configurations[default], args)}
        report["dtypes"][name] = entry
        save(report, out)  # what a run cut short by its time limit has measured so far
        del target, draft
        args.head = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del target_hf, draft_hf
    gc.collect()
    if not args.smoke:  # on CPU the same check is tests/test_lossless.py's compiled greedy suite
        report["engine_check"] = engine_check(device, [d for d in dtypes if d != torch.float32], graphs, args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report.pop("partial")
    save(report, out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
