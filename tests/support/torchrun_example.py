"""examples/torchrun_gpt.py, the loop a user copies, launched by torchrun on 2 CPU ranks (gloo,
one thread each) as a user launches it, for the tests that run it whole: to the end, or with
one rank killed at a chosen step."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_gpt.py"
FINAL = re.compile(r"final loss (\S+)  parameter checksum (\S+)  sha256 (\w+)")
#: How long one launch may take on a busy 2-core machine (a tiny model, a few steps).
LAUNCH_TIMEOUT_S = 300


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(EXAMPLE), *args]  # fmt: skip


def environment(python_path: Path | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for the ranks, with `extra`; `python_path` first on their
    PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(python_path), env.get("PYTHONPATH")]))
    return env


def launch(
    *args: str, python_path: Path | None = None, **extra: str
) -> subprocess.CompletedProcess:
    """Runs the example to its end, however it ends (see `environment` for the rest)."""
    return subprocess.run(
        command(*args), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
        env=environment(python_path, **extra),
    )  # fmt: skip


def example(*args: str) -> str:
    """Runs the example to its end; its output (rank 0's lines). Fails on a non-zero exit."""
    done = launch(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def final(out: str) -> tuple[float, float, str]:
    """(last step's loss, parameter checksum, SHA-256 of the parameters) from the last line."""
    found = FINAL.search(out)
    assert found, out[-3000:]
    loss, checksum, digest = found.groups()
    return float(loss), float(checksum), digest


def losses(log: Path) -> dict[int, str]:
    """Each step's loss (float.hex) in a --loss-log file; a step logged again (after a resume)
    counts with its last value."""
    return {int(k): v for k, v in (line.split() for line in log.read_text().splitlines())}


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process id of the launcher's child that runs `rank` (its environment says RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            ppid = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue  # gone meanwhile, or not ours to read
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def killed(*args: str, rank: int, after_step: int) -> tuple[int, str, float]:
    """Runs the example (which must log every step) and SIGKILLs `rank` once rank 0 logged
    `after_step`, as the OOM killer or a lost node would. (launcher's exit code, its output,
    seconds from the kill to the launcher's exit)."""
    proc = subprocess.Popen(
        command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=environment(),
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()  # the output, read apart: a hang still ends

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    out, killed_at = [], None
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
            out.append(line)
            if killed_at is None and line.startswith(f"step {after_step}/"):
                pid = rank_pid(proc.pid, rank)
                assert pid is not None, f"no process of rank {rank}:\n{''.join(out)[-3000:]}"
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (queue.Empty, subprocess.TimeoutExpired):
        raise AssertionError("the launch did not end:\n" + "".join(out)[-3000:]) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed_at is not None, f"step {after_step} never came:\n{''.join(out)[-3000:]}"
    return code, "".join(out), time.monotonic() - killed_at
