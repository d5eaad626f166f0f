"""The ``memfit`` command: a thin layer over the Python API.

Each job lives in its own module with ``register(subparsers)``, which adds its sub-command and sets
``args.run`` to a function calling the API. Only this module turns exceptions into exit codes: a
:class:`~memfit.errors.MemfitError` becomes one line on stderr and its ``exit_code``; Ctrl-C exits 130
after the job's own clean-up (parts already written stay valid); anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading
from typing import NoReturn, Sequence

from memfit.errors import MemfitError


def build_parser() -> argparse.ArgumentParser:
    from memfit.defaults import VERSION
    from memfit.cli import classify, embed, plan, rerank, serve, train

    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Run BERT-family encoders over corpora of any size and text length within a memory budget.",
        epilog="Run 'memfit JOB --help' for a job's options. Docs: README.md and docs/ in the repository.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {VERSION}")
    subparsers = parser.add_subparsers(dest="job", metavar="JOB", required=True)
    for job in (embed, classify, rerank, train, plan, serve):
        job.register(subparsers)
    return parser


def _configure_logging(verbose: bool) -> None:
    """memfit's own messages go to stderr as "memfit: ..."; libraries' chatter stays quiet.

    huggingface_hub logs every retry of a hub download; without a network that is a screenful of noise
    before memfit's own one-line error, so it is kept at ERROR here, before any job starts (each job then
    calls :func:`memfit.engine.process.configure_process`, which also quiets transformers).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("memfit: %(message)s"))
    log = logging.getLogger("memfit")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(verbose=getattr(args, "verbose", False))
        return int(args.run(args) or 0)
    except MemfitError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"memfit: interrupted; {_what_was_kept(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed by the reader (e.g. `| head`): not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def run() -> NoReturn:
    """The ``memfit`` command: :func:`main`, then end the process without the interpreter's teardown.

    Why: with torch, transformers and OpenVINO imported, Python's finalization (freeing some 2,000 modules and
    their objects) took 0.6-0.7 s after the work was done, 7% of embedding 2,000 short texts (2-core AMD EPYC
    with AVX-512 BF16). Everything a job writes is committed, closed and its threads joined before ``main``
    returns, so the process flushes its streams, runs its exit handlers (logging's, Ray's) and ends there. While
    a thread that is not a daemon still runs, it exits the ordinary way, which waits for that thread."""
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` as :func:`run` does: streams flushed and exit handlers run, then no
    interpreter teardown (the ordinary exit while a non-daemon thread still runs). For wrappers that run
    :func:`main` in their own process and must end it the way the command does (``benchmarks/peak_cli.py``)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    atexit._run_exitfuncs()
    os._exit(code)


def _what_was_kept(args: argparse.Namespace | None) -> str:
    """After Ctrl-C: what the output directory holds now, so the message never promises output that
    does not exist (an interrupt during start-up has written nothing)."""
    import json
    from pathlib import Path

    output = getattr(args, "output", None)
    if output is None:
        return "nothing was written"
    if args.job == "train":
        # the newest complete checkpoint, as training.checkpoint.latest_checkpoint finds it, read here without
        # importing the training package, which imports torch: seconds, and a second Ctrl-C's traceback, before
        # this line could print when the first came during start-up
        complete = [p.parent for p in Path(output, "checkpoints").glob("step-*/trainer_state.pt") if p.is_file()]
        checkpoint = max(complete, key=lambda p: int(p.name.split("-")[1]), default=None)
        if checkpoint is None:
            return "no checkpoint had been written, so there is nothing to resume from"
        return f"run the same command with --resume to continue from its last checkpoint, {checkpoint}"
    try:
        rows = int(json.loads((Path(output) / "manifest.json").read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        rows = 0
    if rows == 0:
        return "nothing was written"
    return f"{output} holds the first {rows} rows, complete; run the same command with --resume to continue"
