"""The benchmarks' runner and its peak reader work as their docs say (benchmarks/README.md): every scenario of
``scenarios.toml`` names a script that takes ``--out`` and whose source (or ``_measure.py``'s, which writes the
workers' reports) writes every key a figure's path names; the runner finds and judges figures in a JSON of that
shape; ``peak_cli.py`` reports a script's exit code and a peak that holds what the script allocated."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli", reason="run.py reads TOML")

import run  # noqa: E402  (benchmarks/run.py)

MiB = 2**20


def test_every_scenario_runs_a_script_that_writes_where_the_runner_reads():
    scenarios = run.load_scenarios()
    assert scenarios, "scenarios.toml lists no scenario"
    for scenario in scenarios.values():
        script = BENCHMARKS / scenario.command[0]
        assert script.is_file(), f"{scenario.name}: no benchmarks/{scenario.command[0]}"
        assert "--out" not in scenario.command, f"{scenario.name}: the runner adds --out itself"
        assert '"--out"' in script.read_text(), f"{scenario.name}: {script.name} takes no --out"
        assert scenario.figures, f"{scenario.name}: no figure to compare"
        placeholders = {name for argument in scenario.command for _, name, _, _ in string.Formatter().parse(argument)}
        assert placeholders - {None} == set(scenario.needs), f"{scenario.name}: each {{NAME}} is said in needs"
        written = script.read_text() + (BENCHMARKS / "_measure.py").read_text()
        for figure in scenario.figures:
            assert figure.noise >= 0, f"{scenario.name}: {figure.what}"
            for segment in figure.select.split("."):
                if segment.isdigit():  # a position in a list
                    continue
                key = segment.partition("=")[0]
                assert f'"{key}"' in written, f"{scenario.name}: {figure.what}: {script.name} writes no {key!r}"


def test_a_figure_is_found_by_key_and_by_list_element_and_judged_against_its_noise():
    payload = {
        "rows": [
            {"method": "st", "x_st": 1.0},
            {"method": "memfit-auto", "x_st": 3.5, "case": "a b (c)"},
        ],
        "exit": {"code": 4},
        "worker_peaks": [410.5, 398.0],
    }
    scenario = run.Scenario(
        name="s",
        about="",
        docs="",
        command=["x.py"],
        figures=[
            run.Figure("ratio", "rows.method=memfit-auto.x_st", docs=3.8, noise=0.10),  # 3.5 is 7.9% under 3.8
            run.Figure("too far", "rows.method=memfit-auto.x_st", docs=4.0, noise=0.10),  # 12.5% under 4.0
            run.Figure("exit", "exit.code", docs=4, noise=0),
            run.Figure("text key", "rows.case=a b (c).x_st", docs=3.5, noise=0),
            run.Figure("missing", "rows.method=memfit-fp32.x_st", docs=2.6, noise=0.10),
            run.Figure("second worker", "worker_peaks.1", docs=398.0, noise=0),
            run.Figure("no third worker", "worker_peaks.2", docs=398.0, noise=0),
            run.Figure("key in a list of numbers", "worker_peaks.method=st", docs=1.0, noise=0),
        ],
    )
    rows = {row["figure"]: row for row in run.compare(scenario, payload)}
    assert rows["ratio"]["measured"] == 3.5 and rows["ratio"]["within_noise"]
    assert not rows["too far"]["within_noise"]
    assert rows["exit"]["measured"] == 4 and rows["exit"]["within_noise"]
    assert rows["text key"]["within_noise"]
    assert not rows["missing"]["within_noise"] and "memfit-fp32" in rows["missing"]["error"]
    assert rows["second worker"]["measured"] == 398.0 and rows["second worker"]["within_noise"]
    assert "'2'" in rows["no third worker"]["error"]
    assert not rows["key in a list of numbers"]["within_noise"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM from /proc/self/status")
def test_peak_cli_reports_a_scripts_exit_code_and_a_peak_holding_what_it_allocated(tmp_path):
    script = tmp_path / "allocate.py"
    script.write_text(
        "import sys\nblock = bytearray(int(sys.argv[1]))\nblock[::4096] = b'x' * len(block[::4096])\nsys.exit(3)\n"
    )
    report = tmp_path / "report.json"
    for size in (16 * MiB, 256 * MiB):
        done = subprocess.run(
            [sys.executable, str(BENCHMARKS / "peak_cli.py"), str(report), str(script), str(size)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 3, done.stderr
        measured = json.loads(report.read_text())
        assert measured["code"] == 3
        # the interpreter itself is ~10 MiB; the touched pages of the block are all resident at once
        assert size <= measured["peak_bytes"] <= size + 64 * MiB, measured


def test_the_flops_benchmark_counts_what_torchs_flop_counter_counts_in_an_encoder_forward():
    """``bench_flops.py``'s useful FLOPs of texts of given lengths equal the matrix-product FLOPs PyTorch's own
    counter (``torch.utils.flop_counter``) sees in a BERT encoder's forward over each text unpadded: the linear
    layers and attention's two products."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertConfig, BertModel

    import bench_flops

    # eager attention: its two products are matrix products the counter sees (SDPA's CPU kernel it does not count)
    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=160,
        attn_implementation="eager",
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    lengths = [5, 17, 40]
    counted = 0
    for length in lengths:
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            model(input_ids=torch.randint(5, 100, (1, length)))
        counted += counter.get_total_flops()
    assert bench_flops.useful_flops(config, lengths) == counted
