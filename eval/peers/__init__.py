"""Peers run in their own environments (kvpress pins transformers < 5.3)."""
