"""docs/adapting-an-older-api.md: the adapter example passes under --impl, the older module it adapts does not.

Both runs are the commands the guide shows, and the guide shows the adapter's code as it is (checked here);
the older module's run is one case, enough for its `property:signature` finding.
"""

from __future__ import annotations

from helpers import ROOT

ADAPTER_RUN = (
    "run",
    "--impl",
    "kd_loss=examples/adapters/kd_loss_adapter.py",
    "--op",
    "kd_loss.KDLoss",
    "--world-sizes",
    "1,2",
    "--dtype",
    "float64",
    "--strict",
)
LEGACY_RUN = (
    "run",
    "--impl",
    "kd_loss=examples/adapters/legacy_kd_loss.py",
    "--op",
    "kd_loss.KDLoss",
    "--case",
    "group-b4s6v37-T1-nbltensor-chunk0-masked",
    "--world-sizes",
    "1",
    "--dtype",
    "float64",
)


def test_guide_shows_the_adapter_and_the_commands_tested_here():
    guide = (ROOT / "docs" / "adapting-an-older-api.md").read_text()
    assert (ROOT / "examples" / "adapters" / "kd_loss_adapter.py").read_text() in guide
    for command in (ADAPTER_RUN, LEGACY_RUN):
        assert "shardcheck " + " ".join(command) in guide


def test_adapter_passes_every_kd_loss_case(run_shardcheck):
    run = run_shardcheck(*ADAPTER_RUN)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"] == "pass").all()
    assert "property:signature" not in set(rows["check"])  # the adapter spells the seed's signature
    # values and gradients on every path: sharded over TP and DP, DTensor, explicit group and full vocab
    sharded = rows[(rows["tp"] == 2) & (rows["check"] == "grad:student_logits")]
    assert {p["mode"] for p in sharded["params"]} == {"dtensor", "group", "plain"}
    assert ((rows["dp"] == 2) & (rows["check"] == "property:dp_sum")).any()


def test_older_module_gets_a_signature_finding(run_shardcheck):
    run = run_shardcheck(*LEGACY_RUN)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    signature = run.rows[run.rows["check"] == "property:signature"]
    assert list(signature["op"]) == ["kd_loss.KDLoss"] and list(signature["status"]) == ["fail"]
    message = signature["message"].iloc[0]
    assert "missing parameter(s) tp_group" in message and "parameters in another order" in message
