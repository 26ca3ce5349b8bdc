"""torchrun's restart reuses the round's TCPStore (static rendezvous: the agent's store on
--master-port; c10d: the shared one), so gloo's rendezvous keys of a group outlive the round.
A rank of the restarted round that reads its peer's key before the peer has written it gets
the dead process's address: gloo then refuses within seconds, or both ranks wait for each
other until the group's timeout (30 minutes by default), or it works, as the ports fall. A
wrapper forgets its rank's keys once construction's collectives have proved that every rank
connected, so the restart meets through fresh addresses (python/leanddp/_rendezvous.py).

Launched as the issue ran it: torchrun --max-restarts 1 --master-port P (static). Round 0:
every rank builds a wrapper and takes a step, then rank 1 dies. Round 1: rank 0 looks for
round 0's keys while rank 1 waits for it to finish looking (a store key it sets), so rank 0
reads before rank 1 writes however slowly either starts; then both train."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dist_harness import _free_port

pytestmark = pytest.mark.slow

#: the process group's timeout in the ranks: a rendezvous that hangs fails after it
PG_TIMEOUT_S = 20
#: the whole launch: two rounds of 2 CPU ranks on a busy 2-core machine
LAUNCH_TIMEOUT_S = 180

RANKS = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    import leanddp

    rank = int(os.environ["RANK"])
    round_ = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if round_ > 0:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        checked = f"test/round {round_} checked"
        if rank == 0:
            # round 0's gloo keys, as torch nests its prefixes: "default_pg" / group "0/" /
            # device "cpu/" / gloo device "0" / rank
            keys = dist.PrefixStore("default_pg", store)
            for prefix in ("0/", "cpu/", "0"):
                keys = dist.PrefixStore(prefix, keys)
            stale = [r for r in range(int(os.environ["WORLD_SIZE"])) if keys.check([str(r)])]
            print(f"round {round_} stale keys {stale}", flush=True)
            store.set(checked, "1")
        else:
            store.wait([checked])  # rank 0 reads rank 1's key before rank 1 writes it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
    torch.manual_seed(0)
    ddp = leanddp.DistributedDataParallel(torch.nn.Linear(8, 4))
    ddp(torch.randn(3, 8)).sum().backward()
    print(f"round {round_} rank {rank} trained", flush=True)
    if round_ == 0:
        if rank == 1:
            os._exit(3)  # dies after construction, as a rank killed mid-run
        time.sleep(120)  # the survivor: torchrun stops it
    dist.destroy_process_group()
    """
)


def test_static_rendezvous_restart_finds_no_stale_gloo_keys(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--master-port", str(_free_port()), "--monitor-interval",
           "0.5", str(script), str(PG_TIMEOUT_S)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)
    out = done.stdout + done.stderr
    assert "round 1 stale keys []" in out, out[-4000:]
    assert done.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"round 1 rank {rank} trained" in out, out[-4000:]
