"""plan3d: planner for 3D-parallel training of large transformers."""

__version__ = "0.1.0"
