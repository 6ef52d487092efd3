"""Flat buffers: packing parameters into contiguous, padded storage and each rank's range."""
