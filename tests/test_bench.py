"""The benchmark tooling: the GPU step-cost script end to end on CPU (--smoke), and the report maths."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

from host import last_level_cache_mib  # noqa: E402
from report import plot, summarise, summary, tables  # noqa: E402
from runners import Run, ServerRunner  # noqa: E402


def test_gpu_script_runs_on_cpu_with_small_sizes(tmp_path):
    """bench/gpu.sh end to end on CPU: tiny models, compiled (aot_eager) where a GPU would capture graphs."""
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--smoke", "--out", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["smoke"] and report["graphs_mode"] == "compile" and report["k"] == 2
    assert "partial" not in report  # written after each dtype, marked partial until the run ends
    entry = report["dtypes"]["float32"]
    for mode in ("eager", "compile", "compile+compiled-kernels"):
        costs = entry[mode]
        assert costs["target_step_1_ms"] > 0 and costs["draft_step_ms"] > 0 and set(costs["verify_ms"]) == {"2", "3"}
        assert set(costs["forced_acceptance_tokens_per_s"]) == {"0.6", "0.8", "1.0"}
        assert {"hbm_fraction_target_step", "verify_3_over_target_step", "predicted_speedup_at_0.8"} <= set(costs)
    assert entry["compile"]["variants"] > 0 and entry["compile"]["kernel_compilations"] == 0
    assert entry["compile+compiled-kernels"]["kernel_compilations"] == 16  # 4 functions x (1 token, more), 2 models
    assert entry["default_configuration"] == "compile+compiled-kernels"
    windows = entry["windows"]["compile+compiled-kernels"]
    assert set(windows["cache_4096_attention_ms"]) == {"4096"}  # the one window long enough to choose
    assert windows["cache_4096_context_4080_ms"] > 0 and windows["cache_4096_context_4080_sdpa_ms"] > 0
    assert len(entry["targets"]) == 4 and all(set(check) == {"value", "met"} for check in entry["targets"].values())


def test_every_server_run_reads_its_whole_prompt(tiny_model_dirs, tmp_path):
    """Configurations take turns on one server: without forgetting, each would find the prompt the
    one before it read cached, and time to first token would not compare with HF's or llama.cpp's."""
    target, draft = tiny_model_dirs
    server = ServerRunner(["--target", str(target), "--draft", str(draft), "--max-model-len", "128"], tmp_path / "log")
    try:
        server.wait_ready()
        prompt = list(range(40, 70))
        runs = [server.run(drafter, False, prompt, 8, user=drafter) for drafter in ("none", "model", "none")]
        assert [run.cached_tokens for run in runs] == [0, 0, 0]
        assert len({run.text for run in runs}) == 1  # greedy: the same output whoever drafted
    finally:
        server.close()


def test_a_bench_ended_with_sigterm_closes_its_server(tiny_model_dirs, tmp_path):
    """kill or pkill on a running bench (as bench/speed.py and bench/studies/spin.py set up) stops the
    `specserve serve` it started; before, the server outlived the bench, holding its memory."""
    target, _ = tiny_model_dirs
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO / "bench")!r})
from runners import ServerRunner, close_servers_on_terminate
close_servers_on_terminate()
server = ServerRunner(["--target", {str(target)!r}, "--max-model-len", "64"], __import__("pathlib").Path({str(tmp_path / "log")!r}))
try:
    server.wait_ready()
    print(server.process.pid, flush=True)
    time.sleep(600)
finally:
    server.close()
"""
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    server_pid = None
    try:
        server_pid = int(bench.stdout.readline())
        bench.terminate()  # SIGTERM
        assert bench.wait(timeout=60) == 128 + 15
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived the bench"
    finally:
        bench.kill()
        if server_pid is not None and _alive(server_pid):  # failed: leave no server behind
            os.kill(server_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run(tokens: int, seconds: float, text: str, forwards: int | None = None, steps: dict | None = None) -> Run:
    run = Run(started=0.0, token_times=[0.1 + seconds * i / (tokens - 1) for i in range(tokens)], text=text)
    run.target_forwards = forwards
    run.steps_by_drafter = steps or {}
    return run


def report_file(report: dict, flags: list[str] | None = None, **more) -> dict:
    """``summarise``'s report as bench/speed.py writes it, on a made-up host."""
    cpu = {"model": "cpu", "family": "25", "flags": flags or [], "cpus": 2}
    machine = {"read_bandwidth_gb_s": 1, "cpu": cpu}
    settings = {"max_tokens": 10, "repeats": 1}
    return {"model": "m", "settings": settings, "machine": machine, "bound_ms_per_forward": 10, **more, **report}


def test_summary_ratios_targets_and_bandwidth_fraction():
    runs = {
        "code": {
            "hf:generate": [_run(11, 1.0, "same")],  # 10 tokens/s after the first
            "hf:prompt-lookup": [_run(11, 0.5, "same")],  # 20
            "serve:none": [_run(11, 0.5, "same", forwards=10)],  # 20
            "serve:default": [_run(11, 0.4, "same", forwards=5, steps={"none": 2, "eagle3": 4, "suffix": 4})],  # 25
            "serve:ngram": [_run(11, 0.2, "same", forwards=4)],  # 50
            "serve:self": [_run(11, 0.4, "different", forwards=5)],
            "engine:ngram": [_run(11, 0.25, "same", forwards=4)],  # 40
        },
        "chat": {
            "hf:generate": [_run(11, 1.0, "a")],  # 10
            "hf:prompt-lookup": [_run(11, 1.0, "a")],  # 10
            "serve:none": [_run(11, 1.0, "a", forwards=10)],  # 10
            "serve:default": [_run(11, 0.625, "a", forwards=6)],  # 16
        },
    }
    report = summarise([], runs, bound_s=0.01)
    code = report["results"]["code"]
    assert code["serve:none"]["speedup_vs_hf_generate"] == 2.0
    assert code["serve:ngram"]["speedup_vs_target_only"] == 2.5
    assert code["serve:none"]["bandwidth_bound_fraction"] == 0.2  # 10 forwards x 10 ms in 0.5 s
    assert code["serve:self"]["greedy_identical"] is False and code["serve:ngram"]["greedy_identical"] is True
    assert list(code["serve:default"]["steps_by_drafter"].items()) == [("eagle3", 4), ("suffix", 4), ("none", 2)]
    target = report["targets"]["code"]
    assert target["best"] == "serve:ngram" and target["best_hf"] == "hf:prompt-lookup"
    assert target["default_vs_target_only"] == 1.25 and target["default_vs_best_hf"] == 1.25
    assert target["best_single"] == "serve:ngram" and target["default_vs_best_single"] == 0.5  # auto's best candidate
    assert target["met"] == {"default_vs_target_only": True, "default_vs_best_hf": True, "best_vs_target_only": True}
    assert report["targets"]["chat"]["met"] == {"default_vs_target_only": True, "default_vs_best_hf": True}
    assert report["targets"]["all"] == {"default_vs_target_only_geomean": 1.414, "met": False}  # sqrt(1.25 * 1.6)
    assert report["sse_vs_in_process"] == {"ngram": {"code": 1.25}}
    full = report_file(report, flags=["avx2"])
    text = tables(full)
    assert "| serve:ngram | 50.0 (2.50x) |" in text
    assert "| eagle3 4, suffix 4, none 2 |" in text  # most steps first
    short = summary(full, "bench/results/x.md")
    assert (
        "| code | 10.0 | 20.0 (prompt-lookup) | 20.0 | 25.0 | 50.0 (ngram) | 1.25x | 1.25x | 0.50x (ngram) |" in short
    )
    assert "| chat | 10.0 | 10.0 (generate) | 10.0 | 16.0 | 16.0 (default) | 1.60x | 1.60x | - |" in short
    assert "geometric mean over the greedy types: 1.41x" in short and "(bench/results/x.md)" in short
    assert "2 CPUs, 1 GB/s read" in short  # no cache size said where the host did not say one
    full["machine"]["cpu"]["last_level_cache_mib"] = 32.0
    assert "2 CPUs, 32 MiB last-level cache, 1 GB/s read" in summary(full, "bench/results/x.md")


def test_the_host_record_gives_the_highest_cache_levels_size(tmp_path):
    """sysfs's cache entries as Linux lists them (levels 1 to 3, sizes in K): the level-3 size, in MiB."""
    for index, (level, size) in enumerate([(1, "48K"), (1, "64K"), (2, "2048K"), (3, "491520K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert last_level_cache_mib(tmp_path) == 480.0
    assert last_level_cache_mib(tmp_path / "absent") is None


def test_a_types_rate_sums_each_prompts_median_over_its_repeats():
    """Two prompts, three repeats: a fast one (10 tokens after the first in 0.1 s) and a slow one (in
    1.0 s), one repeat of each disturbed. The type's rate is 20 tokens over 1.1 s, what the median of
    the six runs' own rates (between the slow prompt's best and the fast one's worst) is not."""
    runs = []
    for repeat in range(3):
        for index, seconds in enumerate((0.1, 1.0)):
            run = _run(11, seconds * (1.5 if repeat == index else 1.0), "same", forwards=10)
            run.position = (index, 0)
            runs.append(run)
    report = summarise([], {"code": {"serve:none": runs}}, bound_s=0.01)
    assert report["results"]["code"]["serve:none"]["decode_tokens_per_s"] == round(20 / 1.1, 2)


def test_the_ratios_spread_over_repeats_pairs_each_repeats_runs():
    """Three repeats of two prompts, the configurations taking turns: repeat i of one against repeat i
    of another. The default runs 1.25x, 1.0x and 1.6x target-only repeat by repeat (the host slowed the
    second for it, the third for target-only); its pooled ratio lies inside that spread."""
    seconds = {"serve:none": (0.5, 0.5, 0.8), "serve:default": (0.4, 0.5, 0.5), "serve:suffix": (0.4, 0.4, 0.4)}
    runs = {label: [] for label in seconds}
    for repeat in range(3):
        for index in range(2):
            for label, by_repeat in seconds.items():
                run = _run(11, by_repeat[repeat], "same", forwards=10)
                run.position = (index, 0)
                runs[label].append(run)
    report = summarise([], {"chat": runs}, bound_s=0.01)
    assert report["results"]["chat"]["serve:none"]["repeat_decode_tokens_per_s"] == [20.0, 20.0, 12.5]
    target = report["targets"]["chat"]
    assert target["default_vs_target_only_by_repeat"] == [1.0, 1.6]
    assert target["default_vs_best_single_by_repeat"] == [0.8, 1.0] and target["best_single"] == "serve:suffix"
    assert target["default_vs_target_only_by_repeat"][0] <= target["default_vs_target_only"] <= 1.6
    short = summary(report_file(report), "x.md")
    assert "| 1.00x (1.00-1.60) | - | 0.80x (0.80-1.00) (suffix) |" in short and "In brackets: the least" in short
    one = summarise([], {"chat": {label: group[:2] for label, group in runs.items()}}, bound_s=0.01)
    assert one["targets"]["chat"]["default_vs_target_only_by_repeat"] is None  # one repeat: no spread
    assert "In brackets" not in summary(report_file(one), "x.md")


def test_llama_cpp_ratios_and_their_geometric_means_reach_the_summary():
    runs = {
        kind: {
            "hf:generate": [_run(11, 1.0, "a")],  # 10 tokens/s
            "llama.cpp": [_run(11, 0.25, "a")],  # 40
            "serve:none": [_run(11, 0.5, "a", forwards=10)],  # 20
            "serve:default": [_run(11, seconds, "a", forwards=5)],
            "engine:none": [_run(11, 0.2, "a", forwards=10)],  # 50: the target alone in process, as llama.cpp
        }
        for kind, seconds in (("chat", 0.5), ("code", 0.125))  # default 20 and 80
    }
    report = summarise([], runs, bound_s=0.01)
    assert report["targets"]["chat"]["target_only_vs_llama_cpp"] == 0.5
    assert report["targets"]["chat"]["in_process_target_only_vs_llama_cpp"] == 1.25
    assert [report["targets"][kind]["default_vs_llama_cpp"] for kind in ("chat", "code")] == [0.5, 2.0]
    every = report["targets"]["all"]
    assert every["target_only_vs_llama_cpp_geomean"] == 0.5 and every["default_vs_llama_cpp_geomean"] == 1.0
    full = report_file(report, refused={"model": "no draft kept"})
    short = summary(full, "x.md")
    assert "| chat | 10.0 | 10.0 (generate) | 40.0 | 20.0 | 20.0 |" in short
    assert "geometric mean: target-only 0.50x, default 1.00x" in short
    assert "so does `engine:none`, specserve's engine without its server: 1.25x llama.cpp." in short
    assert every["in_process_target_only_vs_llama_cpp_geomean"] == 1.25
    assert "serve:model: not measured; the server refused it (no draft kept)" in short


def test_a_sampled_type_runs_on_the_servers_alone_and_stays_out_of_the_greedy_means(tmp_path):
    from speed import Config, kind_configs

    configs = [Config("hf:generate", "hf", "generate"), Config("llama.cpp", "llama.cpp", "llama.cpp")]
    configs += [Config("serve:none", "serve", "none"), Config("serve-int8:none", "serve-int8", "none")]
    assert [c.label for c in kind_configs(configs, "chat@0.8")] == ["serve:none", "serve-int8:none"]
    assert kind_configs(configs, "chat") == configs
    runs = {
        "chat": {
            "hf:generate": [_run(11, 1.0, "a")],  # 10 tokens/s
            "serve:none": [_run(11, 0.5, "a")],  # 20
            "serve:default": [_run(11, 0.4, "a")],  # 25
        },
        "chat@0.8": {
            "serve:none": [_run(11, 0.5, "s")],  # 20
            "serve:default": [_run(11, 0.5, "s")],  # 20: seeded, the same text
        },
    }
    report = summarise([], runs, bound_s=0.01)
    sampled = report["targets"]["chat@0.8"]
    assert sampled["default_vs_target_only"] == 1.0 and "best_hf" not in sampled and sampled["default_greedy_identical"]
    assert report["targets"]["all"]["default_vs_target_only_geomean"] == 1.25  # the greedy chat alone
    full = report_file(report)
    assert "| chat@0.8 | - | - | 20.0 | 20.0 | 20.0 (default) | 1.00x | - | - |" in summary(full, "x.md")
    assert "| chat@0.8 | - | 1.00x | - | serve:default | 1.00x |" in tables(full)
    plot({**full, "machine": {**full["machine"], "torch_threads": 2}}, tmp_path / "x.png")  # fewer rows in one type
    assert (tmp_path / "x.png").stat().st_size > 0


@pytest.mark.parametrize("first, other", [("int8", "float32"), ("float32", "int8")])
def test_the_other_target_is_checked_against_its_own_target_only_and_set_beside_the_first(first, other):
    """The second server takes the activations the default server did not (float32 beside int8,
    int8 beside float32): its drafters are checked against its own target-only, and its ratios are
    named after its activations."""
    runs = {
        kind: {
            "hf:generate": [_run(11, 1.0, "f")],  # 10 tokens/s
            "llama.cpp": [_run(11, 0.25, "f")],  # 40
            "serve:none": [_run(11, 0.5, "f", forwards=10)],  # 20
            "serve:default": [_run(11, 0.4, "f", forwards=5)],  # 25
            f"serve-{other}:none": [_run(11, 0.4, "i", forwards=10)],  # 25: another target, another text
            f"serve-{other}:default": [_run(11, seconds, "i" if kind == "chat" else "x", forwards=5)],
        }
        for kind, seconds in (("chat", 0.2), ("code", 0.1))  # the other's default 50 and 100
    }
    report = summarise([], runs, bound_s=0.01)
    chat, code = report["results"]["chat"], report["results"]["code"]
    assert chat[f"serve-{other}:none"]["greedy_identical"] and chat[f"serve-{other}:default"]["greedy_identical"]
    assert code[f"serve-{other}:default"]["greedy_identical"] is False  # against its own target-only's text
    target = report["targets"]["chat"]
    assert target["best"] == "serve:default"  # the other server's rows are not the first target's drafters
    assert target[f"{other}_target_only_vs_target_only"] == 1.25
    assert target[f"{other}_default_vs_own_target_only"] == 2.0
    assert target[f"{other}_target_only_vs_llama_cpp"] == 0.625
    every = report["targets"]["all"]
    assert every[f"{other}_default_vs_own_target_only_geomean"] == 2.828  # sqrt(2 * 4)
    full = report_file(report, server_activations=first)
    assert f"| serve-{other}:default | 50.0 (2.50x) | 100.0 (5.00x) |" in tables(full)
    short = summary(full, "x.md")
    assert f"target-only 1.25x {first} target-only, its default 2.83x its target-only, its target-only 0.62x" in short


def test_a_bench_saves_what_it_measured_after_every_round_and_says_how_far_it_got(tiny_model_dirs, tmp_path, capsys):
    """make bench's measuring loop against a real server on the tiny model: after each round of
    configurations the results so far are saved (a run cut short keeps them), every run prints its
    progress with the time left, each round starts one configuration further on than the round
    before, and a sampled type runs --sampled-repeats times."""
    from speed import Config, measure

    from tests.tiny import byte_tokenizer

    target, _ = tiny_model_dirs
    server = ServerRunner(["--target", str(target), "--device", "cpu", "--max-model-len", "256"], tmp_path / "log")
    saved: list[tuple[list[str], str]] = []
    try:
        server.wait_ready()
        assert "draft model" in server.refusal("model") and server.refusal("ngram") is None  # no draft here
        configs = [Config("serve:none", "serve", "none"), Config("serve:ngram", "serve", "ngram")]
        prompts = {"chat": ["Hello there", {"turns": ["one", "two"]}], "code": ["def f():"], "chat@0.8": ["Hi"]}
        args = type("Args", (), {"repeats": 1, "sampled_repeats": 2, "max_tokens": 8})()

        def save(runs, progress):
            saved.append(([kind for kind, by_label in runs.items() if all(by_label.values())], progress))

        runs = measure(configs, {"serve": server}, prompts, byte_tokenizer(), args, save)
    finally:
        server.close()
    assert [progress for _, progress in saved] == [f"{2 * done} of 12 runs" for done in range(1, 7)]
    assert saved[0][0] == ["chat"] and saved[-1][0] == ["chat", "code", "chat@0.8"]
    assert all(len(by_label) == 2 for by_label in runs.values())
    assert [len(runs[kind]["serve:ngram"]) for kind in prompts] == [3, 1, 2]  # two turns of one chat; 2 sampled repeats
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(lines) == 12 and lines[0].startswith("[1/12, ") and " left] chat#0.0 serve:none" in lines[0]
    first = [line.split(" left] ")[1].split()[:2] for line in lines[::2]]  # each round's first run
    assert first == [
        ["chat#0.0", "serve:none"],
        ["chat#1.0", "serve:ngram"],  # the next prompt: one further on
        ["chat#1.1", "serve:none"],  # its next turn: one further again
        ["code#0.0", "serve:none"],
        ["chat@0.8#0.0", "serve:none"],
        ["chat@0.8#0.0", "serve:ngram"],  # the second repeat, its own seed
    ]
