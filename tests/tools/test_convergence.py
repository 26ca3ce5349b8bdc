"""benchmarks/convergence.py: its rates, its reuse of finished runs and its arithmetic, on bench
results written in place (launching the bench itself is tests/tools/test_bench.py's part)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from leanddp.bench._launch import parser as bench_parser
from leanddp.bench._model import MARKOV_BRANCHES, SIZES, markov_batches
from leanddp.bench._worker import parse as worker_parse

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence.py"
CONFIGS = ["torch DDP", "torch DDP + AdamW8bit"]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convergence", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(
    out: Path, lr: float, losses: dict[str, list[float]], steps: int = 300, data: str = "repeat"
) -> None:
    """A bench.json as ``python -m leanddp.bench`` writes it, with these losses."""
    args = dict(configs=str(CONFIGS), lr=repr(lr), steps=str(steps), accum="[1]", model="tiny")
    args["dtype"], args["data"] = "fp32", data
    env = dict(torch="t", python="p", cpu="c")
    runs = [dict(config=c, losses=losses[c]) for c in CONFIGS]
    (out / f"lr{lr!r}").mkdir(parents=True)
    (out / f"lr{lr!r}" / "bench.json").write_text(json.dumps(dict(args=args, env=env, runs=runs)))


def test_rates_are_spaced_around_the_central_one() -> None:
    conv = load()
    args = conv.parser().parse_args(["--lr", "0.002", "--jitter", "0.01", "--points", "5"])
    assert conv.rates(args) == [0.00196, 0.00198, 0.002, 0.00202, 0.00204]


def test_the_report_compares_each_rate_with_the_reference(tmp_path: Path) -> None:
    conv = load()
    argv = ["--points", "3", "--jitter", "0.001", "--out", str(tmp_path)]
    lrs = conv.rates(conv.parser().parse_args(argv))
    # reference finals 1.0, 1.02, 0.99; the other config 2% below, 0.5% above, level
    fp32 = [1.0, 1.02, 0.99]
    low = [0.98, 1.0251, 0.99]
    for lr, a, b in zip(lrs, fp32, low, strict=True):
        fake_run(tmp_path, lr, {CONFIGS[0]: [5.0] * 20 + [a], CONFIGS[1]: [5.0] * 20 + [b]})
    conv.main(argv)  # every rate read from its bench.json: nothing is launched
    md = (tmp_path / "convergence.md").read_text()
    assert "--configs 'torch DDP' 'torch DDP + AdamW8bit'`" in md  # the command, whole
    rows = [line for line in md.splitlines() if line.startswith("| 0.")]
    assert [r.split("|")[1].strip() for r in rows] == [repr(lr) for lr in lrs]
    assert [r.split("|")[6].strip() for r in rows] == ["-2.00%", "+0.50%", "+0.00%"]
    assert "within 1% at 2 of 3 rates" in md
    assert "mean change 2.47%, largest 2.94%" in md  # |1.02/1.0 - 1|, |0.99/1.02 - 1|
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["rates"][repr(lrs[0])][CONFIGS[1]][0] == 0.98
    try:  # the chart needs matplotlib (CI's second step runs without it)
        import matplotlib  # noqa: F401

        charted = True
    except ImportError:
        charted = False
    assert (tmp_path / "convergence.png").exists() == charted


def test_bad_arguments_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conv = load()
    for argv, message in (
        (["--points", "0"], "--points must be at least 1"),
        (["--jitter", "0.5", "--points", "5"], "reaches a rate <= 0"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lr", "0"], "--lr must be above 0"),
        (["--jitter", "-0.1"], "--jitter must be at least 0"),
        (["--configs", "torch DDP", "leanddp fast"], "no bench configuration ['leanddp fast']"),
        (["--configs", "torch DDP"], "a reference and at least one other"),
        (["--configs", "torch DDP", "torch DDP"], "a reference and at least one other"),
    ):
        with pytest.raises(SystemExit):
            conv.main([*argv, "--out", str(tmp_path / "x")])
        assert message in capsys.readouterr().err
        assert not (tmp_path / "x").exists(), message


def test_a_run_on_other_data_is_not_read_as_this_one(tmp_path: Path) -> None:
    """A rate's bench.json is reused only for the same --data (one written before the option
    existed trained on the repeated batches); the data is named in the report."""
    conv = load()
    found = {"args": dict(configs=str(CONFIGS), lr="0.001", steps="300", accum="[1]")}
    found["args"].update(model="tiny", dtype="fp32")
    for data, saved, same in (
        ("repeat", None, True),  # before --data: the repeated batches
        ("markov", None, False),
        ("markov", "markov", True),
        ("repeat", "markov", False),
    ):
        if saved is not None:
            found["args"]["data"] = saved
        args = conv.parser().parse_args(["--data", data])
        assert conv.same_run(found, args, 0.001) == same, (data, saved)
    argv = ["--points", "1", "--data", "markov", "--out", str(tmp_path)]
    fake_run(
        tmp_path, 0.001, {c: [0.7 + k * 0.01] * 30 for k, c in enumerate(CONFIGS)}, data="markov"
    )
    conv.main(argv)  # read, not launched
    md = (tmp_path / "convergence.md").read_text()
    assert "--data markov" in md and "falls towards ln 2" in md, md


def test_the_markov_data_follows_one_chain_on_every_rank() -> None:
    """--data markov: every token is followed by one of its MARKOV_BRANCHES successors, the
    same chain on every rank, each branch about equally often (so the loss floor is
    ln MARKOV_BRANCHES); a new batch each step, and other batches on another rank. The launcher
    and the worker take the same choices."""
    size = SIZES["tiny"]
    cpu = torch.device("cpu")
    seen: dict[int, set[int]] = {}
    follows: dict[tuple[int, int], int] = {}
    per_rank = [markov_batches(size, rank, 6, cpu) for rank in (0, 1)]
    for data in per_rank:
        assert len(data) == 6 and all(b.shape == (size.batch, size.seq + 1) for b in data)
        # a new batch every step
        assert all(not torch.equal(a, b) for a, b in zip(data, data[1:], strict=False))
        for b in data:
            pairs = zip(b[:, :-1].flatten().tolist(), b[:, 1:].flatten().tolist(), strict=True)
            for a, c in pairs:
                seen.setdefault(a, set()).add(c)
                follows[(a, c)] = follows.get((a, c), 0) + 1
    assert not torch.equal(per_rank[0][0], per_rank[1][0])
    assert max(len(s) for s in seen.values()) == MARKOV_BRANCHES  # one chain on both ranks
    assert sum(len(s) == MARKOV_BRANCHES for s in seen.values()) > 0.5 * len(seen)
    # each token's successors about equally often: the first's share near 1/MARKOV_BRANCHES
    both = {(a, c): n for (a, c), n in follows.items() if len(seen[a]) == MARKOV_BRANCHES}
    first = sum(n for (a, c), n in both.items() if c == min(seen[a]))
    assert abs(first / sum(both.values()) - 1 / MARKOV_BRANCHES) < 0.03
    assert markov_batches(size, 0, 6, cpu)[3].equal(per_rank[0][3])  # the same every run
    assert worker_parse(["--result", "x", "--config", "torch DDP", "--data", "markov"]).data == (
        "markov"
    )
    assert bench_parser().parse_args(["--data", "markov"]).data == "markov"
