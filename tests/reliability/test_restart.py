"""Nothing lost when a rank dies: examples/torchrun_gpt.py with one rank SIGKILLed at a random
step, then the same command line launched again (as torchrun's restart or a job scheduler does,
no flag changed), ends where a run that never stopped ends, bit for bit: every step's loss and
every parameter. In every mode, through both checkpoint paths (the gathered file and
torch.distributed.checkpoint). Each run launches half the modes, the halves swapped by the run's
seed (LEANDDP_TEST_SEED; support/rotation.py), and its modes take the two paths in turn, so that
every run covers both paths and, over four seeds, every mode meets both. A rank killed while
saving leaves the save before it to resume from, on one path per run, in this run's last mode
(offload_to_cpu with clipping: sharded, or with bf16 parameters), the path moving on every other
seed: over four seeds both modes meet both paths.
(2 CPU ranks under torchrun; tests/support/torchrun_example.py.)"""

from __future__ import annotations

import random
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rotation import alternate, this_runs_half
from torchrun_example import example, final, killed, launch, losses

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY = 8, 2
#: The modes, each with gradient accumulation (in place, or on the host with offload_to_cpu).
MODES = {
    "plain": ["--accum", "2"],
    "in-backward": ["--in-backward", "--accum", "2"],
    "offload-clip": ["--offload", "--accum", "2", "--clip", "1"],
    "in-backward-sharded": ["--shard", "--accum", "2"],
    "offload-sharded-clip": ["--offload", "--shard", "--accum", "2", "--clip", "1"],
    "bf16-offload-clip": ["--offload", "--dtype", "bf16", "--accum", "3", "--clip", "1"],
}
FORMATS = ["file", "dcp"]
#: Seconds a launch may run on after a rank died: its survivor raises, or torchrun ends it.
SURVIVOR_LIMIT_S = 60
_STRAIGHT: dict[str, tuple[tuple[float, float, str], dict[int, str]]] = {}


def straight(mode: str, folder: Path) -> tuple[tuple[float, float, str], dict[int, str]]:
    """(final line, losses) of the mode's run that never stopped (once per mode)."""
    if mode not in _STRAIGHT:
        log = folder / f"{mode}.losses"
        out = example("--steps", str(STEPS), "--loss-log", str(log), *MODES[mode])
        _STRAIGHT[mode] = final(out), losses(log)
        assert sorted(_STRAIGHT[mode][1]) == list(range(1, STEPS + 1))
    return _STRAIGHT[mode]


def flags(mode: str, fmt: str, folder: Path) -> list[str]:
    """One command line, as a restarted job repeats it: checkpoints every SAVE_EVERY steps."""
    return ["--steps", str(STEPS), "--log-every", "1", "--save-every", str(SAVE_EVERY),
            "--checkpoint", str(folder / f"ckpt-{fmt}"), "--checkpoint-format", fmt,
            "--loss-log", str(folder / "losses"), *MODES[mode]]  # fmt: skip


def resumed_at(out: str) -> int:
    found = re.search(r"resumed from \S+ at step (\d+)", out)
    assert found, f"the relaunch did not resume:\n{out[-3000:]}"
    return int(found.group(1))


#: this run's modes, each with the checkpoint path it takes (module docstring)
RUN_MODES = {mode: alternate(j, FORMATS) for j, mode in enumerate(this_runs_half(list(MODES)))}


@pytest.mark.parametrize("mode", list(RUN_MODES))
def test_a_killed_run_relaunched_ends_as_one_never_stopped(
    mode: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    fmt = RUN_MODES[mode]
    want_final, want_losses = straight(mode, tmp_path_factory.mktemp("straight"))
    rank, after = random.randrange(2), random.randrange(SAVE_EVERY + 1, STEPS)
    args = flags(mode, fmt, tmp_path)
    code, out, seconds = killed(*args, rank=rank, after_step=after)
    where = f"{fmt} checkpoints, rank {rank} killed after step {after}"
    assert code != 0, f"{where}: the launch exited {code}:\n{out[-3000:]}"
    assert seconds < SURVIVOR_LIMIT_S, f"{where}: the survivor ran on for {seconds:.0f} s"
    again = example(*args)  # the same command line
    assert SAVE_EVERY <= resumed_at(again) <= after + 1, where  # (+1: rank 0 logs, then saves)
    assert final(again) == want_final, where
    got = losses(tmp_path / "losses")
    differ = [s for s in want_losses if got.get(s) != want_losses[s]]
    assert not differ, f"{where}: the losses of steps {differ} differ"


#: Loaded first by every process of a launch (on its PYTHONPATH): rank 0 dies half way through
#: writing the save of step LEANDDP_TEST_KILL_IN_SAVE (the example's torch.save of the dict that
#: holds "step": the gathered file, or the file dcp's tensors are saved beside).
_KILL_IN_SAVE = textwrap.dedent(
    """
    import io, os, signal
    import torch

    _step, _save = int(os.environ["LEANDDP_TEST_KILL_IN_SAVE"]), torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == _step:
            whole = io.BytesIO()
            _save(obj, whole, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(whole.getvalue()[: len(whole.getvalue()) // 2])
                out.flush()
                os.fsync(out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return _save(obj, f, *args, **kwargs)

    torch.save = save
    """
)


@pytest.mark.parametrize("fmt", [alternate(0, FORMATS)])  # (module docstring)
def test_a_rank_killed_while_saving_leaves_the_save_before(
    fmt: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mode, dies_in = list(RUN_MODES)[-1], 2 * SAVE_EVERY  # (its uninterrupted run is made)
    want_final, want_losses = straight(mode, tmp_path_factory.mktemp("straight"))
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_KILL_IN_SAVE)
    args = flags(mode, fmt, tmp_path)
    done = launch(*args, python_path=inject, LEANDDP_TEST_KILL_IN_SAVE=str(dies_in))
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
    checkpoint = tmp_path / f"ckpt-{fmt}"
    if fmt == "file":  # the half-written file is beside the whole one, which it did not replace
        assert checkpoint.with_name(checkpoint.name + ".part").stat().st_size > 0
        assert torch.load(checkpoint, weights_only=True)["step"] == SAVE_EVERY
    else:  # dcp's tensors were all written, the rest half: `latest` still names the save before
        assert (checkpoint / "latest").read_text() == f"step-{SAVE_EVERY:08d}"
        assert dcp.FileSystemReader(checkpoint / f"step-{dies_in:08d}").read_metadata()
    again = example(*args)
    assert resumed_at(again) == SAVE_EVERY
    assert final(again) == want_final
    assert losses(tmp_path / "losses") == want_losses
