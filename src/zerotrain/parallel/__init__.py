"""Parallelism beyond data parallelism: the rank grid and its communicators (pipeline,
tensor and sequence parallelism build on them)."""

from zerotrain.parallel.groups import ProcessGroups
from zerotrain.parallel.topology import AXES, ZERO_AXES, Coordinates, Topology

__all__ = ["AXES", "ZERO_AXES", "Coordinates", "ProcessGroups", "Topology"]
