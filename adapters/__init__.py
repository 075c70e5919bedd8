"""lossplug.adapters — the only modules that import trl or verl (each lazily, on use)."""
