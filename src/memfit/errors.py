"""The memfit error family.

The library raises these typed exceptions; only the CLI turns them into one-line messages and exit
codes (see ``cli/__init__.py``). Anything that is not a ``MemfitError`` is a bug or an environment failure and
keeps its traceback.
"""

from __future__ import annotations


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose (user input, configuration, capacity)."""

    exit_code = 1

    def __reduce__(self):
        # Pickled as ``cls(*args)`` by default, which fails for subclasses whose __init__ formats the
        # message (InputError); Ray workers send errors to the driver pickled, class and fields intact.
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type, args: tuple, state: dict) -> "MemfitError":
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class InputError(MemfitError):
    """A problem with the user's input file: names the file, the line (or row) and the field."""

    exit_code = 2

    def __init__(self, path: str, message: str, line: int | None = None, field: str | None = None):
        self.path = path
        self.line = line
        self.field = field
        where = path if line is None else f"{path}:{line}"
        what = message if field is None else f"field {field!r}: {message}"
        super().__init__(f"{where}: {what}")


class ModelLoadError(MemfitError):
    """The model or tokenizer could not be loaded (bad path, no network for a hub id, unsupported)."""

    exit_code = 3


class GraphCompileError(ModelLoadError):
    """The compiled CPU runtime has no kernel for the graph in the precision asked for (another may work)."""


class UnsafeGraphError(ModelLoadError):
    """The compiled CPU runtime would run the graph with ``layers`` that crash the process once their buffers are
    released (another backend runs it)."""

    def __init__(self, message: str, layers: list[str]):
        super().__init__(message)
        self.layers = layers


class ConfigError(MemfitError):
    """Invalid options or option combinations (bad budget string, unknown pooling, mismatched resume).

    ``field``: the option at fault by its API name (``dimensions``, ``prompt_name``), where one option is, so
    that ``memfit serve`` can name the request field as well as the command line names the flag."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class OutputError(MemfitError):
    """The output directory cannot be used as asked (not empty without --resume, settings differ)."""

    exit_code = 2


class DoesNotFitError(MemfitError):
    """A single sequence does not fit the memory budget even at batch size 1."""

    exit_code = 4


class QualityError(MemfitError):
    """A reduced-precision setting failed the measured quality guard. ``report``: that measurement (a
    ``memfit.engine.precision.QualityReport``), for a caller that runs fp32 instead of refusing."""

    exit_code = 5

    def __init__(self, message: str, report: object = None):
        super().__init__(message)
        self.report = report


def exception_line(exc: BaseException) -> str:
    """``exc`` in one line for a message that wraps a library's failure: its type and the first line of what it
    said (at most 200 characters), or "no message"."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else 'no message'}"
