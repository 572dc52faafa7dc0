"""The files of an evaluation folder: the row store (`results.jsonl`) and the rest (lock, prompts, config)."""
