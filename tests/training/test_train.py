"""Tests of ``memfit train``: the accumulation equivalence, budget-driven planning, relation markers, output.

References are independent of memfit's loop: a plain torch full-batch AdamW step, plain transformers
loading and prediction, and scikit-learn's macro-F1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
from typing import Iterator

import numpy as np
import pytest
import torch

from memfit.errors import ConfigError, DoesNotFitError, InputError, OutputError
from memfit.memory.model import DeviceMemory
from memfit.data.relation import MARKERS, add_marker_tokens, entity_window_start, marked_text

import memfit.training.plan as plan_module
import memfit.training.trainer as trainer_module
from memfit.training import macro_f1, plan_training, train
from memfit.training.trainer import Schedule, Trainer
from conftest import FAKE_BASELINE_BYTES, sentiment_rows, write_jsonl


@pytest.fixture(scope="module")
def tiny_classifier_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny BERT with a (neg, pos) head already attached, so a reference can start from the same weights."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    root = tmp_path_factory.mktemp("tiny-cls")
    torch.manual_seed(3)
    model = BertForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=2, id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1}
    )
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(root)
    return str(root)


def _forcing_budget(metrics: dict, examples_per_micro_batch: float) -> int:
    """A budget whose activation room holds about this many longest examples, from a run's calibrated plan."""
    plan = metrics["plan"]
    activations = plan["bytes_per_token"] * plan["longest_padded"] * examples_per_micro_batch
    return int(FAKE_BASELINE_BYTES + plan["state_bytes"] + activations / (1 - plan_module.CPU_TRAINING_MARGIN))


