"""Lists what a coverage run of leanddp's C++ never executed (tests/scripts/coverage.sh runs it).

    python tests/scripts/coverage_report.py --build-temp DIR --src TREE [--output FILE]

Reads the gcov counts of a LEANDDP_COVERAGE=1 build (the .gcno/.gcda files under --build-temp,
through ``gcov --json-format``) and writes, for every file under TREE/csrc/ that was compiled,
a markdown list: a summary table (lines, functions, branches executed), then per file

- the functions that never ran (template and instruction-set copies grouped by source line),
- the lines that never ran inside functions that did, grouped into ranges,
- the branches never taken on lines that ran and hold a decision (if, ?:, &&, loops...), where
  no unexecuted range right after the line shows it already; error paths never taken (checks
  that never failed: TORCH_CHECK and the like; throws; catch handlers never entered) are
  listed together, by line number only.

At -O0, gcov also counts code that runs only when an exception unwinds (destructors of
temporaries) on lines of its own: closing braces, and lines of a statement other than the one
that ran. Such lines are not listed when another line of their statement ran, and the branches
the compiler makes for such cleanups (on closing braces and on lines without a decision) are
counted in the summary but not listed.

Counts are merged over translation units (an inline function in a header counts wherever it
ran) and over the functions sharing a line. Branches are gcov's conditional branches; the
exception edges of calls that may throw are left out (gcovr's --exclude-throw-branches).

Tags are hints from the source text, not a classification (docs/gpu-only-code.md classifies):
``check`` every statement of the item raises or handles an error (TORCH_CHECK, throw, catch);
``device`` the item mentions CUDA, streams, events, NCCL or pinned memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ERROR_MARKERS = re.compile(
    r"\b(TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*|throw|rethrow\w*|catch|AT_ERROR|C10_THROW_ERROR|"
    r"TORCH_CHECK_VALUE|TORCH_CHECK_TYPE|TORCH_CHECK_INDEX)\b"
)
DEVICE_MARKERS = re.compile(
    r"cuda|CUDA|[Ss]tream|[Ee]vent|nccl|NCCL|pinned|runs_apart|device_ordered", re.ASCII
)
# a line that ends a statement or opens/closes a block: the next line starts a new statement
# (a brace that opens an initializer, "name{" or "= {", does not: Google style puts a space
# before a block's brace and none in "name{")
STATEMENT_END = re.compile(r"(;|}|(?<![=(,{\s])\s+\{|^\s*\{)\s*(//.*)?$|^\s*(//.*|#.*)?$")
# a decision in the source: branches on other lines are the compiler's (cleanups of temporaries)
DECISION = re.compile(r"\b(if|for|while|switch|case|catch)\b|\?|&&|\|\|")
# a line with nothing but the end of a scope or of a call: what gcov counts there is the
# destructors run when an exception unwinds through it
CLOSING = re.compile(r"^\s*[)}\]]+[,;)]*\s*(//.*)?$")


def balance(line: str) -> tuple[int, int]:
    """Parentheses and braces opened minus closed on a line (outside literals and comments)."""
    line = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', "", line).split("//")[0]
    return line.count("(") - line.count(")"), line.count("{") - line.count("}")


@dataclass
class Function:
    name: str  # demangled
    start: int
    end: int
    count: int = 0


@dataclass
class LineEntry:
    """One function's code on one line (a line holds several: lambdas, template copies)."""

    count: int = 0
    branches: list[int] = field(default_factory=list)  # taken counts, throw edges left out


@dataclass
class FileCov:
    functions: dict[str, Function] = field(default_factory=dict)  # by mangled name
    lines: dict[tuple[int, str], LineEntry] = field(default_factory=dict)  # (line, mangled)


def run_gcov(gcov: str, gcno: Path) -> dict | None:
    """gcov's JSON for one object file (zero counts where the object never ran: no .gcda)."""
    done = subprocess.run(
        [
            gcov,
            "--json-format",
            "--stdout",
            "--branch-probabilities",
            "--demangled-names",
            "--object-directory",
            str(gcno.parent),
            str(gcno.with_suffix(".gcda")),
        ],
        capture_output=True,
        text=True,
        cwd=gcno.parent,
    )
    out = done.stdout.strip()
    if done.returncode != 0 or not out:
        print(
            f"gcov failed on {gcno} (exit status {done.returncode}):\n{done.stderr}",
            file=sys.stderr,
        )
        return None
    return json.loads(out.splitlines()[0])  # one JSON document per line, one per object


