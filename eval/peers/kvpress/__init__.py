"""NVIDIA kvpress on the same prompts as the harness, in its own environment (`run.sh`)."""
