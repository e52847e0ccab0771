"""The GPU headline script, run whole on CPU at a tiny size: a device run (minutes lent to a session, all tries
together) must not be spent on a mistake that the CPU shows, so every line the device runs has run here first."""

from __future__ import annotations

import json
import statistics

from benchmarks import gpu_headline


def test_the_gpu_headline_runs_end_to_end_on_cpu_and_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_headline, "RESULTS_DIR", tmp_path)
    args = ["--accelerator", "cpu", "--seeds", "0", "1", "--epochs", "4", "--channels", "8"]
    args += ["--num-samples", "1000", "--batch-size", "20"]
    assert gpu_headline.main(args) == 0
    result = json.loads((tmp_path / "gpu_headline.json").read_text())
    # one discarded warm-up fit per arm before the timed ones; the arm order alternates from seed to seed
    assert [warmup["arm"] for warmup in result["warmups"]] == ["plain", "pulse"]
    assert [(run["seed"], run["arm"]) for run in result["runs"]] == [
        (0, "plain"),
        (0, "pulse"),
        (1, "pulse"),
        (1, "plain"),
    ]
    runs = {run["arm"]: run for run in result["runs"] if run["seed"] == 0}
    # the pulse arm runs the shipped suite with its budget: fewer optimizer steps than plain
    assert runs["pulse"]["steps"] < runs["plain"]["steps"]
    for run in runs.values():
        assert 0.0 <= run["test_acc"] <= 1.0
        assert run["kwh"] > 0  # CPU and RAM were metered (estimated) on this machine
        assert run["gpu_kwh"] is None and run["gpu_method"] == "none"  # no GPU here: nothing is made up
    assert result["summary"]["seeds_paired"] == [0, 1]
    steps = {(run["seed"], run["arm"]): run["steps"] for run in result["runs"]}
    per_seed = [steps[seed, "pulse"] / steps[seed, "plain"] for seed in (0, 1)]
    assert result["summary"]["steps_ratio"] == statistics.median(per_seed)
    assert result["summary"]["gpu_kwh_ratio"] is None  # a ratio of zeros is not reported
    table = (tmp_path / "gpu_headline.md").read_text()
    assert "| plain | 0 |" in table and "| pulse | 0 |" in table


def test_without_a_gpu_the_script_says_why_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_headline, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(gpu_headline, "gpu_unavailable_reason", lambda: "torch sees no CUDA device")
    assert gpu_headline.main(["--seeds", "0"]) == 0
    assert "not run: torch sees no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
