"""Small helpers shared by every layer: logging, invariants, memory probes."""
