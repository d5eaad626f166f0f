"""Checks that cost milliseconds, run before anything that costs seconds (importing torch, loading a model).

A run that is bound to fail on its input file, an option, the model path or the output directory
fails here with one line, well under a second after start-up, and before the output directory is
created. Nothing here imports torch or transformers. The jobs call the same checks, so the Python
API refuses the same things as the command line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from memfit.errors import ConfigError, InputError, ModelLoadError, OutputError
from memfit.memory.sizes import check_budget_fits_device, host_memory_bytes, parse_size
from memfit.data.prompts import check_prompt_options
from memfit.data.shards import is_url
from memfit.data.sources import STDIN, iter_rows, read_records
from memfit.io.storage import OutputLocation

MANIFEST = "manifest.json"

# A Hugging Face hub id: "name" or "owner/name"; anything else that is not a directory is a typo.
_UNLISTED_PART = re.compile(r"(part|tokens)-\d+\.parquet")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_input(
    path: str,
    input_format: str | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    pair_field: str | None = None,
    label_field: str | None = None,
) -> None:
    """The input exists, is readable, its format is known and its first record has the fields asked for.

    Stdin is only checked for its format: reading from it would consume what the job needs.
    """
    records = read_records(
        path,
        text_field=text_field,
        id_field=id_field,
        pair_field=pair_field,
        label_field=label_field,
        input_format=input_format,
    )
    if path != STDIN:
        next(records, None)


def holds_output(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` (a path or a URL) holds memfit output worth keeping (a manifest listing parts,
    or a finished run).

    A manifest that lists nothing (left by an older memfit that stopped on its input before writing)
    holds nothing to lose, so it does not stand in the way of a fresh run.
    """
    location = OutputLocation(out_dir)
    if location.remote:
        if location.size(MANIFEST) is None:
            return False
        text = location.read_bytes(MANIFEST)
    else:
        try:
            text = (Path(out_dir) / MANIFEST).read_bytes()
        except FileNotFoundError:
            return False
        except OSError:
            return True  # unreadable: not ours to overwrite
    try:
        manifest = json.loads(text)
    except ValueError:
        return True
    return not isinstance(manifest, dict) or bool(manifest.get("parts") or manifest.get("complete"))


def check_output_dir(out_dir: str | os.PathLike, resume: bool) -> None:
    """``out_dir`` can take a job's parts: a new or empty directory, or (with ``resume``) earlier output.
    In object storage: the bucket exists and the credentials work, and the prefix is empty or (with
    ``resume``) holds earlier output."""
    if is_url(os.fspath(out_dir)):
        _check_output_location(OutputLocation(out_dir), resume)
        return
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(
            f"{out}: is a file; -o names the directory that receives the parts and {MANIFEST}, choose a new directory"
        )
    if (out / MANIFEST).is_file():
        if holds_output(out) and not resume:
            raise OutputError(
                f"{out}: already holds memfit output; pass --resume to continue it or choose another directory"
            )
        return
    if out.is_dir():
        # a run killed before it listed its first part leaves temporary files (nothing to keep), and between that
        # part's rename and its manifest's, the part and its token file: PartWriter removes them, once --resume
        # says the directory is a memfit run's (another program's files may have those names)
        names = [path.name for path in out.iterdir() if not path.name.endswith(".tmp")]
        unlisted = [name for name in names if _UNLISTED_PART.fullmatch(name)]
        if unlisted and len(unlisted) == len(names) and not resume:
            raise OutputError(
                f"{out}: holds part files but no manifest that lists them, as a memfit run killed before it listed "
                "its first part leaves them; pass --resume to replace them, or choose a new or empty directory"
            )
        if len(unlisted) < len(names):
            raise OutputError(
                f"{out}: exists and is not empty (and holds no memfit manifest); choose a new or empty directory"
            )
        if not os.access(out, os.W_OK | os.X_OK):
            raise OutputError(f"{out}: no permission to write in it; choose a directory you can write in")
        return
    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise OutputError(f"{out}: cannot be created, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: cannot be created, no permission to write in {existing}")


def _check_output_location(location: OutputLocation, resume: bool) -> None:
    location.check_writable()
    names = location.names()
    if MANIFEST in names:
        if holds_output(location.name) and not resume:
            raise OutputError(
                f"{location}: already holds memfit output; pass --resume to continue it or choose another prefix"
            )
        return
    # parts uploaded before a killed run's first manifest are ours to replace; anything else is not
    if any(not _UNLISTED_PART.fullmatch(name) for name in names):
        raise OutputError(f"{location}: holds objects (and no memfit manifest); choose a new or empty prefix")


