"""The mesh axis names every stage agrees on, defined once."""

DATA = "data"
"""The data-parallel axis: splits the batch (and, with ZeRO, optimizer state and weights)."""
MODEL = "model"
"""The tensor-parallel axis: splits weights and activations, kept inside a node."""
PIPE = "pipe"
"""The pipeline axis of a staged plan's mesh: one block of devices per stage, outermost."""
