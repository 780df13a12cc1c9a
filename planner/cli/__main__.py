"""``python -m planner.cli``: the same as the ``plan3d`` console script."""

from planner.cli import main

main()
