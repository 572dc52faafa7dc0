"""From rows to numbers, tables and figures: summaries, `summary.csv` / `summary.md`, plots, decode reports."""
