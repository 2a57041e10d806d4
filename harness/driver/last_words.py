"""A dead rank's own words: the last error lines it wrote to its log (LAUNCH_DIR/rank<R>.log, its stdout and stderr).

A Python exception ends in its last traceback line ("ValueError: ..."), whose frame line just before says where; a
C++ abort writes "terminate called after throwing ...", "what():  [enforce fail at pair.cc:446] op.preamble.length
<= op.nbytes. 192 vs 128" (gloo), or a fatal error; a rank killed from outside writes nothing."""

from __future__ import annotations

import re
from pathlib import Path

from shardcheck.harness.driver.pool import rank_log
from shardcheck.harness.driver.stacks import short_path

# The last line of a Python traceback ("ValueError: ...", "[rank1]: torch.distributed.DistStoreError: ..."), unlike
# torch's C++ stack lines ("frame #2: c10::DistNetworkError::...", "Exception raised from ...").
EXCEPTION_LINE = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
_NATIVE = re.compile(
    r"terminate called|what\(\):|enforce fail|Fatal Python error|Segmentation fault|"
    r"Aborted|\[E\d*\s|NCCL error|gloo::"
)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
TAIL = 400  # lines of the log's end read: the death is there
MAX_CHARS = 400


def last_words(text: str) -> str:
    """The last error a log shows, in one line ("" when it shows none): a native abort's lines, else the last
    Python exception with where it was raised."""
    # (torch prefixes a rank's lines under torchrun: "[rank1]:   File ...")
    lines = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()[-TAIL:]]
    native = [i for i, ln in enumerate(lines) if _NATIVE.search(ln)]
    raised = [i for i, ln in enumerate(lines) if EXCEPTION_LINE.match(ln.strip())]
    if native and (not raised or native[-1] > raised[-1]):
        # the abort's lines that are adjacent to its last one (a "terminate called" line and its "what():")
        block = [native[-1]]
        while block[0] - 1 in native and len(block) < 3:
            block.insert(0, block[0] - 1)
        words = " ".join(lines[i].strip() for i in block)
    elif raised:
        i = raised[-1]
        words = lines[i].strip()
        frame = next((m for ln in reversed(lines[:i]) if (m := _FRAME_LINE.match(ln))), None)
        if frame:
            words += f" (at {short_path(frame['file'])}:{frame['line']} in {frame['func']})"
    else:
        return ""
    return words if len(words) <= MAX_CHARS else words[: MAX_CHARS - 1] + "…"


def of_rank(launch_dir: Path, rank: int) -> str:
    try:
        return last_words(rank_log(launch_dir, rank).read_text(errors="replace"))
    except OSError:
        return ""
