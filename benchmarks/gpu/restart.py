"""The GPU suite's restart check: examples/torchrun_gpt.py under
``torchrun --max-restarts 1 --master-port P`` (static rendezvous, the agent's store reused by
the restart) on NCCL, its rank SIGKILLed mid-run; torchrun's restart must resume from the last
checkpoint and end where a run that never stopped ends, bit for bit.

    python benchmarks/gpu/restart.py [--smoke] [--modes plain,offload] [--out DIR]

Per mode: a straight run (``--loss-log``), then the same command line with ``--checkpoint`` and
``--save-every``, whose rank 0 is killed once it logged a step past the first save (PLAN);
torchrun starts a new round, which must print "resumed from ... at step N" (N a multiple of
--save-every, at most the last step logged before the kill), log every step after N and print
the straight run's final line ("final loss X  parameter checksum Y  sha256 Z") with the same
loss at every step. One rank (``--nproc``, default 1): NCCL cannot put two ranks on one GPU. The
round after the kill meets through the agent's store the killed round used (its keys are still
there), creates a new NCCL communicator, pinned host buffers and a host worker (offload), and
must not wait on anything of the dead round: a launch not ended after LAUNCH_LIMIT_S is a hang.

``--smoke`` (or LEANDDP_GPU_SMOKE=1): the same on the CPU (gloo), to check the script without a
GPU. Writes OUT/restart.json (each mode's verdict) and exits 1 if a mode failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_gpt.py"
SMOKE_ENV = "LEANDDP_GPU_SMOKE"
DEFAULT_OUT = Path(os.environ.get("OUT", "benchmarks/out/gpu"))
MODES = {
    "plain": [],
    "in-backward": ["--in-backward"],
    "offload": ["--offload", "--clip", "1.0"],  # pinned buffers and the host worker
}
#: (steps, --save-every, kill once this step is logged): on a GPU a tiny model's step takes a
#: few milliseconds, so the kill lands some steps later; the resume must be from a save after
#: the first and at or before the last step logged when the kill landed
PLAN = {"gpu": (200, 25, 60), "smoke": (12, 4, 6)}
#: one launch (both rounds), CUDA and NCCL start included; past it the launch counts as a hang
LAUNCH_LIMIT_S = 150
FINAL = re.compile(r"final loss (\S+)  parameter checksum (\S+)  sha256 (\w+)")
RESUMED = re.compile(r"resumed from .* at step (\d+)")


def log(msg: str) -> None:
    print(f"[restart] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, args: list[str]) -> list[str]:
    # static rendezvous, as `torchrun --master-port P` without --rdzv-backend/--standalone
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", "1", "--master-port", str(free_port()), "--monitor-interval",
            "0.5", str(EXAMPLE), *args]  # fmt: skip


def environment(smoke: bool) -> dict[str, str]:
    # (the ranks inherit this interpreter's PYTHONPATH and site-packages, so they import the
    # leanddp it would: an in-place build on PYTHONPATH, or the installed one)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def descendants(root: int) -> list[int]:
    """Process ids under ``root`` (children, grandchildren...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker(launcher: int, rank: int, restart: int) -> int | None:
    """The pid of the launcher's worker of ``rank`` in round ``restart``."""
    want = {f"RANK={rank}".encode(), f"TORCHELASTIC_RESTART_COUNT={restart}".encode()}
    for pid in descendants(launcher):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= environ:
            return pid
    return None


def losses(path: Path) -> dict[int, str]:
    """step -> loss (float.hex); a step logged again after the resume counts with its last."""
    if not path.exists():
        return {}
    return {int(k): v for k, v in (ln.split() for ln in path.read_text().splitlines() if ln)}


def launch(
    cmd: list[str], env: dict[str, str], loss_log: Path | None = None, kill_after: int = 0
) -> tuple[int | None, str, float | None, int]:
    """Runs ``cmd`` to its end or LAUNCH_LIMIT_S; with ``kill_after``, SIGKILLs round 0's rank 0
    once ``loss_log`` holds that step. (exit code or None on a hang, output, kill time, the last
    step logged when the kill landed)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    start, killed_at, last = time.monotonic(), None, 0
    while proc.poll() is None and time.monotonic() - start < LAUNCH_LIMIT_S:
        if kill_after and killed_at is None and loss_log and kill_after in losses(loss_log):
            pid = worker(proc.pid, 0, 0)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic() - start
                last = max(losses(loss_log))
                log(f"killed rank 0 (pid {pid}) after step {last}, at {killed_at:.1f} s")
        time.sleep(0.01)
    code = proc.poll()
    if code is None:  # a hang: the workers (torchrun starts them in sessions of their own),
        for pid in [*descendants(proc.pid), proc.pid]:  # then the launcher
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    return code, "".join(out), killed_at, last


def check_mode(
    name: str, flags: list[str], nproc: int, env: dict[str, str], work: Path, smoke: bool
) -> dict:
    """One mode: the straight run, then the killed and restarted one; the verdict."""
    steps, save_every, kill_after = PLAN["smoke" if smoke else "gpu"]
    base = ["--steps", str(steps), "--log-every", "1", *flags]
    verdict: dict = {"mode": name, "flags": flags, "nproc": nproc, "ok": False}
    straight_log = work / f"{name}.straight.losses"
    code, out, _, _ = launch(command(nproc, [*base, "--loss-log", str(straight_log)]), env)
    found = FINAL.search(out)
    if code != 0 or not found:
        verdict["error"] = f"straight run: exit {code}" + ("" if found else ", no final line")
        verdict["tail"] = out[-3000:]
        return verdict
    want_final, want_losses = found.groups(), losses(straight_log)

    restart_log = work / f"{name}.restart.losses"
    ckpt = work / f"{name}.pt"
    args = [*base, "--loss-log", str(restart_log), "--checkpoint", str(ckpt),
            "--save-every", str(save_every)]  # fmt: skip
    t0 = time.monotonic()
    code, out, killed_at, last = launch(command(nproc, args), env, restart_log, kill_after)
    verdict["seconds"] = round(time.monotonic() - t0, 1)
    verdict["killed_at_s"] = killed_at
    verdict["last_step_before_kill"] = last
    verdict["tail"] = out[-3000:]
    resumed = RESUMED.search(out)
    found = FINAL.search(out)
    got = losses(restart_log)
    if killed_at is None:
        verdict["error"] = f"step {kill_after} never logged: nothing was killed"
    elif code is None:
        verdict["error"] = f"hang: the restarted launch had not ended after {LAUNCH_LIMIT_S} s"
    elif code != 0:
        verdict["error"] = f"the restarted launch failed (exit {code})"
    elif not resumed:
        verdict["error"] = "the restarted round did not resume (no 'resumed from ... at step')"
    elif not found:
        verdict["error"] = "no final line"
    else:
        step = int(resumed.group(1))
        verdict["resumed_at"] = step
        wrong = [s for s in want_losses if got.get(s) != want_losses[s]]
        if step % save_every or not 0 < step <= last or step >= steps:
            verdict["error"] = f"resumed at step {step}, not at a save before step {last}"
        elif found.groups() != want_final:
            verdict["error"] = f"final line {found.groups()} != straight run's {want_final}"
        elif wrong:
            verdict["error"] = f"losses differ from the straight run's at steps {wrong[:8]}"
        else:
            verdict["ok"] = True
    return verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help=f"CPU, gloo (or {SMOKE_ENV}=1)")
    p.add_argument("--modes", default="plain,offload", help=f"of {','.join(MODES)}")
    p.add_argument("--nproc", type=int, default=1, help="ranks (one GPU holds one NCCL rank)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    smoke = args.smoke or os.environ.get(SMOKE_ENV) == "1"
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}: choose from {list(MODES)}")
    if not smoke:
        import torch

        if not torch.cuda.is_available():
            p.error("no GPU visible: use --smoke for the CPU check")
    env = environment(smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="leanddp-restart-") as tmp:
        for mode in modes:
            log(f"{mode}: straight run, then killed mid-run and restarted by torchrun")
            verdict = check_mode(mode, MODES[mode], args.nproc, env, Path(tmp), smoke)
            verdicts.append(verdict)
            status = "PASS" if verdict["ok"] else f"FAIL: {verdict['error']}"
            log(f"{mode}: {status} (resumed at {verdict.get('resumed_at')}, "
                f"{verdict.get('seconds')} s)")  # fmt: skip
            if not verdict["ok"]:
                print(verdict["tail"], file=sys.stderr)
    steps, save_every, kill_after = PLAN["smoke" if smoke else "gpu"]
    report = {"smoke": smoke, "steps": steps, "save_every": save_every,
              "kill_after": kill_after, "modes": verdicts}  # fmt: skip
    (args.out / "restart.json").write_text(json.dumps(report, indent=1))
    bad = [v["mode"] for v in verdicts if not v["ok"]]
    log(f"{len(verdicts) - len(bad)}/{len(verdicts)} modes resumed bit for bit" +
        (f"; failed: {bad}" if bad else ""))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
