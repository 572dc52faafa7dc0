"""Benchmarks and studies: each module is a script (`python eval/NAME.py ...`) and importable as
`eval.NAME` (tests import them that way). The kvpress peer under `peers/` runs in its own
environment."""