def collect(build_temp: Path, src: Path, gcov: str) -> tuple[dict[str, FileCov], list[str]]:
    csrc = (src / "csrc").resolve()
    files: dict[str, FileCov] = defaultdict(FileCov)
    missing = []
    gcnos = sorted(build_temp.rglob("*.gcno"))
    if not gcnos:
        raise SystemExit(f"no .gcno files under {build_temp}: not a LEANDDP_COVERAGE=1 build")
    for gcno in gcnos:
        if not gcno.with_suffix(".gcda").exists():
            missing.append(str(gcno.relative_to(build_temp)))
        data = run_gcov(gcov, gcno)
        if data is None:
            raise SystemExit(1)
        cwd = Path(data.get("current_working_directory", gcno.parent))
        for f in data["files"]:
            path = Path(os.path.normpath(cwd / f["file"]))
            try:
                rel = "csrc/" + str(path.resolve().relative_to(csrc))
            except ValueError:
                continue  # torch's headers, the standard library
            cov = files[rel]
            for fn in f["functions"]:
                have = cov.functions.setdefault(
                    fn["name"],
                    Function(
                        fn.get("demangled_name", fn["name"]),
                        fn["start_line"],
                        fn["end_line"],
                    ),
                )
                have.count += fn["execution_count"]
            for ln in f["lines"]:
                key = (ln["line_number"], ln.get("function_name", ""))
                entry = cov.lines.setdefault(key, LineEntry())
                entry.count += ln["count"]
                taken = [b["count"] for b in ln["branches"] if not b.get("throw")]
                if not entry.branches:
                    entry.branches = taken
                elif len(entry.branches) == len(taken):
                    entry.branches = [a + b for a, b in zip(entry.branches, taken, strict=True)]
                else:  # the same function compiled differently in two objects: keep the wider
                    entry.branches = max(entry.branches, taken, key=len)
    return files, missing


# ------------------------------------------------------------------------------------------
# Presentation