def _reference_full_batch_step(model_dir: str, rows: list[dict], lr: float) -> dict[str, torch.Tensor]:
    """One plain AdamW step on the full batch (mean loss), as a textbook loop computes it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).train()
    batch = tokenizer([r["text"] for r in rows], padding=True, return_tensors="pt")
    labels = torch.tensor([model.config.label2id[r["label"]] for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.nn.functional.cross_entropy(model(**batch).logits, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_accumulated_micro_batches_give_the_full_batch_update(tiny_classifier_dir, tmp_path, fixed_baseline):
    from transformers import AutoModelForSequenceClassification

    rows = sentiment_rows(12)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    probe = train(data, tmp_path / "probe", tiny_classifier_dir, epochs=1, batch_size=12, dtype="fp32", lr=1e-3)
    assert probe["plan"]["micro_batch_at_longest"] == 12  # unconstrained: one micro-batch

    metrics = train(
        data,
        tmp_path / "accumulated",
        tiny_classifier_dir,
        epochs=1,
        batch_size=12,
        dtype="fp32",
        lr=1e-3,
        memory_budget=_forcing_budget(probe, 2.5),
    )
    assert metrics["plan"]["micro_batch_at_longest"] == 2  # six or more micro-batches per step
    assert metrics["plan"]["gradient_checkpointing"] is False

    trained = AutoModelForSequenceClassification.from_pretrained(tmp_path / "accumulated")
    reference = _reference_full_batch_step(tiny_classifier_dir, rows, lr=1e-3)
    initial = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir)
    moved = 0
    for name, param in trained.named_parameters():
        torch.testing.assert_close(param.detach(), reference[name], rtol=1e-4, atol=2e-6)
        moved += int(not torch.equal(param.detach(), dict(initial.named_parameters())[name].detach()))
    assert moved > 10  # the step did change the weights, so the comparison is not vacuous


@contextlib.contextmanager
def _sampled_rss() -> Iterator[list[int]]:
    """This process's resident set (``VmRSS`` in /proc/self/status) read every 20 ms by a thread while the
    block runs: each sample is a lower bound of the true peak, however memfit resets its own meter."""
    samples: list[int] = []
    if not sys.platform.startswith("linux"):
        yield samples
        return
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            with open("/proc/self/status") as status:
                samples.append(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:")))
            stop.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def test_training_under_a_budget_that_forces_accumulation_learns(tiny_classifier_dir, tmp_path, fixed_baseline):
    rows = sentiment_rows(48, seed=1)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    probe = train(data, tmp_path / "probe", tiny_classifier_dir, epochs=1, batch_size=8, dtype="fp32")
    with _sampled_rss() as rss:
        metrics = train(
            data,
            tmp_path / "out",
            tiny_classifier_dir,
            eval_data=data,
            epochs=4,
            batch_size=8,
            dtype="fp32",
            lr=1e-2,
            memory_budget=_forcing_budget(probe, 3.5),
        )
    assert metrics["plan"]["micro_batch_at_longest"] == 3
    losses = [e["train_loss"] for e in metrics["epochs"]]
    assert losses[-1] < 0.5 * losses[0]
    assert metrics["epochs"][-1]["eval_accuracy"] >= 0.9
    if sys.platform.startswith("linux"):
        # The reported peak is the whole process's resident set at its highest, across memfit's resets of the
        # kernel's high-water mark: the outside meter's highest sample, give or take what the samples miss
        # between them (upper side) and the kernel's per-CPU counter slack in either reading (Linux >= 6.2
        # sums RSS in per-CPU batches of max(32, 2 * CPUs) pages).
        cpus = os.cpu_count() or 1
        slack = 2 * max(32, 2 * cpus) * cpus * os.sysconf("SC_PAGE_SIZE")
        assert len(rss) > 10
        assert max(rss) - slack <= metrics["peak_memory_bytes"] <= 1.25 * max(rss) + slack
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_plan_turns_on_checkpointing_only_when_one_example_does_not_fit():
    common = {
        "baseline_bytes": 1000,
        "state_bytes": 1000,
        "optimizer_bytes": 600,
        "full_bytes_per_token": 100.0,
        "checkpointed_bytes_per_token": 10.0,
        "longest_padded": 64,
        "batch_size": 32,
        "dtype": "fp32",
        "max_length": 64,
        "device": torch.device("cuda"),
    }  # no CPU heap margin: exact arithmetic
    roomy = plan_training(budget_bytes=2000 + 100 * 64 * 4, **common)
    assert not roomy.gradient_checkpointing and roomy.micro_batch_at_longest == 4
    tight = plan_training(budget_bytes=2000 + 100 * 64 - 1, **common)
    assert tight.gradient_checkpointing and tight.micro_batch_at_longest == 9
    with pytest.raises(DoesNotFitError, match="even with gradient checkpointing"):
        plan_training(budget_bytes=2000 + 10 * 64 - 1, **common)
    with pytest.raises(DoesNotFitError, match="gradients and AdamW"):
        plan_training(budget_bytes=1999, **common)


def test_each_step_refits_the_micro_batch_to_the_memory_held_now(tiny_classifier_dir, monkeypatch):
    """When the process holds more than the plan's baseline (the CPU's resident set drifts), the next
    step gets a smaller micro-batch budget, and checkpointing turns on once one example needs it."""
    from transformers import AutoModelForSequenceClassification

    held = {"bytes": 1000}
    monkeypatch.setattr(
        trainer_module,
        "device_memory",
        lambda device: DeviceMemory(total_bytes=2**36, free_bytes=2**35, used_by_process_bytes=held["bytes"]),
    )
    budget, moments, transient = 1000 + 1000 + 100 * 64 * 4, 600, 400
    plan = plan_training(
        budget_bytes=budget,
        baseline_bytes=1000,
        state_bytes=moments + transient,
        optimizer_bytes=moments,
        full_bytes_per_token=100.0,
        checkpointed_bytes_per_token=10.0,
        longest_padded=64,
        batch_size=32,
        dtype="fp32",
        max_length=64,
        device=torch.device("cuda"),
    )  # no CPU margin: exact arithmetic
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir)
    trainer = Trainer(
        model, torch.device("cpu"), plan, 0, Schedule(lr=1e-3, head_lr=1e-3, warmup_steps=0, total_steps=1)
    )
    trainer.meter = None  # read the patched device_memory, not the real resident set

    def check_fits(bytes_per_token: float) -> int:
        """The re-fitted token budget keeps held + AdamW moments (still to come: no step has run) + the
        step's gradients + activations within the budget, and uses most of the room (the CPU keeps 20%)."""
        tokens = trainer.budget.current.max_batch_tokens
        room = budget - held["bytes"] - moments - transient
        assert tokens * bytes_per_token <= room
        assert tokens * bytes_per_token >= 0.75 * room - bytes_per_token
        return tokens

    trainer.fit_to_held_memory(64)
    roomy = check_fits(100.0)
    held["bytes"] = 1000 + 2 * 100 * 64  # drift: two examples' worth
    trainer.fit_to_held_memory(64)
    assert check_fits(100.0) < roomy
    assert not trainer.checkpointing
    held["bytes"] = 25000  # less than one example without checkpointing is left
    trainer.fit_to_held_memory(64)
    assert trainer.checkpointing
    check_fits(10.0)
    held["bytes"] = budget - moments - transient  # nothing left for even one checkpointed example
    with pytest.raises(DoesNotFitError, match=r"--memory-budget \d+MiB would work"):
        trainer.fit_to_held_memory(64)  # refused, not run over the budget (the CPU has no OOM signal)


