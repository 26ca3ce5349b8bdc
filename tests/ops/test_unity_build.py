"""setup.py compiles csrc/*.cpp in groups, each one compiler run that includes its files
(``UNITY_GROUPS``): a name with internal linkage (``static``, an anonymous namespace) declared in
two of those files would meet the other in one translation unit. A type or variable declared
twice fails to compile; a function overloaded by another file's could take its calls without an
error. No name is declared so in two files (the declarations clang-format leaves at the start
of a line: functions, types, constants)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
#: an anonymous namespace's body, as clang-format leaves it
_ANONYMOUS = re.compile(r"^namespace \{\n(.*?)^\}  // namespace", re.S | re.M)
#: a declaration at the start of a line (the body's top level): a function's name before its
#: parameters, or the name of a type or a variable
_DECLARED = [
    re.compile(r"^(?!return\b)[A-Za-z_][\w:<>,*& \t]*?[\s*&](\w+)\(", re.M),
    re.compile(r"^(?:struct|class|enum(?: class)?)[ \t]+(\w+)", re.M),
    re.compile(
        r"^(?:static[ \t]+)?(?:constexpr|const)[ \t][\w:<>,*& \t]*?[ \t*&](\w+)[ \t]*[=\[{]", re.M
    ),
]
_STATIC = re.compile(r"^static[ \t][\w:<>,*& \t]*?[\s*&](\w+)[ \t]*[(=\[{]", re.M)


def internal_names(text: str) -> set[str]:
    """The names ``text`` gives internal linkage at its top level (identical ``using`` aliases
    may repeat: not counted)."""
    names = set(_STATIC.findall(text))
    for body in _ANONYMOUS.findall(text):
        for pattern in _DECLARED:
            names.update(pattern.findall(body))
    return names


def test_the_parser_finds_what_it_looks_for() -> None:
    text = (
        "namespace {\nconstexpr int64_t kGrain = 4;\nstruct Cut {\n  int x;\n};\n"
        "at::Tensor flat_of(const at::Tensor& t) {\n  return t;\n}\n"
        "template <typename T>\nT* first(std::vector<T>& v) {\n  for (auto& x : v) {\n"
        "  }\n}\n}  // namespace\nstatic bool armed = false;\nvoid exported(int);\n"
    )
    assert internal_names(text) == {"kGrain", "Cut", "flat_of", "first", "armed"}


def test_no_internal_name_repeats_across_grouped_files() -> None:
    where = defaultdict(list)
    for path in sorted(CSRC.glob("*.cpp")):
        for name in internal_names(path.read_text()):
            where[name].append(path.name)
    assert len(where) > 20  # (the files declare some)
    repeated = {name: files for name, files in where.items() if len(files) > 1}
    assert not repeated, f"declared with internal linkage in more than one file: {repeated}"
