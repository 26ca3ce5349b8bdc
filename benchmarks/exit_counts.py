"""How often a user's script that ends without cleanup exits cleanly, aborts or hangs, per mode.

    python benchmarks/exit_counts.py [--runs 10] [--timeout 120] [--modes torch plain ...]
        [--endings destroy none] [--json PATH] [--faulthandler]

Launches tests/scripts/exit_at_end.py under torchrun (2 ranks, gloo, CPU: OMP_NUM_THREADS=1,
CUDA_VISIBLE_DEVICES="") ``--runs`` times for each mode and ending (``destroy``: the script's last
statement is ``dist.destroy_process_group()``; ``none``: nothing), one launch at a time, the cases
taken in turn so that a change of load on the machine falls on all of them alike. Each launch is
one of

- ``clean``: torchrun exited 0 and both ranks printed that training was done;
- ``abort``: a rank died of SIGABRT (torchrun reports ``exitcode: -6 (SIGABRT)``) or printed
  ``terminate called`` (torch's gloo teardown abort, docs/troubleshooting.md);
- ``hang``: still running after ``--timeout`` seconds (its process group is then killed);
- ``other``: any other failure (an exception, another signal, a rank that did not finish).

Progress goes to stderr, a launch per line; the counts to stdout as a markdown table, a row per
mode (docs/troubleshooting.md, "Exiting without cleanup", records one). ``--json`` also writes
every launch's outcome, exit code, seconds and the tail of its output
(tests/reliability/test_exit_torchrun.py reads it). ``--faulthandler`` runs the ranks with
PYTHONFAULTHANDLER=1 and sends a hung launch SIGABRT before killing it, so that each process
prints its threads' Python stacks (this changes what the ranks run at exit: for diagnosis only).

A tool of benchmarks/, not of the test: a measurement run by hand whose table is recorded in the
docs; the slow test runs it with ``--runs 1`` so that its verdicts are the ones counted here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "exit_at_end.py"
#: exit_at_end.py's modes, with the names the table gives them
MODES = {
    "torch": "torch's DDP + AdamW",
    "plain": "leanddp + AdamW",
    "in_backward": "leanddp `optimizer_in_backward`",
    "offload": "leanddp `offload_to_cpu`",
    "sharded": "leanddp `shard_optimizer_state`",
    "offload_sharded": "leanddp `offload_to_cpu` + `shard_optimizer_state`",
}
ENDINGS = {"destroy": "`dist.destroy_process_group()`", "none": "nothing"}
OUTCOMES = ["clean", "abort", "hang", "other"]
TAIL_CHARS = 3000
#: what marks a line of a failed launch's output as saying why
NOTABLE = ("terminate called", "exitcode", "Error", "Fatal Python error", "Thread 0x")


@dataclass
class Launch:
    """One launch of the script and what became of it."""

    mode: str
    ending: str
    outcome: str
    returncode: int | None  # None: killed after the timeout
    seconds: float
    tail: str  # the end of its stdout and stderr
    notes: list[str]  # its lines that say why it failed (NOTABLE)


def rank_env() -> dict[str, str]:
    """The ranks' environment: one thread each, no GPU; they inherit this interpreter's
    PYTHONPATH and site-packages, so they import the leanddp it would (an in-place build on
    PYTHONPATH, or the installed one)."""
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def classify(returncode: int | None, output: str) -> str:
    """``clean``, ``abort``, ``hang`` or ``other`` (the module's docstring)."""
    if returncode is None:
        return "hang"
    done = all(f"rank {rank} done" in output for rank in (0, 1))
    if returncode == 0 and done:
        return "clean"
    if returncode in (-signal.SIGABRT, 128 + signal.SIGABRT) or "SIGABRT" in output:
        return "abort"
    if "terminate called" in output:
        return "abort"
    return "other"


def _stop(proc: subprocess.Popen, faulthandler: bool) -> None:
    """Ends a hung launch: torchrun and its ranks, which share its new session's group."""
    if faulthandler:
        os.killpg(proc.pid, signal.SIGABRT)  # each process prints its threads' stacks
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # gone meanwhile
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(
    mode: str, ending: str, timeout: float, faulthandler: bool = False, script: Path = SCRIPT
) -> Launch:
    """One torchrun launch of ``script`` in ``mode`` with ``ending``, classified."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), "--mode", mode, *(["--destroy"] if ending == "destroy" else []),
    ]  # fmt: skip
    env = rank_env()
    if faulthandler:
        env["PYTHONFAULTHANDLER"] = "1"
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        # its own session, so that a hang is killed with every rank; output to a file, never a
        # pipe nobody reads while the ranks write
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc, faulthandler)
            returncode = None
        seconds = time.monotonic() - start
        out.seek(0)
        output = out.read()
    outcome = classify(returncode, output)
    notes = [] if outcome == "clean" else [x for x in output.splitlines() if notable(x)][:20]
    return Launch(mode, ending, outcome, returncode, seconds, output[-TAIL_CHARS:], notes)


def notable(line: str) -> bool:
    """Whether a line of a failed launch says why (an abort's message, a rank's exit code)."""
    return any(word in line for word in NOTABLE)


def counts_table(launches: list[Launch], modes: list[str], endings: list[str]) -> str:
    """The markdown table: a row per mode, a column per ending, each cell its launches'
    outcomes ("10 of 10 clean", "9 clean, 1 abort")."""
    lines = [
        "| mode | " + " | ".join(f"ends with {ENDINGS[e]}" for e in endings) + " |",
        "| --- |" + " --- |" * len(endings),
    ]
    for mode in modes:
        cells = []
        for ending in endings:
            got = [x.outcome for x in launches if x.mode == mode and x.ending == ending]
            counts = {o: got.count(o) for o in OUTCOMES if got.count(o)}
            if counts.get("clean") == len(got):
                cells.append(f"{len(got)} of {len(got)} clean")
            else:
                cells.append(", ".join(f"{n} {o}" for o, n in counts.items()) or "not run")
        lines.append(f"| {MODES[mode]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="launches per mode and ending")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a hang")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--endings", nargs="+", choices=list(ENDINGS), default=list(ENDINGS))
    p.add_argument("--json", type=Path, default=None, help="write every launch here")
    p.add_argument("--faulthandler", action="store_true", help="stacks of a hang (diagnosis)")
    p.add_argument("--script", type=Path, default=SCRIPT, help=argparse.SUPPRESS)  # to test
    args = p.parse_args()
    if args.runs < 1 or args.timeout <= 0:
        p.error("--runs must be at least 1 and --timeout positive")

    cases = [(mode, ending) for mode in args.modes for ending in args.endings]
    launches: list[Launch] = []
    for _ in range(args.runs):
        for mode, ending in cases:
            got = launch(mode, ending, args.timeout, args.faulthandler, args.script)
            launches.append(got)
            print(
                f"[{len(launches)}/{args.runs * len(cases)}] {mode} ending {ending}: "
                f"{got.outcome} (exit {got.returncode}, {got.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
            if got.outcome != "clean":
                print("\n".join(f"    {x}" for x in got.notes), file=sys.stderr, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(x) for x in launches], indent=1))
    print(counts_table(launches, args.modes, args.endings))


if __name__ == "__main__":
    main()
