"""The README's first screen answers what, how to install and how to use it, and its table is
the latest bench run recorded in benchmarks/RESULTS.md.

``python tests/docs/test_readme.py --write`` rewrites the README's table from that run (after a
new run is recorded with its ``<!-- bench-run DATE COMMIT -->`` marker).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN = "<!-- bench-table: generated from the latest bench run in benchmarks/RESULTS.md"
END = "<!-- bench-table:end -->"
#: the README's rows: the bench's configuration, and the README's name for it
ROWS = [
    ("torch DDP", "torch's DDP + `AdamW(fused=True)`"),
    ("leanddp", "leanddp"),
    ("leanddp + optimizer_in_backward", "+ `optimizer_in_backward`"),
    ("leanddp + offload_to_cpu", "+ `offload_to_cpu`"),
    ("leanddp in-backward sharded", "in-backward + `shard_optimizer_state`"),
    ("leanddp offload sharded", "offload + `shard_optimizer_state`"),
]
FIRST_SCREEN = 40  # lines

pytestmark = pytest.mark.docs


def latest_bench_run(text: str) -> tuple[str, dict[tuple[str, int], dict[str, str]]]:
    """The latest ``bench-run`` table of RESULTS.md (by date, then position): its marker, and
    its rows by (configuration, accumulation), each a dict by column name."""
    marks = list(re.finditer(r"<!-- bench-run (\d{4}-\d\d-\d\d) (\w+) -->\n", text))
    assert marks, "benchmarks/RESULTS.md records no bench-run table"
    mark = max(enumerate(marks), key=lambda im: (im[1].group(1), im[0]))[1]
    lines = text[mark.end() :].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["configuration"], int(cells["accum"])] = cells
    return mark.group(0).strip(), rows


def _host_bytes_per_param(row: dict[str, str]) -> str:
    host = row["on the host"]
    if host == "—":
        return "—"  # (fp32 parameters: 4 bytes each, so parameters MiB / 4 is the count)
    return f"+{float(host) / float(row['parameters']) * 4:.0f}"


def readme_table(rows: dict[tuple[str, int], dict[str, str]]) -> str:
    """The README's table: per configuration, bytes per parameter on the device and on the
    host, and the step time against torch's DDP, without and with accumulation 4."""
    out = [
        "| | bytes per parameter on the device | + on the host | step time vs torch's DDP "
        "| with accumulation 4: on the device | + on the host | step time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config, name in ROWS:
        one, four = rows[config, 1], rows[config, 4]
        cells = [name]
        for row in (one, four):
            cells += [
                row["bytes per parameter on the device"],
                _host_bytes_per_param(row),
                row["vs torch DDP"],
            ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _readme_block(text: str) -> tuple[int, int]:
    start = text.index(BEGIN)
    start = text.index("\n", start) + 1
    return start, text.index(END)


def test_the_readme_table_is_the_latest_bench_run() -> None:
    mark, rows = latest_bench_run(RESULTS.read_text())
    text = README.read_text()
    start, end = _readme_block(text)
    assert text[start:end].strip() == readme_table(rows), (
        f"README.md's table is not {mark}'s: run python tests/docs/test_readme.py --write"
    )


def test_the_first_screen_says_what_install_and_use() -> None:
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    assert "drop-in subclass of torch's `DistributedDataParallel`" in first
    assert "pip install --no-build-isolation ." in first  # install
    assert "model = leanddp.DistributedDataParallel(model)" in first  # the loop change
    assert BEGIN in first and END in first  # the measured table
    assert "docs/getting-started.md" in first


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    text = README.read_text()
    start, end = _readme_block(text)
    table = readme_table(latest_bench_run(RESULTS.read_text())[1])
    README.write_text(text[:start] + table + "\n" + text[end:])