@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])
def test_short_probes_predict_the_saved_activations_of_a_long_example(tiny_model_dir, attention_dropout):
    """Calibration runs on 32/64-token slices only (so it fits a tight budget); its per-token and
    length^2 terms must predict what autograd saves for one more sequence at full length. With attention
    dropout, torch's CPU SDPA falls back to the math kernel, which keeps the length^2 scores."""
    from transformers import AutoModelForSequenceClassification

    from memfit.data.chunking import Window

    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=2, attention_probs_dropout_prob=attention_dropout
    )
    length = model.config.max_position_embeddings
    long = Window(0, 0, np.arange(5, 5 + length), None, 0, length)
    cpu = torch.device("cpu")
    per_token, per_cell = plan_module.saved_bytes_coefficients(model, long, cpu, "fp32")
    assert (per_cell > 0) == (attention_dropout > 0)

    # reference: count the storages autograd saves for a batch of 1 and of 2 long sequences
    def saved(copies: int) -> int:
        seen, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        ids = torch.from_numpy(long.input_ids).repeat(copies, 1)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum()
        return sum(seen.values())

    measured = saved(2) - saved(1)
    predicted = per_token * length + per_cell * length**2
    assert predicted == pytest.approx(measured, rel=0.05)


def test_entity_markers_wrap_exactly_the_entity_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    marker_ids = add_marker_tokens(tokenizer)
    assert add_marker_tokens(tokenizer) == marker_ids  # idempotent
    text = "The cat sat on the long house of the dog."
    row = {"text": text, "head": {"start": 4, "end": 7}, "tail": [37, 40]}
    marked = marked_text("f.jsonl", 1, row, "text", "head", "tail")
    ids = tokenizer(marked, add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    for start, end, entity in ((MARKERS[0], MARKERS[1], "cat"), (MARKERS[2], MARKERS[3], "dog")):
        assert tokens.count(start) == 1 and tokens.count(end) == 1
        inside = ids[tokens.index(start) + 1 : tokens.index(end)]
        assert inside == tokenizer(entity, add_special_tokens=False)["input_ids"]
    # the rest of the sentence is tokenized as without markers
    unmarked = [i for i in ids if i not in marker_ids]
    assert unmarked == tokenizer(text, add_special_tokens=False)["input_ids"]
    # inline markers are taken as they are
    inline = {"text": marked}
    assert marked_text("f.jsonl", 1, inline, "text", "head", "tail") == marked


@pytest.mark.parametrize(
    "row, field, message",
    [
        ({"text": "a b c", "head": [0, 1]}, "tail", "both a head and a tail"),
        ({"text": "a b c", "head": [0, 1], "tail": [4, 6]}, "tail", "not inside the text"),
        ({"text": "a b c", "head": [0, 3], "tail": [2, 4]}, "tail", "overlap"),
        ({"text": "a b c", "head": "x", "tail": [2, 4]}, "head", "cannot read span"),
        ({"text": "a [E1] b [/E1] c"}, "text", "exactly once"),
    ],
)
def test_bad_relation_records_name_file_line_and_field(row, field, message):
    with pytest.raises(InputError, match=message) as caught:
        marked_text("rel.jsonl", 7, row, "text", "head", "tail")
    assert caught.value.field == field and caught.value.line == 7 and str(caught.value).startswith("rel.jsonl:7:")


def test_long_relation_text_is_cut_around_the_entities():
    ids = np.arange(100)
    markers = [40, 45, 50, 55]
    start = entity_window_start(ids, markers, 30)
    assert start <= 40 and start + 30 > 55
    assert entity_window_start(ids, markers, 10) == 40  # entities further apart than the window
    assert entity_window_start(ids[:20], markers, 30) == 0


def test_relation_training_via_cli_saves_a_plain_transformers_classifier(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from memfit.cli import main

    rng = random.Random(0)
    rows = []
    for i in range(40):
        relation = ["owns", "hates"][i % 2]
        head, tail = rng.choice(["cat", "dog"]), rng.choice(["house", "film"])
        text = f"the {head} {'love' if relation == 'owns' else 'hate'} the {tail}"
        h = text.index(head)
        t = text.index(tail, h + len(head))
        rows.append(
            {
                "text": text,
                "head": {"start": h, "end": h + len(head)},
                "tail": {"start": t, "end": t + len(tail)},
                "relation": relation,
            }
        )
    data = write_jsonl(tmp_path / "rel.jsonl", rows)
    out = tmp_path / "model"
    code = main(
        [
            "train",
            data,
            "--model",
            tiny_model_dir,
            "-o",
            str(out),
            "--relation",
            "--label-field",
            "relation",
            "--eval",
            data,
            "--epochs",
            "3",
            "--lr",
            "3e-3",
            "--batch-size",
            "8",
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["labels"] == ["hates", "owns"] and len(metrics["epochs"]) == 3

    model = AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.id2label == {0: "hates", 1: "owns"}
    assert all(tokenizer.convert_tokens_to_ids(m) != tokenizer.unk_token_id for m in MARKERS)
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu")
    marked = [marked_text(data, 1, r, "text", "head", "tail") for r in rows]
    predicted = [p["label"] for p in classify(marked)]
    accuracy = np.mean([p == r["relation"] for p, r in zip(predicted, rows)])
    assert accuracy == pytest.approx(metrics["epochs"][-1]["eval_accuracy"])


def test_missing_label_is_one_line_naming_file_line_and_field(tiny_model_dir, tmp_path, capsys):
    from memfit.cli import main

    rows = sentiment_rows(4)
    del rows[2]["label"]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    code = main(["train", data, "--model", tiny_model_dir, "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"memfit: error: {data}:3: field 'label': missing from this JSON object"


def test_eval_label_unknown_to_training_is_an_input_error(tiny_classifier_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(4))
    bad = write_jsonl(tmp_path / "eval.jsonl", [{"text": "x", "label": "pos"}, {"text": "y", "label": "meh"}])
    with pytest.raises(InputError, match="eval.jsonl:2: field 'label': label 'meh' does not occur"):
        train(data, tmp_path / "out", tiny_classifier_dir, eval_data=bad, epochs=1)


def test_a_pair_whose_second_text_fills_the_window_names_its_file_and_line(tiny_classifier_dir, tmp_path):
    rows = [{"text": "a good film", "pair": "yes", "label": "pos"}, {"text": "bad", "pair": "no", "label": "neg"}]
    rows.append({"text": "a film", "pair": " ".join(["good"] * 40), "label": "pos"})
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(InputError, match="pairs.jsonl:3: the second text has 40 tokens"):
        train(data, tmp_path / "out", tiny_classifier_dir, text_pair_field="pair", max_length=32, epochs=1)


def test_training_data_from_stdin_is_refused_before_it_is_read(tmp_path, monkeypatch, capsys):
    """The labels are checked on a first read and the run reads the data again: from a pipe the second read found
    nothing, and the run said the data had no labels."""
    import io

    from memfit.cli import main

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"text": "a", "label": "x"}\n')))
    assert main(["train", "-", "-o", str(tmp_path / "out"), "--input-format", "jsonl"]) == 2
    assert "give a file, not stdin" in capsys.readouterr().err
    assert sys.stdin.read() != ""  # nothing was read
    assert not (tmp_path / "out").exists()


def test_an_output_directory_that_cannot_be_made_is_an_output_error(tiny_classifier_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(4))
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(OutputError, match="a-file/out cannot be created"):
        train(data, tmp_path / "a-file" / "out", tiny_classifier_dir, epochs=1)


def test_an_empty_eval_file_is_an_input_error_not_a_nan_best_epoch(tiny_classifier_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(4))
    (tmp_path / "eval.csv").write_text("text,label\n")  # a header and no record
    with pytest.raises(InputError, match="eval.csv: no evaluation records"):
        train(data, tmp_path / "out", tiny_classifier_dir, eval_data=tmp_path / "eval.csv", epochs=1)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"seed": -1}, "seed must be >= 0"),
        ({"lr": float("nan")}, "lr and head_lr"),
        ({"head_lr": float("inf")}, "finite"),
        ({"epochs": 3.0}, "epochs must be a whole number, got 3.0"),  # was a TypeError in range() after loading
        ({"batch_size": 32.0}, "batch_size must be a whole number"),
    ],
)
def test_a_seed_or_learning_rate_no_run_can_use_is_refused_before_anything_is_read(tmp_path, option, message):
    """Each was accepted: a negative seed failed in numpy after the model loaded, and a NaN rate trained on NaN."""
    with pytest.raises(ConfigError, match=message):
        train(tmp_path / "missing.jsonl", tmp_path / "out", "not-loaded", **option)
    assert not (tmp_path / "out").exists()


def test_resume_continues_an_interrupted_run_to_the_same_model(tiny_classifier_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16))
    settings = {"epochs": 2, "batch_size": 4, "dtype": "fp32", "lr": 1e-3}
    train(data, tmp_path / "straight", tiny_classifier_dir, **settings)

    def interrupt_after_epoch_1(line: str) -> None:
        if line.startswith("epoch 1,"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(data, tmp_path / "resumed", tiny_classifier_dir, echo=interrupt_after_epoch_1, **settings)
    with pytest.raises(OutputError, match="not empty"):
        train(data, tmp_path / "resumed", tiny_classifier_dir, **settings)
    with pytest.raises(OutputError, match="settings differ .*lr"):
        train(data, tmp_path / "resumed", tiny_classifier_dir, resume=True, **{**settings, "lr": 1e-4})
    metrics = train(data, tmp_path / "resumed", tiny_classifier_dir, resume=True, **settings)
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2]

    straight = AutoModelForSequenceClassification.from_pretrained(tmp_path / "straight").state_dict()
    resumed = AutoModelForSequenceClassification.from_pretrained(tmp_path / "resumed").state_dict()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6)