def check_model_path(model: str | os.PathLike | None) -> None:
    """A local model path exists and looks like a model directory; anything else must look like a hub id.

    ``None`` is the bundled model. Hub ids are only checked for their shape: whether the hub has them
    is known once loading tries.
    """
    if model is None:
        return
    name = os.fspath(model)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ModelLoadError(
                f"model directory {name!r} has no config.json; a model directory holds config.json, "
                "the weights and the tokenizer files, as save_pretrained writes them"
            )
        return
    if os.path.exists(name):
        raise ModelLoadError(f"model path {name!r} is a file, not a model directory")
    if name.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(name):
        raise ModelLoadError(f"model {name!r}: no such directory, and not a Hugging Face hub id (owner/name)")


def check_options(
    *,
    part_size: int | None = None,
    max_length: int | None = None,
    stride: int | None = None,
    memory_budget: str | int | None = None,
    device: str = "auto",
    dimensions: int | None = None,
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> None:
    """Option values that are wrong whatever the model: sizes below one, budgets beyond the machine, a
    prompt both named and given.

    The model-dependent limits (the longest window, the stride that fits it) are checked once the
    model's configuration is known.
    """
    if part_size is not None and part_size < 1:
        raise ConfigError(f"--part-size must be a positive number of texts per part, got {part_size}")
    if max_length is not None and max_length < 3:
        raise ConfigError(
            f"--max-length must be at least 3 tokens (a start and an end token around one token "
            f"of text), got {max_length}"
        )
    if stride is not None and stride < 0:
        raise ConfigError(f"--stride must be 0 or more tokens of overlap, got {stride}")
    if dimensions is not None and dimensions < 1:
        raise ConfigError(f"--dimensions must be at least 1, got {dimensions}")
    check_prompt_options(prompt_name, prompt)
    check_memory_budget(memory_budget, device)


def check_executor(executor: str, workers: int | None = None, address: str | None = None) -> None:
    """``--executor ray`` needs Ray installed; ``--workers`` / ``--ray-address`` need ``--executor ray``."""
    if executor != "ray":
        if workers is not None or address is not None:
            given = "--workers" if workers is not None else "--ray-address"
            raise ConfigError(f"{given} applies to --executor ray only")
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--executor ray needs Ray Data, which is not installed: pip install 'memfit[ray]'")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be a positive number of Ray workers, got {workers}")


def check_memory_budget(memory_budget: str | int | None, device: str = "auto") -> None:
    """The budget parses, and (for the CPU) is not more than the machine's memory.

    A GPU's size is only known through torch; the job checks it there (``memory.resolve_budget_bytes``).
    """
    if memory_budget is None:
        return
    total = host_memory_bytes()
    budget = memory_budget if isinstance(memory_budget, int) else parse_size(memory_budget, total)
    on_host = device == "cpu" or (device == "auto" and not os.path.exists("/proc/driver/nvidia/version"))
    if on_host:
        check_budget_fits_device(budget, memory_budget, total)


def check_training_labels(path: str, label_field: str, input_format: str | None = None) -> None:
    """Refuse labels a classifier cannot learn from: fewer than two classes, or mixed kinds of value.

    Labels become class names by their text, so ``1`` and ``"1"`` would silently merge into one class
    and ``1`` and ``1.0`` would silently split into two; a fractional number is a regression target,
    not a class. Labels must be all strings, all integers, or all whole-valued floats (a Parquet float
    column). CSV/TSV cells are all strings, so there this checks the class count only.
    """
    if path == STDIN:  # read here, then again by the run: the second read of a pipe would find it empty
        raise ConfigError("training data is read twice (these label checks, then the run): give a file, not stdin")
    first_kind: tuple[str, int] | None = None
    classes: set[str] = set()
    for line, row in iter_rows(path, input_format, [label_field]):
        value = row[label_field]
        kind = _label_kind(value)
        if kind is None:
            raise InputError(
                path,
                f"label {value!r} is {_describe(value)}; classification labels are non-empty strings or integers",
                line,
                label_field,
            )
        if first_kind is None:
            first_kind = (kind, line)
        elif kind != first_kind[0]:
            raise InputError(
                path,
                f"label {value!r} is {_KIND_NAMES[kind]} but line {first_kind[1]} has "
                f"{_KIND_NAMES[first_kind[0]]}; they would be merged or split by their text, so "
                "write every label the same way",
                line,
                label_field,
            )
        classes.add(str(value))
    if len(classes) < 2:
        found = f"only {sorted(classes)[0]!r}" if classes else "no labels"
        raise InputError(
            path, f"{found}: a classifier needs at least two classes in the training data", field=label_field
        )


_KIND_NAMES = {"string": "a string", "integer": "an integer", "float": "a float"}


def _describe(value: object) -> str:
    if isinstance(value, str):
        return "empty"
    if isinstance(value, float):
        return "a fractional number (a regression target, not a class)"
    return "null" if value is None else f"a {type(value).__name__}"


def _label_kind(value: object) -> str | None:
    if isinstance(value, str):
        return "string" if value.strip() else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float) and value.is_integer():
        return "float"
    return None
