"""Data pipeline: tokenizers (tokenizer.py), jsonl checks (jsonl.py), preprocessing to
Megatron indexed datasets (preprocess.py, indexed.py), GPT samples (gpt_dataset.py) and
per-source / blended / validation batches and vocabulary sets (sources.py)."""
