"""Step costs of speculative decoding on one GPU, with random-weight models built from configs.

    bash bench/gpu.sh                 # Llama-3-8B-shaped target, Llama-3.2-1B-shaped draft, bfloat16
    python bench/gpu.py --smoke       # tiny models on CPU: checks the script end to end

Random weights make acceptance meaningless, so this measures what does not depend on it: the
target forward at 1 and k+1 new tokens, one draft decode step, the achieved fraction of the
memory-bandwidth bound, and tokens/s when acceptance is forced to 0.6, 0.8 and 1.0. A forced
step runs the real forwards (k draft steps, one verify over k+1 tokens) and then rolls both caches
back to a number of accepted tokens drawn from the truncated geometric law of that rate.
Writes one JSON file (bench/results/gpu.json, or under $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.model import CausalLM

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


def build(shape: dict, vocab: int, device: torch.device, dtype: torch.dtype, max_len: int) -> CausalLM:
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=max(8192, max_len), rope_theta=500000.0, **shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    for param in model.parameters():
        param.data.normal_(0.0, 0.02)
    return CausalLM(model, max_len)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def read_bandwidth(device: torch.device, megabytes: int) -> float:
    data = torch.ones(megabytes * 2**20 // 2, dtype=torch.bfloat16, device=device)
    return data.nbytes / median_seconds(lambda: data.sum(), device, 9)


def forward_cost(model: CausalLM, context: list[int], new_tokens: int, device: torch.device, repeats: int) -> float:
    def run() -> None:
        model.cache.rollback(len(context))
        model.extend(context[-1:] * new_tokens, num_logits=new_tokens)

    return median_seconds(run, device, repeats)


def forced_acceptance(
    target: CausalLM, draft: CausalLM, context: list[int], k: int, alpha: float, new_tokens: int, device, seed: int
) -> dict:
    """Decode ``new_tokens`` with real forwards, accepting a truncated-geometric(alpha) number each step."""
    draws = random.Random(seed)
    target.cache.rollback(len(context))
    draft.cache.rollback(len(context))
    produced, steps = 0, 0
    sync(device)
    start = time.perf_counter()
    while produced < new_tokens:
        base = target.cache.length
        for _ in range(k):  # the draft proposes k tokens, one forward each
            logits = draft.extend([1], num_logits=1)  # [1, V]
            logits.argmax(-1)
        target.extend([1] * (k + 1), num_logits=k + 1)  # verify: the pending token plus k drafts
        accepted = 0
        while accepted < k and draws.random() < alpha:
            accepted += 1
        target.cache.rollback(base + accepted + 1)
        draft.cache.rollback(min(draft.cache.length, base + accepted + 1))
        produced += accepted + 1
        steps += 1
    sync(device)
    seconds = time.perf_counter() - start
    return {"alpha": alpha, "tokens_per_s": round(produced / seconds, 1), "tokens_per_step": round(produced / steps, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        device, dtype, shapes, vocab = torch.device("cpu"), torch.float32, SMOKE_SHAPES, 1000
        args.context, args.new_tokens, args.repeats = (
            min(args.context, 64),
            min(args.new_tokens, 32),
            min(args.repeats, 3),
        )
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --smoke on CPU")
        device, dtype, shapes, vocab = torch.device("cuda"), torch.bfloat16, SHAPES, 128256
    torch.manual_seed(0)
    max_len = args.context + args.new_tokens + 2 * (args.k + 2)
    started = time.perf_counter()
    target = build(shapes["target"], vocab, device, dtype, max_len)
    draft = build(shapes["draft"], vocab, device, dtype, max_len)
    built_s = time.perf_counter() - started
    context = [random.Random(1).randrange(vocab) for _ in range(args.context)]
    target.extend(context)
    draft.extend(context)
    bandwidth = read_bandwidth(device, 64 if args.smoke else 4096)
    bound_s = target.weight_bytes / bandwidth
    costs = {
        "target_forward_1_ms": forward_cost(target, context, 1, device, args.repeats) * 1e3,
        f"target_forward_{args.k + 1}_ms": forward_cost(target, context, args.k + 1, device, args.repeats) * 1e3,
        "draft_step_ms": forward_cost(draft, context, 1, device, args.repeats) * 1e3,
    }
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "smoke": args.smoke,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "target_params_b": round(sum(p.numel() for p in target.hf_model.parameters()) / 1e9, 3),
        "draft_params_b": round(sum(p.numel() for p in draft.hf_model.parameters()) / 1e9, 3),
        "build_seconds": round(built_s, 1),
        "k": args.k,
        "context": args.context,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bound_ms_per_target_forward": round(bound_s * 1e3, 3),
        **{name: round(value, 3) for name, value in costs.items()},
        "bandwidth_fraction_target_forward_1": round(bound_s * 1e3 / costs["target_forward_1_ms"], 3),
        "verify_over_single_forward": round(costs[f"target_forward_{args.k + 1}_ms"] / costs["target_forward_1_ms"], 3),
        "target_only_tokens_per_s": round(1e3 / costs["target_forward_1_ms"], 1),
        "forced_acceptance": [
            forced_acceptance(target, draft, context, args.k, alpha, args.new_tokens, device, seed=7)
            for alpha in (0.6, 0.8, 1.0)
        ],
    }
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
