"""Parallel dimensions beyond data parallelism: the process mesh (tensor and pipeline
parallelism plug into it)."""
