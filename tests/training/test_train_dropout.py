"""Dropout masks keyed by example, not by micro-batch: every memory budget trains the same model.

References: the same module applied to the example alone / with other padding (the mask must not change),
the binomial statistics of a dropout mask, and the same training run at a budget that runs each batch
whole (weights must agree to float summation order); the control run with torch's own dropout differs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import memfit.training.api as api_module
import memfit.training.plan as plan_module
from memfit.training import train
from memfit.training.dropout import DropoutKeys, SeededDropout, install_seeded_dropout
from conftest import FAKE_BASELINE_BYTES, recorded_training_rows, sentiment_rows, write_jsonl


def test_an_examples_mask_does_not_depend_on_its_micro_batch_or_padding():
    keys = DropoutKeys(seed=3, step=7)
    dropout = SeededDropout(0.25, module_index=2, keys=keys).train()
    x = torch.randn(3, 10, 16)
    keys.examples = [5, 8, 11]
    together = dropout(x)
    keys.examples = [8]
    alone_shorter = dropout(x[1:2, :6].clone())
    torch.testing.assert_close(alone_shorter[0], together[1, :6], rtol=0, atol=0)
    keys.step = 8  # the next optimizer step draws another mask
    assert not torch.equal(dropout(x[1:2, :6].clone()), alone_shorter)
    dropout.eval()
    assert torch.equal(dropout(x), x)


DROPOUT_PEAK_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from memfit.training.dropout import DropoutKeys, SeededDropout

def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
dropout = SeededDropout(0.1, module_index=0, keys=DropoutKeys(seed=0)).train()
x = torch.randn(16, 512, 768)
dropout(x[:1])  # one-time set-up outside the measurement
Path('/proc/self/clear_refs').write_text('5')  # VmHWM := VmRSS
before = status('VmRSS')
y = dropout(x)
print(json.dumps({'grown': status('VmHWM') - before, 'activation': x.nbytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc/self/status")
def test_a_dropout_call_holds_about_its_own_activation_not_a_hash_of_the_whole_batch():
    # a micro-batch of 16 x 512 x 768 in float32: the masked copy and its scaled copy are an activation's size
    # each, the mask a quarter of one; the int64 hash of the whole micro-batch at once held two or more tensors of
    # twice an activation's size beside them (8 bytes an element), and took a bert-base training run over its
    # 3 GiB budget (docs/train.md)
    result = subprocess.run([sys.executable, "-c", DROPOUT_PEAK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["grown"] <= 3 * report["activation"], report


def test_seeded_masks_drop_the_expected_share_and_keep_the_expectation():
    keys = DropoutKeys(seed=0, step=0, examples=list(range(64)))
    dropout = SeededDropout(0.1, module_index=0, keys=keys).train()
    out = dropout(torch.ones(64, 128, 32))
    dropped = float((out == 0).float().mean())
    assert abs(dropped - 0.1) < 0.005  # 262,144 draws: the binomial sd is 0.0006
    assert abs(float(out.mean()) - 1.0) < 0.01
    per_position = (out == 0).float().mean(dim=(0, 2))  # no position is favoured
    assert float(per_position.min()) > 0.05 and float(per_position.max()) < 0.15


def test_attention_dropout_used_functionally_is_turned_off(tiny_st_dirs):
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(tiny_st_dirs["mean"], attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.2)
    model = BertModel(config).train()
    inputs = {"input_ids": torch.tensor([[2, 40, 41, 42, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    keys = install_seeded_dropout(model, seed=0, probe_inputs=inputs)
    assert model.encoder.layer[0].attention.self.dropout.p == 0.0  # read by the attention function as .p
    assert isinstance(model.encoder.layer[0].output.dropout, SeededDropout)
    assert model.encoder.layer[0].output.dropout.p == 0.2
    assert model.training  # the probe forward restored the mode
    keys.examples = [4]
    first, second = model(**inputs).last_hidden_state, model(**inputs).last_hidden_state
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # no dropout left on the global RNG
    assert not torch.allclose(first, model.eval()(**inputs).last_hidden_state)  # hidden dropout is on


@pytest.fixture
def dropout_st_dir(tiny_st_dirs, tmp_path) -> str:
    """The tiny mean-pooling model with hidden and attention dropout on, as real BERT models have."""
    root = tmp_path / "st-dropout"
    shutil.copytree(tiny_st_dirs["mean"], root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(
        json.dumps({**config, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    )
    return str(root)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(model_dir / "model.safetensors"))
    weights.update({f"head.{k}": v for k, v in load_file(str(model_dir / "2_Dense" / "model.safetensors")).items()})
    return weights


def _largest_difference(left: Path, right: Path) -> float:
    a, b = _weights(left), _weights(right)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _train_at_two_budgets(model_dir: str, root: Path, monkeypatch) -> tuple[dict, dict]:
    """The same training without a budget and under one that cuts its batches, each checked by what the
    model was actually given: the rows of every forward pass that builds a gradient."""
    data = write_jsonl(root / "train.jsonl", sentiment_rows(40, seed=5))
    settings = {"epochs": 2, "batch_size": 10, "dtype": "fp32", "lr": 1e-3, "seed": 1}
    with recorded_training_rows(monkeypatch) as rows:
        whole = train(data, root / "whole", model_dir, **settings)
    assert max(rows) == 10  # each batch of 10 in one pass
    plan = whole["plan"]
    # a budget with room for about two of the longest examples per micro-batch
    activations = plan["bytes_per_token"] * plan["longest_padded"] * 2.5
    budget = int(FAKE_BASELINE_BYTES + plan["state_bytes"] + activations / (1 - plan_module.CPU_TRAINING_MARGIN))
    with recorded_training_rows(monkeypatch) as rows:
        split = train(data, root / "split", model_dir, memory_budget=budget, **settings)
    assert max(rows) < 10  # every batch of 10 was cut into micro-batches
    return whole, split


def test_the_same_training_at_two_budgets_gives_the_same_weights(dropout_st_dir, tmp_path, fixed_baseline, monkeypatch):
    _train_at_two_budgets(dropout_st_dir, tmp_path, monkeypatch)
    assert _largest_difference(tmp_path / "whole", tmp_path / "split") < 1e-5
    initial = load_file(str(Path(dropout_st_dir) / "model.safetensors"))
    trained = _weights(tmp_path / "whole")
    assert sum(not torch.allclose(trained[k], v, atol=1e-4) for k, v in initial.items()) > 10  # training moved them


def test_with_torchs_own_dropout_the_two_budgets_differ(dropout_st_dir, tmp_path, fixed_baseline, monkeypatch):
    """The control: what the seeded masks fix is real (masks drawn per micro-batch change the model)."""
    monkeypatch.setattr(api_module, "install_seeded_dropout", lambda model, seed, inputs: None)
    _train_at_two_budgets(dropout_st_dir, tmp_path, monkeypatch)
    assert _largest_difference(tmp_path / "whole", tmp_path / "split") > 1e-3
