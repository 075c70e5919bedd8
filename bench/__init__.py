"""lossplug's benchmarks against the trainers' own code (not part of the distribution): ``python -m bench``."""