def short_name(name: str) -> str:
    """A demangled name made readable: no leanddp::, no parameter lists, short lambdas."""
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\{lambda\([^{}]*\)#(\d+)\}", r"{lambda#\1}", name)
    out, depth = [], 0
    for ch in name:  # drop parameter lists, keep the names around them
        if ch == "(":
            depth += 1
            if depth == 1:
                out.append("(…)")
            continue
        if ch == ")":
            depth -= 1
            continue
        if depth == 0:
            out.append(ch)
    name = "".join(out).replace("(…)(…)", "(…)")
    name = re.sub(r"\bleanddp::", "", name)
    name = re.sub(r"\bc10::", "", name)
    if len(name) > 110:
        name = name[:107] + "…"
    return name


def code(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return "`" + text.replace("`", "'") + "`" if text else ""


class Source:
    def __init__(self, path: Path):
        self.lines = path.read_text(errors="replace").splitlines() if path.exists() else []

    def __getitem__(self, n: int) -> str:
        return self.lines[n - 1] if 0 < n <= len(self.lines) else ""

    def statement_start(self, n: int) -> int:
        """The first line of the statement line n belongs to: the nearest line at or above n
        that follows a line ending a statement (or a block) and opens every parenthesis and
        brace that the lines down to n close (so the arguments after a lambda's body belong to
        the call the lambda is passed to). Looks back at most 60 lines."""
        start = n
        parens, braces = balance(self[n])
        while start > 1 and n - start < 60:
            if parens >= 0 and braces >= 0 and STATEMENT_END.search(self[start - 1]):
                break
            start -= 1
            p, b = balance(self[start])
            parens, braces = parens + p, braces + b
        return start

    def statement_end(self, n: int) -> int:
        """The last line of the statement line n belongs to (looking on at most 60 lines)."""
        end = n
        while end < len(self.lines) and end - n < 60 and not STATEMENT_END.search(self[end]):
            end += 1
        return end

    def statement(self, n: int) -> str:
        """The text of the statement line n belongs to (from its start up to line n)."""
        return " ".join(self[i].strip() for i in range(self.statement_start(n), n + 1))

    def raises(self, n: int) -> bool:
        return bool(ERROR_MARKERS.search(self.statement(n)))


def ranges(numbers: list[int]) -> str:
    out, i = [], 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        out.append(f"{numbers[i]}" if i == j else f"{numbers[i]}-{numbers[j]}")
        i = j + 1
    return ", ".join(out)


def pct(a: int, b: int) -> str:
    return f"{100.0 * a / b:.1f}% ({a}/{b})" if b else "–"


@dataclass
class Summary:
    lines: tuple[int, int]
    functions: tuple[int, int]
    branches: tuple[int, int]


def summarize(cov: FileCov) -> Summary:
    by_line: dict[int, int] = defaultdict(int)
    br_total = br_taken = 0
    for (line, _), e in cov.lines.items():
        by_line[line] += e.count
        br_total += len(e.branches)
        br_taken += sum(1 for c in e.branches if c > 0)
    fn_run = sum(1 for f in cov.functions.values() if f.count > 0)
    return Summary(
        (sum(1 for c in by_line.values() if c > 0), len(by_line)),
        (fn_run, len(cov.functions)),
        (br_taken, br_total),
    )


def file_report(rel: str, cov: FileCov, src: Source) -> list[str]:
    s = summarize(cov)
    out = [
        f"## {rel}",
        "",
        f"lines {pct(*s.lines)} · functions {pct(*s.functions)} · branches {pct(*s.branches)}",
        "",
    ]
    # -- functions never run, grouped by where they start (template / ISA copies) -------------
    groups: dict[int, list[Function]] = defaultdict(list)
    for f in cov.functions.values():
        groups[f.start].append(f)
    dead_spans: list[tuple[int, int]] = []
    fn_items = []
    for start in sorted(groups):
        fs = groups[start]
        never = [f for f in fs if f.count == 0]
        if not never:
            continue
        end = max(f.end for f in never)
        text = " ".join(src[i] for i in range(start, end + 1))
        tags = []
        if DEVICE_MARKERS.search(text) or any(DEVICE_MARKERS.search(f.name) for f in never):
            tags.append("device")
        tag = f" [{', '.join(tags)}]" if tags else ""
        names = sorted({short_name(f.name) for f in never})
        if len(never) == len(fs):
            dead_spans.append((start, end))
            shown = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} copies)"
            fn_items.append(f"- L{start}-{end} `{shown}`{tag}")
        else:
            listed = "; ".join(f"`{n}`" for n in names[:4])
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            fn_items.append(
                f"- L{start}-{end}: {len(never)} of {len(fs)} copies never ran: {listed}{more}{tag}"
            )
    if fn_items:
        out += ["**Functions never run**", "", *fn_items, ""]

    def in_dead(line: int) -> bool:
        return any(a <= line <= b for a, b in dead_spans)

    # -- lines never run in functions that ran ------------------------------------------------
    line_count: dict[int, int] = defaultdict(int)
    line_fns: dict[int, set[str]] = defaultdict(set)
    for (line, fn), e in cov.lines.items():
        line_count[line] += e.count
        line_fns[line].add(fn)
    instrumented = sorted(line_count)
    fn_of = {m: f for m, f in cov.functions.items()}

    def owner(line: int) -> str:
        names = [fn_of[m].name for m in line_fns[line] if m in fn_of]
        if not names:  # (lines of a lambda in a template carry no function name)
            around = [f for f in cov.functions.values() if f.start <= line <= f.end]
            if not around:
                return "?"
            narrowest = min(f.end - f.start for f in around)
            names = [f.name for f in around if f.end - f.start == narrowest]
        return short_name(min(names, key=len))

    def unwinding_only(line: int) -> bool:
        """A line that never ran only because exceptions never unwound through it: a closing
        brace, or a line of a statement whose other lines ran (at -O0 gcov puts the cleanup of
        a statement's temporaries on lines of their own)."""
        if CLOSING.match(src[line]):
            return True
        span = range(src.statement_start(line), src.statement_end(line) + 1)
        return any(line_count.get(n, 0) > 0 for n in span if n != line)

    regions: list[list[int]] = []
    for i, line in enumerate(instrumented):
        if line_count[line] > 0 or in_dead(line) or unwinding_only(line):
            continue
        if (
            regions
            and regions[-1][-1] == instrumented[i - 1]
            and owner(line) == owner(regions[-1][-1])
        ):
            regions[-1].append(line)
        else:
            regions.append([line])
    region_items = []
    check_lines_dead = []
    for r in regions:
        if re.search(r"\bcatch\b", src[r[0]]) or all(src.raises(n) for n in r):
            check_lines_dead.extend(r)
            continue
        text = " ".join(src[n] for n in r)
        tag = " [device]" if DEVICE_MARKERS.search(text) else ""
        span = f"L{r[0]}" if len(r) == 1 or r[0] == r[-1] else f"L{r[0]}-{r[-1]}"
        region_items.append(f"- {span} in `{owner(r[0])}`: {code(src[r[0]])}{tag}")
    if region_items:
        out += ["**Lines never run** (in functions that ran)", "", *region_items, ""]

    # -- branches never taken on lines that ran -----------------------------------------------
    region_starts = {r[0] for r in regions}
    next_line = dict(itertools.pairwise(instrumented))
    branch_items = []
    check_lines = []
    for line in instrumented:
        if line_count[line] == 0:
            continue
        by_width: dict[int, list[int]] = {}
        for (ln, _fn), e in cov.lines.items():
            if ln != line or e.count == 0 or not e.branches:
                continue
            have = by_width.get(len(e.branches))
            by_width[len(e.branches)] = (
                list(e.branches)
                if have is None
                else [a + b for a, b in zip(have, e.branches, strict=True)]
            )
        untaken = sum(sum(1 for c in bs if c == 0) for bs in by_width.values())
        total = sum(len(bs) for bs in by_width.values())
        if not untaken:
            continue
        if src.raises(line):
            check_lines.append(line)
            continue
        if CLOSING.match(src[line]) or not DECISION.search(src.statement(line)):
            continue  # compiler-made branches only (see DECISION, CLOSING)
        nxt = next_line.get(line)
        if nxt in region_starts:
            continue  # the range that never ran, listed above, shows it
        tag = " [device]" if DEVICE_MARKERS.search(src.statement(line)) else ""
        where = f"- L{line} in `{owner(line)}`"
        branch_items.append(f"{where}: {untaken} of {total} never taken: {code(src[line])}{tag}")
    if branch_items:
        out += ["**Branches never taken** (on lines that ran)", "", *branch_items, ""]
    if check_lines or check_lines_dead:
        both = sorted(set(check_lines) | set(check_lines_dead))
        out += [f"**Error paths never taken** [check]: lines {ranges(both)}", ""]
    if len(out) == 4:
        out += ["everything ran", ""]
    return out