def test_ctrl_c_of_the_command_names_the_checkpoint_to_resume_from(tiny_classifier_dir, tmp_path, monkeypatch, capsys):
    import memfit.training.checkpoint as checkpoint_module
    from memfit.cli import main

    data = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(16))
    out = tmp_path / "out"
    argv = ["train", data, "-o", str(out), "--model", tiny_classifier_dir, "--epochs", "2", "--batch-size", "4"]
    written = checkpoint_module.save_checkpoint

    def interrupted_before_the_first(*args, **kwargs):
        raise KeyboardInterrupt

    def interrupted_after_the_first(*args, **kwargs):
        written(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", interrupted_before_the_first)
    assert main([*argv, "--dtype", "fp32"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "memfit: interrupted; no checkpoint had been written, so there is nothing to resume from"
    )

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", interrupted_after_the_first)
    assert main([*argv, "--dtype", "fp32", "--resume"]) == 130
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit: interrupted; run the same command with --resume to continue from its last checkpoint, {checkpoint}"
    )
    monkeypatch.setattr(checkpoint_module, "save_checkpoint", written)
    assert main([*argv, "--dtype", "fp32", "--resume"]) == 0  # what the message says works
    assert [epoch["epoch"] for epoch in json.loads((out / "metrics.json").read_text())["epochs"]] == [1, 2]


def test_macro_f1_matches_scikit_learn():
    from sklearn import metrics

    rng = np.random.default_rng(0)
    for _ in range(20):
        gold, predicted = rng.integers(0, 4, 30), rng.integers(0, 5, 30)
        assert macro_f1(gold, predicted) == pytest.approx(metrics.f1_score(gold, predicted, average="macro"))


def test_padded_lengths_in_plan_follow_the_planner(tiny_classifier_dir, tmp_path):
    rows = [{"text": " ".join(["good"] * 13), "label": "pos"}, {"text": "bad", "label": "neg"}]
    metrics = train(write_jsonl(tmp_path / "t.jsonl", rows), tmp_path / "out", tiny_classifier_dir, epochs=1)
    # 13 word pieces + [CLS] + [SEP] = 15 tokens, padded to the next multiple of 8 as the batches are
    assert metrics["plan"]["longest_padded"] == 16


def test_the_guard_cuts_micro_batches_to_the_resident_room_and_the_update_stays_the_full_batch_one(tiny_classifier_dir):
    """Training's closed loop: when the resident set leaves room for only ~2.5 examples, every micro-batch
    is cut to fit that room, and the accumulated step still equals a plain full-batch AdamW step."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from memfit.data.chunking import Window
    from memfit.memory.guard import ResidentSetGuard
    from memfit.memory.model import ActivationModel
    from memfit.memory.planner import padded_length

    rows = sentiment_rows(12)
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir)
    ids = [np.array(tokenizer(r["text"])["input_ids"]) for r in rows]
    windows = [Window(i, 0, row_ids, None, 0, len(row_ids)) for i, row_ids in enumerate(ids)]
    labels = np.array([model.config.label2id[r["label"]] for r in rows])
    longest = padded_length(max(len(w) for w in windows))
    budget = 2**36
    plan = plan_training(
        budget_bytes=budget,
        baseline_bytes=0,
        state_bytes=1000,
        optimizer_bytes=600,
        full_bytes_per_token=100.0,
        checkpointed_bytes_per_token=10.0,
        longest_padded=longest,
        batch_size=12,
        dtype="fp32",
        max_length=128,
        device=torch.device("cuda"),
    )
    trainer = Trainer(
        model,
        torch.device("cpu"),
        plan,
        tokenizer.pad_token_id,
        Schedule(lr=1e-3, head_lr=1e-3, warmup_steps=0, total_steps=1),
    )
    room = 2.5 * 100.0 * longest  # what the scripted process leaves for activations

    def resident() -> int:
        return int(budget - trainer.guard.concurrent_bytes - trainer.guard.margin_bytes - room)

    trainer.guard = ResidentSetGuard(
        budget, ActivationModel(100.0, 0.0), read_resident=resident, read_peak=lambda: 0, trim=lambda: None
    )
    trainer.meter = None
    ran: list[tuple[int, int]] = []
    micro_batch = trainer.micro_batch

    def recording(all_windows, all_labels, part):
        ran.append((len(part), padded_length(max(len(all_windows[i]) for i in part))))
        return micro_batch(all_windows, all_labels, part)

    trainer.micro_batch = recording
    trainer.step(windows, labels)
    assert len(ran) > 1 and sum(n for n, _ in ran) == 12  # cut, and every example once
    assert all(n * width * 100.0 <= room for n, width in ran)
    reference = _reference_full_batch_step(tiny_classifier_dir, rows, lr=1e-3)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), reference[name], rtol=1e-4, atol=2e-6)
