"""plan3d validate: run a plan with torch.distributed and compare measured memory and time with the prediction.

Only ``worker``, ``model`` and ``kernels`` import torch; the launcher and the miniature are pure.
"""
