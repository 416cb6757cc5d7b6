"""Persistence: settings, database models and sessions, the object store, JSONL and Parquet I/O."""
