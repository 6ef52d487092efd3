"""Parallelism beyond data parallelism: the rank grid (pipeline, tensor and sequence
parallelism build on it)."""

from zerotrain.parallel.topology import AXES, ZERO_AXES, Coordinates, Topology

__all__ = ["AXES", "ZERO_AXES", "Coordinates", "Topology"]
