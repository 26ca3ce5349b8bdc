"""A user's script ending without cleanup, under torchrun (tests/scripts/exit_at_end.py): the
wrapper still alive at exit, no ``gc.collect()``, no barrier, with and without
``dist.destroy_process_group()``. In every leanddp mode it exits as cleanly as the same script
with torch's DDP: a hang or an abort fails the test unless torch's DDP showed it in the same
ending of the same test (torch's own gloo teardown abort, docs/troubleshooting.md), in which case
it is reported as a warning. Launches go through benchmarks/exit_counts.py, once each,
whose counts over ten runs docs/troubleshooting.md records ("Exiting without cleanup"); torch's
DDP aborts there now and then without cleanup, so where only a leanddp mode aborted, torch's
DDP is launched again in that ending, up to TORCH_RECHECKS times, to show it or not.

Each run launches torch's DDP in both endings and every leanddp mode in one, the modes taking
the two endings in turn, swapped every other seed (LEANDDP_TEST_SEED; support/rotation.py): over
four seeds every mode meets both endings."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from rotation import alternate

pytestmark = pytest.mark.slow

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "exit_counts.py"
MODES = ["torch", "plain", "in_backward", "offload", "sharded", "offload_sharded"]
ENDINGS = ["destroy", "none"]
LAUNCH_TIMEOUT_S = 90  # a launch takes 5 to 35 s on 2 shared cores
TORCH_RECHECKS = 8  # more launches of torch's DDP where only leanddp aborted
#: this run's (mode, ending) launches (module docstring)
CASES = [("torch", ending) for ending in ENDINGS] + [
    (mode, alternate(j, ENDINGS)) for j, mode in enumerate(MODES[1:])
]


def verdict(launches: list[dict]) -> tuple[list[str], list[str], list[dict]]:
    """The launches that fail the test, and the leanddp hangs and aborts tolerated because
    torch's DDP showed the same in the same ending, each as a line naming the launch; and the
    leanddp aborts among the failures."""
    torch_shows = {(x["ending"], x["outcome"]) for x in launches if x["mode"] == "torch"}
    failures, tolerated, aborts = [], [], []
    for x in launches:
        line = f"{x['mode']} ending {x['ending']}: {x['outcome']} (exit {x['returncode']})"
        line += "".join(f"\n    {note}" for note in x["notes"])
        if x["outcome"] == "clean":
            continue
        if x["mode"] == "torch":
            # torch's own hang or abort only excuses leanddp's; anything else is a broken script
            (tolerated if x["outcome"] in ("abort", "hang") else failures).append(line)
        elif x["outcome"] in ("abort", "hang") and (x["ending"], x["outcome"]) in torch_shows:
            tolerated.append(line + "\n    (torch's DDP did the same in this ending)")
        else:
            failures.append(line)
            if x["outcome"] == "abort":
                aborts.append(x)
    return failures, tolerated, aborts


def run_tool(report: Path, *args: str) -> tuple[list[dict], str]:
    """benchmarks/exit_counts.py with ``args``, once per mode and ending unless ``args`` says
    otherwise: its launches and its table."""
    done = subprocess.run(
        [sys.executable, str(TOOL), "--timeout", str(LAUNCH_TIMEOUT_S), "--json", str(report),
         "--runs", "1", *args],
        capture_output=True, text=True, timeout=len(MODES) * len(ENDINGS) * LAUNCH_TIMEOUT_S + 120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(report.read_text()), done.stdout


def test_a_script_ending_without_cleanup_exits_as_with_torch_ddp(tmp_path: Path) -> None:
    launches, tables = [], ""
    for ending in ENDINGS:  # the tool launches every mode it is given in every ending given
        modes = [mode for mode, e in CASES if e == ending]
        got, table = run_tool(tmp_path / f"{ending}.json", "--modes", *modes, "--endings", ending)
        launches, tables = launches + got, tables + table
    assert sorted((x["mode"], x["ending"]) for x in launches) == sorted(CASES)
    assert tables.count("| leanddp ") == len(MODES) - 1, tables  # the tables' rows
    # torch's DDP aborts now and then at exit (its gloo teardown race): where a leanddp mode
    # aborted and torch's one launch did not, torch gets TORCH_RECHECKS more to show it
    torch_aborted = {
        x["ending"] for x in launches if x["mode"] == "torch" and x["outcome"] == "abort"
    }
    for ending in sorted({x["ending"] for x in verdict(launches)[2]} - torch_aborted):
        for _ in range(TORCH_RECHECKS):
            again, _ = run_tool(tmp_path / "torch.json", "--modes", "torch", "--endings", ending)
            launches += again
            if again[0]["outcome"] == "abort":
                break
    failures, tolerated, _ = verdict(launches)
    if tolerated:
        warnings.warn(
            "hangs or aborts torch's DDP showed too:\n" + "\n".join(tolerated), stacklevel=1
        )
    assert not failures, "exits torch's DDP did not show in the same ending:\n" + "\n".join(
        failures
    )


def _launch(mode: str, ending: str, outcome: str) -> dict:
    return {"mode": mode, "ending": ending, "outcome": outcome, "returncode": 1, "notes": []}


def test_the_verdict_fails_what_torch_ddp_did_not_show() -> None:
    """The judgement above on made-up launches: it can fail."""
    clean = [_launch(mode, ending, "clean") for mode in MODES for ending in ENDINGS]
    assert verdict(clean) == ([], [], [])
    for outcome in ("abort", "hang", "other"):
        failures, _, aborts = verdict([*clean, _launch("offload", "none", outcome)])
        assert len(failures) == 1 and failures[0].startswith("offload ending none"), failures
        assert len(aborts) == (outcome == "abort"), aborts  # what torch gets rechecked for
    # torch's DDP aborting excuses an abort in the same ending only, never a hang or a failure
    torch_aborts = [*clean, _launch("torch", "none", "abort")]
    failures, tolerated, _ = verdict([*torch_aborts, _launch("sharded", "none", "abort")])
    assert failures == [] and len(tolerated) == 2, (failures, tolerated)
    for late in (
        _launch("sharded", "destroy", "abort"),
        _launch("sharded", "none", "hang"),
        _launch("sharded", "none", "other"),
    ):
        failures, _, _ = verdict([*torch_aborts, late])
        assert len(failures) == 1, failures
    failures, _, _ = verdict([*clean, _launch("torch", "destroy", "other")])  # a broken script
    assert len(failures) == 1, failures
