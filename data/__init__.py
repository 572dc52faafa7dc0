"""The offline training-data builder (`python data/build.py --out data/train.jsonl`)."""
