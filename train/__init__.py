"""Training of the gating head: config, data, checkpoints and the loop behind `train.py`."""
