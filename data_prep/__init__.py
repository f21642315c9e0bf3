"""Data preparation: parquet converters, prompt constants and the shared prompt dataset."""
