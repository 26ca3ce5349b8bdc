"""Checks that a source distribution holds what the build reads and nothing else.

    python tests/scripts/check_sdist.py dist/leanddp-X.Y.Z.tar.gz

Run from the source checkout (a git clone) it was built from. Expected: every tracked file under
csrc/ and python/leanddp/, the files setup.py and pyproject.toml read (build_support.py,
README.md, LICENSE), CHANGELOG.md and MANIFEST.in, plus what setuptools generates (PKG-INFO,
setup.cfg, the egg-info). Missing or extra members exit 1, listed. That the sdist then builds is
shown by building a wheel from it (.ci/run).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import PurePosixPath

TOP_LEVEL = {
    "setup.py",
    "pyproject.toml",
    "build_support.py",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "MANIFEST.in",
}
GENERATED = {"PKG-INFO", "setup.cfg"}
GENERATED_DIR = "python/leanddp.egg-info/"


def expected() -> set[str]:
    tracked = subprocess.run(
        ["git", "ls-files", "csrc", "python/leanddp", *sorted(TOP_LEVEL)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return set(tracked) | GENERATED


def members(path: str) -> set[str]:
    with tarfile.open(path) as tar:
        files = [m.name for m in tar.getmembers() if m.isfile()]
    # every member lies under the one top directory leanddp-X.Y.Z/
    return {str(PurePosixPath(*PurePosixPath(f).parts[1:])) for f in files}


def main(path: str) -> int:
    have = members(path)
    want = expected()
    missing = sorted(want - have)
    extra = sorted(f for f in have - want if not f.startswith(GENERATED_DIR))
    for name in missing:
        print(f"missing from the sdist: {name}")
    for name in extra:
        print(f"in the sdist but not read by the build: {name}")
    print(f"check_sdist: {len(have)} files, {len(missing)} missing, {len(extra)} extra")
    return 1 if missing or extra else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
