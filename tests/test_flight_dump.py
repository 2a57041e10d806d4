"""Our flight records in torch's flight recorder dump format (harness/driver/flight_dump.py), read by torch's own
analyzer (`torchfrtrace`, torch.distributed.flight_recorder.fr_trace): records that agree make collectives that
pass its checks; a rank with other sizes is a mismatch, a rank with no records a missing rank."""

from __future__ import annotations

import logging
import pickle

from torch.distributed.flight_recorder import fr_trace

from shardcheck.harness.driver import flight_dump

TOPOLOGY = (2, 1, 2)  # dp 2, tp 2: tp groups {0, 1} and {2, 3} (one name, as split groups may share), dp {0, 2}, {1, 3}
TP, DP, WORLD = "1", "2", "0"


def _rec(group: str, dim: str, seq: int, kind: str, shape: list[int] | None, dtype: str | None = "float32") -> dict:
    return {
        "plan": 0,
        "item": 4,
        "group": group,
        "dim": dim,
        "seq": seq,
        "kind": kind,
        "shape": shape,
        "dtype": dtype,
        "where": f"/work/my_ops.py:{10 + seq} forward_{kind}",
    }


def _records(rank: int, gathered: list[int]) -> list[dict]:
    peer = {0: 1, 1: 0, 2: 3, 3: 2}[rank]
    return [
        _rec(TP, "tp", 1, "all_reduce", [3, 5]),
        _rec(TP, "tp", 2, "all_gather", gathered),
        _rec(DP, "dp", 1, "reduce_scatter", [6, 5]),
        _rec(TP, "tp", 3, "send" if rank < peer else "recv", [3]),  # no peer recorded: left out of torch's dump
        _rec(DP, "dp", 2, "all_gather_object", None, None),
        _rec(TP, "tp", 4, "all_to_all", None, None),
        _rec(WORLD, "world", 1, "barrier", None, None),
        _rec(TP, "tp", 5, "broadcast", [], "int64"),  # a 0-d tensor
    ]


def _analyze(tmp_path, caplog, records: dict[int, list[dict]]) -> tuple[str, list]:
    """torch's analyzer on the dumps (its `torchfrtrace` entry point, in this process): its log and collectives."""
    folder = flight_dump.write(tmp_path, records, TOPOLOGY)
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1", "rank_2", "rank_3"]
    db_file = tmp_path / "db.pkl"
    with caplog.at_level(logging.INFO, logger="Flight Recorder"):
        fr_trace.main([str(folder), "-o", str(db_file)])
    _, db = pickle.loads(db_file.read_bytes())
    return "\n".join(caplog.messages), db.collectives


def test_records_that_agree_are_collectives_that_pass_torchs_analyzer(tmp_path, caplog):
    output, collectives = _analyze(tmp_path, caplog, {r: _records(r, [3, 4]) for r in range(4)})
    assert "Not all ranks" not in output and "error" not in output, output
    # per tp group 4 (the send/recv left out), per dp group 2, the world's barrier once
    names = sorted(c.collective_name for c in collectives)
    assert names == sorted(
        ["gloo:all_reduce", "gloo:all_gather", "gloo:all_to_all", "gloo:broadcast"] * 2
        + ["gloo:reduce_scatter", "gloo:all_gather"] * 2
        + ["gloo:barrier"]
    ), names
    assert all(c.pass_check for c in collectives)
    gather = next(c for c in collectives if c.collective_name == "gloo:all_gather" and c.pg_desc.endswith(":tp"))
    assert gather.input_sizes == [[3, 4]] and gather.output_sizes == [[6, 4]]
    assert gather.collective_frames == [{"name": "forward_all_gather", "filename": "/work/my_ops.py", "line": 12}]


def test_a_rank_gathering_another_shape_is_a_size_mismatch_in_torchs_analyzer(tmp_path, caplog):
    records = {r: _records(r, [3, 4]) for r in range(4)}
    records[3] = _records(3, [2, 4])
    output, _ = _analyze(tmp_path, caplog, records)
    assert "Collective sequence number: 2 has errors" in output, output
    assert "collective: gloo:all_gather" in output and "expected ranks: {2, 3}" in output, output
    # (which of the two it calls the culprit depends on the order it read the files: in a pair it cannot tell)
    error = next(line for line in output.splitlines() if line.startswith("error msg: "))
    assert "SIZE_OR_SYNTAX_MISMATCH" in error and "'[[2, 4]]'" in error and "'[[3, 4]]'" in error, error
    assert "forward_all_gather at /work/my_ops.py:12" in output, output


def test_a_rank_with_no_records_has_an_empty_dump_and_torchs_analyzer_names_it_missing(tmp_path, caplog):
    records = {r: _records(r, [3, 4]) for r in range(4)}
    records[1] = []
    output, _ = _analyze(tmp_path, caplog, records)
    assert "Not all ranks joining collective, sequence number: 1" in output, output
    assert "missing ranks: {1}" in output, output