def report(files: dict[str, FileCov], src: Path, notes: list[str], missing: list[str]) -> str:
    empty = {rel for rel, cov in files.items() if not cov.lines}  # declarations only
    order = sorted(set(files) - empty, key=lambda r: (r.count("/"), r))
    out = ["# leanddp C++ coverage: what the tests never ran", ""]
    out += [f"- {n}" for n in notes]
    if missing:
        out.append(f"- objects with no counts at all (never loaded?): {', '.join(missing)}")
    not_built = sorted(
        str(p.relative_to(src))
        for p in (src / "csrc").rglob("*")
        if p.suffix in (".cpp", ".cu", ".cuh", ".h") and str(p.relative_to(src)) not in order
    )
    if not_built:
        out.append(f"- not compiled in this build, or no code of their own: {', '.join(not_built)}")
    out += [
        "- tags are hints from the source text: `check` raises or handles an error, `device` "
        "mentions CUDA, streams, events, NCCL or pinned memory",
        "",
        "| file | lines | functions | branches |",
        "| --- | --- | --- | --- |",
    ]
    tot = [0] * 6
    for rel in order:
        s = summarize(files[rel])
        out.append(f"| {rel} | {pct(*s.lines)} | {pct(*s.functions)} | {pct(*s.branches)} |")
        for i, v in enumerate((*s.lines, *s.functions, *s.branches)):
            tot[i] += v
    out.append(
        f"| **total** | {pct(tot[0], tot[1])} | {pct(tot[2], tot[3])} | {pct(tot[4], tot[5])} |"
    )
    out.append("")
    for rel in order:
        out += file_report(rel, files[rel], Source(src / rel))
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--build-temp",
        type=Path,
        required=True,
        help="where the coverage build's objects (.gcno) and counts (.gcda) are",
    )
    ap.add_argument("--src", type=Path, required=True, help="the tree that was compiled")
    ap.add_argument(
        "--gcov", default=os.environ.get("GCOV", "gcov"), help="gcov of the GCC that compiled it"
    )
    ap.add_argument("--output", type=Path, help="also write the list here")
    ap.add_argument("--note", action="append", default=[], help="a line for the header")
    args = ap.parse_args()
    files, missing = collect(args.build_temp.resolve(), args.src.resolve(), args.gcov)
    text = report(files, args.src.resolve(), args.note, missing)
    if args.output:
        args.output.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
