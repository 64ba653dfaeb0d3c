"""The FP4-KV engine. No Ray imports below this package."""
