"""The main job: torch's DDP against leanddp's configurations, memory by category and speed.

Run ``python -m leanddp.bench --help`` (or the ``leanddp-bench`` command). Each configuration
trains under its own torchrun, so peak process memory is per configuration.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark (what ``python -m leanddp.bench`` runs).

    Args:
        argv: its command-line arguments (default: ``sys.argv[1:]``), listed below.
    """
    from leanddp.bench._launch import main as launch_main  # torch only when it runs

    launch_main(argv)


__all__ = ["main"]
