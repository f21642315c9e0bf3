"""Data preparation: parquet converters and the shared prompt dataset (the system prompts are the model families'
own, in models/)."""
