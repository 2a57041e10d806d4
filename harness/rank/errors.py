"""What a row says of an exception: where it was raised (the innermost frame of the code under test), and the fields
of an error row for the op's own exceptions and for the harness's."""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

import torch

import shardcheck.harness
import shardcheck.reference
import shardcheck.suites
from shardcheck.harness.core.peer_failure import is_peer_failure
from shardcheck.harness.core.processes import RAISED_AT
from shardcheck.harness.core.records import Symptom

# Frames of the harness, the suites, the references, torch and the standard library: not the code under test.
_NOT_UNDER_TEST = tuple(
    str(p) + os.sep
    for p in (
        *(
            Path(package.__file__).resolve().parent
            for package in (shardcheck.harness, shardcheck.suites, shardcheck.reference, torch)
        ),
        Path(sysconfig.get_paths()["stdlib"]).resolve(),
    )
)


def raising_location(exc: BaseException) -> str:
    """path:line where `exc` was raised: the innermost frame of the code under test (the module under test or
    what it calls, not torch nor the harness), else the innermost frame.  Paths inside the working directory are
    relative to it.  An exception marked RAISED_AT (a fresh rank's, raised again where its run is judged) was raised
    there."""
    if (at := getattr(exc, RAISED_AT, None)) is not None:
        return relative_location(*at)
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?:0"
    under_test = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_UNDER_TEST)]
    frame = (under_test or frames)[-1]
    return relative_location(frame.filename, frame.lineno)


def relative_location(filename: str, lineno: int | None) -> str:
    """path:line, the path relative to the working directory where it is inside it."""
    path = Path(filename).resolve()
    root = Path.cwd()  # where the user ran shardcheck: `tests/broken/x.py:12`, not a long absolute path
    return f"{path.relative_to(root) if path.is_relative_to(root) else path}:{lineno}"


def error_fields(exc: BaseException) -> dict:
    """error_type, error_message (its first line), error_where (raising_location) of an exception."""
    return {
        "error_type": type(exc).__name__,
        "error_message": str(exc).splitlines()[0][:200] if str(exc) else "",
        "error_where": raising_location(exc),
    }


def op_error_row(exc: BaseException, phase: str) -> dict:
    """The fields of an error row for an exception the op (or a property) raised in `phase`."""
    fields = error_fields(exc)
    msg = f"{fields['error_type']}: {fields['error_message']} ({Path(fields['error_where']).name})"
    # A collective failing because a peer died or left is a consequence, not the cause.
    secondary = is_peer_failure(exc)
    return dict(message=msg, secondary=secondary, symptom=Symptom.EXCEPTION, phase=phase, **fields)


def harness_error_row(exc: Exception, phase: str) -> dict:
    """The fields of an error row for an exception of shardcheck's own code (slicing a layout, the golden, judging,
    artefacts), naming the exception and the harness line that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = relative_location(frames[-1].filename, frames[-1].lineno) if frames else "?:0"
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    # A collective of the harness's own (summing a Partial output) failing because a peer failed is a consequence.
    secondary = is_peer_failure(exc)
    return dict(
        secondary=secondary,
        symptom=Symptom.BLOCKED if secondary else Symptom.HARNESS,
        phase=phase,
        error_type=type(exc).__name__,
        error_message=first,
        error_where=where,
        message=f"shardcheck's own code raised {type(exc).__name__}: {first} ({where}, in {phase}); "
        "a harness defect, not the op's",
    )
