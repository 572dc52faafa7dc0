"""Serving compressed contexts: compress once, ask many (`compressed`), and integrations with
serving engines."""
