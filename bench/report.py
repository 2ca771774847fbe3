"""Turn benchmark runs into the JSON summary, markdown tables, a plot and the README section."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable
from pathlib import Path

TARGET_ONLY = "serve:none"
DEFAULT = "serve:default"
HF_GENERATE = "hf:generate"
LLAMA_CPP = "llama.cpp"
ENGINE_TARGET_ONLY = "engine:none"  # the target alone in this process (--in-process none)
# a second server on the same file with the activations the first did not take, up beside it:
# "serve-float32:none" beside a server that took int8, "serve-int8:none" beside one that took float32
OTHER = "serve-"
# issue 13's targets, per prompt type unless named; best_vs_target_only only on the types listed
GOALS = {"default_vs_target_only": 1.0, "default_vs_best_hf": 1.2, "best_vs_target_only": 2.0}
GOAL_TWO_X_TYPES = ("code", "summarise", "long", "agentic")
GOAL_DEFAULT_GEOMEAN = 1.5  # the default's speedup over target-only, geometric mean over the types


def sampled_type(kind: str, temperature: float) -> str:
    """The label of a prompt type measured sampled: "chat@0.8"."""
    return f"{kind}@{temperature:g}"


def sampled_at(kind: str) -> float | None:
    """The temperature a measured type ("chat@0.8") samples at; None for a greedy one ("chat")."""
    _, at, temperature = kind.partition("@")
    return float(temperature) if at else None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 3) if values else None


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """Steps by drafter over all runs (auto's choices), most first."""
    total = collections.Counter()
    for count in counts:
        total.update(count)
    return dict(total.most_common())


def _steps(metrics: dict) -> str:
    """Who drafted the steps, e.g. "eagle3 40, none 12"; "-" where an older file has no record."""
    counts = metrics.get("steps_by_drafter") or {}
    return ", ".join(f"{name} {steps}" for name, steps in counts.items()) or "-"


def _by_position(runs: list) -> dict[tuple, list]:
    """Runs by the (prompt, turn) of their type they ran, each position's in the order they ran."""
    by_position: dict[tuple, list] = {}
    for run in runs:
        by_position.setdefault(run.position, []).append(run)
    return by_position


def pooled_rate(runs: list, tokens: Callable, seconds: Callable) -> float:
    """A type's tokens per second over its prompts: each prompt's (and turn's) median tokens and
    seconds over its repeats, summed. A median of the runs' own rates mixed the prompts: with two
    of them, one twice as fast as the other, it fell between the slower's best repeat and the
    faster's worst, and moved by 10% where every run moved by 1% (code: the default 0.87x `suffix`
    in that median, 0.98x in sums of the same requests in process)."""
    by_position = _by_position(runs)
    total_seconds = sum(statistics.median(seconds(run) for run in group) for group in by_position.values())
    total_tokens = sum(statistics.median(tokens(run) for run in group) for group in by_position.values())
    return total_tokens / total_seconds if total_seconds > 0 else 0.0


def repeat_rates(runs: list) -> list[float]:
    """A type's decode tokens/s within each repeat: repeat i's run of every prompt (and turn), summed.
    The configurations take turns request by request, so repeat i of two configurations ran side by
    side, and their ratio repeat by repeat shows how far the host's drift moves it."""
    by_position = _by_position(runs)  # in the order they ran: repeat i is each position's i-th
    rates = []
    for repeat in range(min(len(group) for group in by_position.values())):
        ran = [group[repeat] for group in by_position.values() if group[repeat].decoded_tokens]
        seconds = sum(run.decode_seconds for run in ran)
        rates.append(round(sum(run.decoded_tokens for run in ran) / seconds, 2) if seconds > 0 else 0.0)
    return rates


def _spread(metrics: dict, label: str, over: str) -> list[float] | None:
    """[least, most] of label's rate over ``over``'s, repeat by repeat; None with fewer than two repeats."""
    pairs = zip(metrics[label]["repeat_decode_tokens_per_s"], metrics[over]["repeat_decode_tokens_per_s"], strict=False)
    ratios = [mine / theirs for mine, theirs in pairs if theirs > 0]
    return [round(min(ratios), 3), round(max(ratios), 3)] if len(ratios) > 1 else None


def _metrics(runs: list, reference: list | None, bound_s: float) -> dict:
    gaps = [gap for run in runs for gap in run.inter_token_s]
    fractions = [
        run.target_forwards * bound_s / run.decode_seconds
        for run in runs
        if run.target_forwards and run.decode_seconds > 0
    ]
    rss = [run.peak_rss_mb for run in runs if run.peak_rss_mb is not None]
    return {
        "runs": len(runs),
        "tokens": statistics.median(run.num_tokens for run in runs),
        "decode_tokens_per_s": round(
            pooled_rate(
                runs, lambda run: run.decoded_tokens, lambda run: run.decode_seconds if run.decoded_tokens else 0.0
            ),
            2,
        ),
        "repeat_decode_tokens_per_s": repeat_rates(runs),
        "ttft_ms": round(statistics.median(run.ttft_s for run in runs) * 1e3, 1),
        "first_arrival_tokens": statistics.median(run.first_arrival for run in runs),
        "request_tokens_per_s": round(
            pooled_rate(runs, lambda run: run.num_tokens, lambda run: run.request_seconds), 2
        ),
        "itl_p50_ms": round(_percentile(gaps, 0.5) * 1e3, 2) if gaps else None,
        "itl_p99_ms": round(_percentile(gaps, 0.99) * 1e3, 2) if gaps else None,
        "acceptance_rate": _mean([run.acceptance_rate for run in runs]),
        "mean_tokens_per_forward": _mean([run.tokens_per_forward for run in runs]),
        "mean_num_draft_tokens": _mean([run.num_draft_tokens for run in runs]),
        "steps_by_drafter": _summed([run.steps_by_drafter for run in runs]),
        "bandwidth_bound_fraction": round(statistics.median(fractions), 3) if fractions else None,
        "peak_rss_mb": round(max(rss)) if rss else None,
        "greedy_identical": None
        if reference is None
        else all(run.text == ref.text for run, ref in zip(runs, reference, strict=True)),
    }


def summarise(configs: list, runs: dict[str, dict[str, list]], bound_s: float) -> dict:
    results: dict[str, dict[str, dict]] = {}
    for kind, by_label in runs.items():
        reference = by_label.get(TARGET_ONLY) or by_label.get(HF_GENERATE)
        other = _other(by_label)  # another target: its drafters keep its own output
        other_reference = by_label.get(f"{other}:none")
        results[kind] = {
            label: _metrics(kind_runs, other_reference if label.startswith(f"{other}:") else reference, bound_s)
            for label, kind_runs in by_label.items()
        }
        base = results[kind].get(HF_GENERATE, {}).get("decode_tokens_per_s")
        own = results[kind].get(TARGET_ONLY, {}).get("decode_tokens_per_s")
        for metrics in results[kind].values():
            speed = metrics["decode_tokens_per_s"]
            metrics["speedup_vs_hf_generate"] = round(speed / base, 3) if base else None
            metrics["speedup_vs_target_only"] = round(speed / own, 3) if own else None
    return {"results": results, "targets": _targets(results), "sse_vs_in_process": _sse_ratios(results)}


def _sampling(report: dict) -> str:
    """ "greedy", or the temperature of a sampled run (its outputs are not compared)."""
    temperature = report["settings"].get("temperature") or 0
    return f"temperature {temperature:g}" if temperature else "greedy"


def _speed(metrics: dict, label: str) -> float:
    return metrics[label]["decode_tokens_per_s"]


def _targets(results: dict[str, dict[str, dict]]) -> dict:
    targets: dict = {}
    for kind, metrics in results.items():
        hf = [label for label in metrics if label.startswith("hf:")]
        drafted = [label for label in metrics if label.startswith("serve:") and label != TARGET_ONLY]
        if TARGET_ONLY not in metrics or DEFAULT not in metrics:
            continue
        best = max(drafted, key=lambda label: _speed(metrics, label))
        own, default = _speed(metrics, TARGET_ONLY), _speed(metrics, DEFAULT)
        entry = {
            "best": best,
            "default_vs_target_only": round(default / own, 3),
            "best_vs_target_only": round(_speed(metrics, best) / own, 3),
            "default_greedy_identical": metrics[DEFAULT]["greedy_identical"],
            "default_vs_target_only_by_repeat": _spread(metrics, DEFAULT, TARGET_ONLY),
        }
        if hf:  # a sampled type ("chat@0.8") has no transformers rows
            best_hf = max(hf, key=lambda label: _speed(metrics, label))
            entry["best_hf"] = best_hf
            entry["default_vs_best_hf"] = round(default / _speed(metrics, best_hf), 3)
            entry["target_only_vs_hf_generate"] = round(own / _speed(metrics, HF_GENERATE), 3)
        singles = [label for label in drafted if label != DEFAULT]  # each drafter alone (auto's candidates)
        if singles:
            entry["best_single"] = max(singles, key=lambda label: _speed(metrics, label))
            entry["default_vs_best_single"] = round(default / _speed(metrics, entry["best_single"]), 3)
            entry["default_vs_best_single_by_repeat"] = _spread(metrics, DEFAULT, entry["best_single"])
        if LLAMA_CPP in metrics:
            entry["default_vs_llama_cpp"] = round(default / _speed(metrics, LLAMA_CPP), 3)
            entry["target_only_vs_llama_cpp"] = round(own / _speed(metrics, LLAMA_CPP), 3)
            if ENGINE_TARGET_ONLY in metrics:  # like for like: llama.cpp's runs, too, are in this process
                in_process = _speed(metrics, ENGINE_TARGET_ONLY) / _speed(metrics, LLAMA_CPP)
                entry["in_process_target_only_vs_llama_cpp"] = round(in_process, 3)
        entry |= _other_ratios(metrics, own)
        goals = GOALS if kind in GOAL_TWO_X_TYPES else {k: v for k, v in GOALS.items() if k != "best_vs_target_only"}
        entry["met"] = {name: entry[name] >= goal for name, goal in goals.items() if name in entry}
        targets[kind] = entry
    if targets:  # the means over the greedy types (a sampled type, "chat@0.8", has no llama.cpp row)
        by_type = [entry for kind, entry in targets.items() if sampled_at(kind) is None] or list(targets.values())
        geomean = round(statistics.geometric_mean([entry["default_vs_target_only"] for entry in by_type]), 3)
        targets["all"] = {"default_vs_target_only_geomean": geomean, "met": geomean >= GOAL_DEFAULT_GEOMEAN}
        other = _other_activations(results)
        ratios = [f"{other}_{name}" for name in OTHER_RATIOS] if other else []
        llama = ("default_vs_llama_cpp", "target_only_vs_llama_cpp", "in_process_target_only_vs_llama_cpp")
        for name in (*llama, *ratios):  # the same file, threads
            if all(name in entry for entry in by_type):
                targets["all"][f"{name}_geomean"] = round(statistics.geometric_mean([e[name] for e in by_type]), 3)
    return targets


def _other(metrics: dict) -> str | None:
    """The second server's label stem in a type's runs ("serve-float32"), if it ran."""
    return next((label.partition(":")[0] for label in metrics if label.startswith(OTHER)), None)


# the second server's ratios, named after its activations ("float32_target_only_vs_target_only")
OTHER_RATIOS = ("target_only_vs_target_only", "default_vs_own_target_only", "target_only_vs_llama_cpp")


def _other_activations(results: dict[str, dict]) -> str | None:
    """The second server's activations ("float32"), read from its labels in any type's runs."""
    stem = next(filter(None, map(_other, results.values())), None)
    return stem[len(OTHER) :] if stem else None


def _other_ratios(metrics: dict[str, dict], own: float) -> dict[str, float]:
    """The other target beside the first server's (same file, same run): its target-only over the
    first's, its default over its own target-only, and its target-only over llama.cpp; what was
    measured, named after its activations."""
    other = _other(metrics)
    if other is None or f"{other}:none" not in metrics:
        return {}
    name, other_own = other[len(OTHER) :], _speed(metrics, f"{other}:none")
    ratios = {f"{name}_target_only_vs_target_only": round(other_own / own, 3)}
    if f"{other}:default" in metrics:
        ratios[f"{name}_default_vs_own_target_only"] = round(_speed(metrics, f"{other}:default") / other_own, 3)
    if LLAMA_CPP in metrics:
        ratios[f"{name}_target_only_vs_llama_cpp"] = round(other_own / _speed(metrics, LLAMA_CPP), 3)
    return ratios


def _sse_ratios(results: dict[str, dict[str, dict]]) -> dict:
    """Streaming tokens/s through the server over the same configuration in-process."""
    ratios: dict[str, dict[str, float]] = {}
    for kind, metrics in results.items():
        for label in metrics:
            if label.startswith("engine:") and f"serve:{label[7:]}" in metrics:
                served = _speed(metrics, f"serve:{label[7:]}")
                ratios.setdefault(label[7:], {})[kind] = round(served / _speed(metrics, label), 3)
    return ratios


def _repeats(settings: dict) -> str:
    """How many repeats a prompt's median is of: "3 repeats", or "3 repeats (6 sampled)"."""
    sampled = settings.get("sampled_repeats")
    extra = f" ({sampled} sampled)" if sampled and sampled != settings["repeats"] else ""
    return f"{settings['repeats']} repeats{extra}"


def tables(report: dict) -> str:
    results, kinds = report["results"], list(report["results"])
    labels = list(dict.fromkeys(label for metrics in results.values() for label in metrics))
    lines = [
        f"Decode tokens/s (and speedup over specserve's target-only), {report['model']}, {_sampling(report)}, {report['settings']['max_tokens']}"
        f" new tokens, each prompt's median of {_repeats(report['settings'])}, summed over a type's prompts; read bandwidth "
        f"{report['machine']['read_bandwidth_gb_s']} GB/s, so one float32 forward takes at least "
        f"{report['bound_ms_per_forward']} ms. Decode tokens/s counts the tokens after the first arrival over the "
        "time since it (tokens streamed together with the first one were made before it arrived).",
        "",
        "| configuration | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for label in labels:
        cells = []
        for kind in kinds:
            m = results[kind].get(label)
            cells.append("-" if m is None else f"{m['decode_tokens_per_s']:.1f} ({_fmt(m['speedup_vs_target_only'])}x)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| prompt type | target-only / HF generate | default / target-only | default / best HF mode "
        "| best drafter | best / target-only |",
        "|---|---|---|---|---|---|",
    ]
    for kind, t in report["targets"].items():
        if kind == "all":
            continue
        versus_hf = f"{t['default_vs_best_hf']:.2f}x (vs {t['best_hf']})" if "best_hf" in t else "-"
        lines.append(
            f"| {kind} | {_times(t.get('target_only_vs_hf_generate'))} | {t['default_vs_target_only']:.2f}x | "
            f"{versus_hf} | {t['best']} | {t['best_vs_target_only']:.2f}x |"
        )
    lines += [
        "",
        "| prompt type | configuration | TTFT ms | tokens in first arrival | request tokens/s | ITL p50 / p99 ms | acceptance | tokens/forward | steps by drafter | bound fraction | peak RSS MB | greedy same |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        for label, m in results[kind].items():
            lines.append(
                f"| {kind} | {label} | {m['ttft_ms']:.0f} | {m['first_arrival_tokens']:g} | "
                f"{m['request_tokens_per_s']:.1f} | {_fmt(m['itl_p50_ms'])} / {_fmt(m['itl_p99_ms'])} | "
                f"{_fmt(m['acceptance_rate'])} | {_fmt(m['mean_tokens_per_forward'])} | {_steps(m)} | "
                f"{_fmt(m['bandwidth_bound_fraction'])} | {_fmt(m['peak_rss_mb'], 0)} | {m['greedy_identical']} |"
            )
    if report["sse_vs_in_process"]:
        lines += ["", "Streaming through the server vs the same engine in-process (tokens/s ratio):", ""]
        for name, by_kind in report["sse_vs_in_process"].items():
            lines.append(f"- {name}: " + ", ".join(f"{kind} {ratio:.3f}" for kind, ratio in by_kind.items()))
    return "\n".join(lines)


def summary(report: dict, full_tables: str) -> str:
    """The README's short table: per prompt type, the references against target-only, default and best."""
    results, targets = report["results"], report["targets"]
    has_llama = any(LLAMA_CPP in metrics for metrics in results.values())
    cpu = report["machine"]["cpu"]
    head = ["prompt type", "HF generate", "HF best", *(["llama.cpp"] if has_llama else []), "target-only"]
    head += ["default", "best specserve", "default / target-only", "default / HF best", "default / best single"]
    lines = [
        f"Decode tokens/s, {report['model']}, {_sampling(report)}, {report['settings']['max_tokens']} new tokens, on "
        f"{cpu['model']} (family {cpu['family']}, flags {', '.join(cpu['flags']) or 'none'}, {cpu['cpus']} CPUs, "
        + (f"{cache:g} MiB last-level cache, " if (cache := cpu.get("last_level_cache_mib")) else "")
        + f"{report['machine']['read_bandwidth_gb_s']} GB/s read), specserve drafting with "
        f"{report.get('server_draft') or report['settings'].get('draft', 'its default draft')}. "
        "Ratios hold within this run only.",
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for kind, metrics in results.items():
        if kind not in targets:
            continue
        t = targets[kind]
        cells = [kind, "-", "-"]  # a sampled type has no transformers rows
        if "best_hf" in t:
            cells[1:] = [
                f"{_speed(metrics, HF_GENERATE):.1f}",
                f"{_speed(metrics, t['best_hf']):.1f} ({t['best_hf'][3:]})",
            ]
        if has_llama:
            cells.append(f"{_speed(metrics, LLAMA_CPP):.1f}" if LLAMA_CPP in metrics else "-")
        cells += [f"{_speed(metrics, TARGET_ONLY):.1f}", f"{_speed(metrics, DEFAULT):.1f}"]
        cells.append(f"{_speed(metrics, t['best']):.1f} ({t['best'][6:]})")
        cells.append(f"{t['default_vs_target_only']:.2f}x{_range(t.get('default_vs_target_only_by_repeat'))}")
        cells.append(_times(t.get("default_vs_best_hf")))
        single = t.get("default_vs_best_single")
        spread = _range(t.get("default_vs_best_single_by_repeat"))
        cells.append("-" if single is None else f"{single:.2f}x{spread} ({t['best_single'][6:]})")
        lines.append("| " + " | ".join(cells) + " |")
    if any(t.get("default_vs_target_only_by_repeat") for t in targets.values()):
        lines += [
            "",
            "In brackets: the least and the most of that ratio within one repeat (each prompt of the type once, the "
            "configurations taking turns request by request): how far the host's drift moves it in this run. The "
            "figure before them takes each prompt's median repeat, which for two prompts may be two different "
            "repeats, so it can fall just outside them.",
        ]
    if "all" in targets:
        lines += [
            "",
            f"Default over target-only, geometric mean over the greedy types: "
            f"{targets['all']['default_vs_target_only_geomean']:.2f}x.",
        ]
    if not has_llama:
        lines += ["", "llama.cpp: not measured in this run (`--serve-only`, or llama-cpp-python not importable)."]
    elif "default_vs_llama_cpp_geomean" in targets.get("all", {}):
        every = targets["all"]
        lines += [
            "",
            "Over llama.cpp on the same GGUF file and threads, geometric mean: target-only "
            f"{every['target_only_vs_llama_cpp_geomean']:.2f}x, default {every['default_vs_llama_cpp_geomean']:.2f}x.",
        ]
        if "in_process_target_only_vs_llama_cpp_geomean" in every:  # llama.cpp's rows have no HTTP layer
            lines[-1] += (
                " llama.cpp runs in this process (llama-cpp-python), with no server between; so does "
                f"`{ENGINE_TARGET_ONLY}`, specserve's engine without its server: "
                f"{every['in_process_target_only_vs_llama_cpp_geomean']:.2f}x llama.cpp."
            )
    every = targets.get("all", {})
    other = _other_activations(results)
    if other and f"{other}_target_only_vs_target_only_geomean" in every:
        first = report.get("server_activations") or "the default's"
        line = (
            f"The default server's target multiplies {first} activations; with {other} ones (`--activations {other}`, "
            "the same blocks; a second server up beside the first, the two taking turns), geometric means: "
            f"target-only {every[f'{other}_target_only_vs_target_only_geomean']:.2f}x {first} target-only"
        )
        if f"{other}_default_vs_own_target_only_geomean" in every:
            line += f", its default {every[f'{other}_default_vs_own_target_only_geomean']:.2f}x its target-only"
        if f"{other}_target_only_vs_llama_cpp_geomean" in every:
            line += f", its target-only {every[f'{other}_target_only_vs_llama_cpp_geomean']:.2f}x llama.cpp"
        lines += ["", line + "."]
    for name, why in report.get("refused", {}).items():
        lines += ["", f"serve:{name}: not measured; the server refused it ({why})."]
    lines += ["", f"Every configuration, latency, acceptance and memory: [{full_tables}]({full_tables})."]
    return "\n".join(lines)


def _range(spread: list[float] | None) -> str:
    return "" if not spread else f" ({spread[0]:.2f}-{spread[1]:.2f})"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, kinds = report["results"], list(report["results"])
    labels = list(dict.fromkeys(label for metrics in results.values() for label in metrics))  # a sampled type has fewer
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * len(labels) * len(kinds) / 2 + 2), sharey=True)
    height = 0.8 / len(kinds)
    for axis, key, title in (
        (axes[0], "decode_tokens_per_s", "decode tokens/s"),
        (axes[1], "speedup_vs_target_only", "speedup over specserve's target-only"),
    ):
        for i, kind in enumerate(kinds):
            values = [(results[kind].get(label) or {}).get(key) or 0 for label in labels]
            axis.barh([y + i * height for y in range(len(labels))], values, height, label=kind)
        axis.set_title(title)
        axis.grid(axis="x", alpha=0.3)
    axes[1].axvline(1.0, color="black", linewidth=0.8)
    axes[0].set_yticks([y + 0.4 - height / 2 for y in range(len(labels))], labels)
    axes[0].invert_yaxis()
    axes[0].legend(title="prompt type")
    fig.suptitle(f"{report['model']} on {report['machine']['torch_threads']} CPU threads, {_sampling(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(readme: Path, text: str, name: str) -> None:
    """Replace what lies between the README's benchmark markers with the new tables."""
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    content = readme.read_text()
    if start not in content or end not in content:
        raise SystemExit(f"{readme} lacks the {start} ... {end} markers")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    body = f"{start}\n![benchmark](bench/results/{name}.png)\n\n{text}\n{end}"
    readme.write_text(head + body + tail)
