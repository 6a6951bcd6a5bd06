"""Training runs: typed configs, sharded checkpoints and export (issue 6).

``torchweave.train`` sits just below ``torchweave.cli`` and may import every
layer beneath it.
"""
