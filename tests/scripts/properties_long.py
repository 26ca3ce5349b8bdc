"""A longer run of tests/ddp/test_properties.py's property: fresh random examples (not CI's
fixed ones), a line per example, hypothesis's statistics at the end.

    cd tests && PYTHONPATH=../python python scripts/properties_long.py --examples 500

``--seed`` replays a run. Exits with pytest's status.
"""

import argparse
import os
import random
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    args = parser.parse_args()
    seed = random.randrange(2**32) if args.seed is None else args.seed
    print(f"{args.examples} examples, hypothesis seed {seed} (replay: --seed {seed})", flush=True)
    env = dict(
        os.environ,
        LEANDDP_PROPERTY_EXAMPLES=str(args.examples),
        LEANDDP_PROPERTY_RANDOM="1",
        LEANDDP_PROPERTY_PROGRESS="1",
    )
    command = [
        sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
        "ddp/test_properties.py::test_leanddp_trains_as_torch_ddp",
        f"--hypothesis-seed={seed}", "--hypothesis-show-statistics",
    ]  # fmt: skip
    return subprocess.call(command, cwd=TESTS, env=env)


if __name__ == "__main__":
    sys.exit(main())
