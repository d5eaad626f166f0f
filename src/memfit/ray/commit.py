"""The driver's side of a Ray job's output: the manifest, committed part by part as workers finish.

Workers finish parts in any order. The manifest keeps the layout of a local run: ``parts`` lists the
parts that cover the input from row 0 without a gap, in row order (what :func:`memfit.read` and a local
``--resume`` use), and ``parts_ahead`` lists finished parts after the first gap. Each save replaces the
manifest atomically, so after ``kill -9`` it lists only parts that are complete on disk; ``--resume``
checks each listed file (size, row count) and computes only the rows no sound part covers. At the end
``parts_ahead`` is empty and dropped, and the manifest reads like a local run's.

The directory is an :class:`~memfit.io.storage.OutputLocation`: a local (or shared) path, or a prefix in
object storage (``s3://bucket/prefix``), where each part is one upload that appears whole and the manifest
is replaced in one PUT. Workers compute a part in a scratch directory beside the output when it is local,
and in their own temporary directory when it is not (object storage has no rename, so nothing is gained by
staging there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

from memfit.atomic import TMP_SUFFIX
from memfit.errors import OutputError
from memfit.io.fingerprint import check_same_input
from memfit.io.preflight import MANIFEST, check_output_dir, holds_output
from memfit.io.storage import OutputLocation
from memfit.io.sinks import check_same_settings, listed_files, new_manifest, part_problem, read_manifest, total_counts
from memfit.jobs.runner import INPUT_SETTINGS

log = logging.getLogger("memfit")

AHEAD = "parts_ahead"
SCRATCH = ".memfit-scratch"  # workers compute a part here (local output) before writing it into place
_OURS = re.compile(r"(part|tokens)-\d+\.parquet(\.tmp)?|manifest\.json\.tmp")


class RayOutput:
    """An output directory that Ray workers fill with parts and the driver lists in ``manifest.json``.

    ``input_settings`` (``StreamInput.settings``: input, fields, format) and ``fingerprint`` are what the driver
    knows of the job; the model settings come with the first part a worker returns (:meth:`add`).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        input_settings: dict[str, Any],
        fingerprint: dict[str, Any] | None,
        resume: bool,
    ):
        self.location = OutputLocation(out_dir)
        self.dir = self.location.name
        # the sound parts by first row; empty until a resumed manifest is read (the clean-up below lists
        # what it keeps from here, so it must exist before it runs)
        self._parts: dict[int, dict[str, Any]] = {}
        self.location.check_writable()  # object storage: the bucket and credentials, before anything is listed
        if resume and self.location.size(MANIFEST) is None:
            self._clear_uncommitted()  # killed before its first part was listed: nothing to keep
        check_output_dir(self.dir, resume)
        self.input_settings = input_settings
        self.manifest: dict[str, Any] = {**new_manifest(None, fingerprint), AHEAD: []}
        if holds_output(self.dir):
            previous = read_manifest(self.location)
            check_same_input(previous.get("input_fingerprint"), fingerprint, str(input_settings["input"]), self.dir)
            check_same_settings(self.dir, previous.get("settings") or {}, input_settings, keys=INPUT_SETTINGS)
            self.manifest = previous
            self.manifest.setdefault(AHEAD, [])
            damaged = False
            for entry in previous["parts"] + previous[AHEAD]:
                problem = part_problem(self.location, entry)
                if problem is None:
                    self._parts[int(entry["first_row"])] = entry
                else:
                    log.warning("%s; computing its %d rows again", problem, entry["rows"])
                    damaged = True
            if damaged:  # listed no more before its files go, and a finished output is unfinished again
                self.manifest["complete"] = False
                self._save()
        if self.location.exists():
            self._remove_unlisted_files()

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def expected_settings(self) -> dict[str, Any] | None:
        return self.manifest.get("settings")

    def done_ranges(self) -> list[tuple[int, int]]:
        """``(first_row, stop_row)`` of every sound part, in row order."""
        return sorted((first, first + int(e["rows"])) for first, e in self._parts.items())

    def add(self, result: dict[str, Any]) -> None:
        """List one finished part (a worker's ``{"entry", "settings", "info"}``) and save the manifest."""
        settings = {**result["settings"], **self.input_settings}
        if self.manifest["settings"] is None:
            self.manifest["settings"] = settings
            self.manifest.update(result["info"])
        elif json.loads(json.dumps(settings, default=str)) != self.manifest["settings"]:
            raise OutputError(f"{self.dir}: a worker ran with other settings ({settings}); this is a bug")
        entry = result["entry"]
        self._parts[int(entry["first_row"])] = entry  # a retried task rewrote the same file: its entry wins
        self._save()

    def finish(self, total_rows: int) -> None:
        """Mark the output complete once its parts cover rows 0 … total_rows - 1 exactly once."""
        self._layout()
        if self.manifest[AHEAD] or self.manifest["rows"] != total_rows:
            raise OutputError(
                f"{self.dir}: parts cover {self.manifest['rows']} of {total_rows} rows from row 0 "
                f"({len(self.manifest[AHEAD])} parts after a gap); this is a bug"
            )
        del self.manifest[AHEAD]
        self.manifest["complete"] = True
        self._write()
        self._remove_scratch()

    def _layout(self) -> None:
        """Split the parts into the gap-free run from row 0 and the rest; overlapping parts are a bug."""
        parts, ahead, next_row = [], [], 0
        ordered = sorted(self._parts.items())
        for (first, entry), following in zip(ordered, ordered[1:] + [(None, None)]):
            if following[0] is not None and first + int(entry["rows"]) > following[0]:
                raise OutputError(
                    f"{self.dir}: parts {entry['file']} and {following[1]['file']} overlap; this is a bug"
                )
            if first == next_row and not ahead:
                parts.append(entry)
                next_row += int(entry["rows"])
            else:
                ahead.append(entry)
        self.manifest.update(parts=parts, rows=next_row, counts=total_counts(parts))
        self.manifest[AHEAD] = ahead

    def _save(self) -> None:
        self._layout()
        self._write()

    def _write(self) -> None:
        self.location.make()
        self.location.write_bytes(MANIFEST, json.dumps(self.manifest, indent=2, default=str).encode())

    def _clear_uncommitted(self) -> None:
        """Remove a killed run's scratch directory and unlisted parts, when the directory holds nothing else (no
        file that is not ours, no folder but the scratch directory)."""
        folder = self.location.path
        if folder is not None and folder.is_dir() and any(p.is_dir() and p.name != SCRATCH for p in folder.iterdir()):
            return
        if all(_OURS.fullmatch(name) for name in self.location.names()):
            self._remove_unlisted_files()

    def _remove_unlisted_files(self) -> None:
        """Drop temporary files and parts no sound manifest entry lists (written after the last save)."""
        self._remove_scratch()
        listed = {MANIFEST} | {name for entry in self._parts.values() for name, _, _ in listed_files(entry)}
        for name in self.location.names():
            if name not in listed and name.endswith((TMP_SUFFIX, ".parquet")):
                self.location.delete(name)

    def _remove_scratch(self) -> None:
        if self.location.path is not None:
            shutil.rmtree(self.location.path / SCRATCH, ignore_errors=True)
