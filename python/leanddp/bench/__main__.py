"""``python -m leanddp.bench``: see ``python -m leanddp.bench --help``."""

from leanddp.bench._launch import main

main()
