"""Optimizers over flat tensors (Adam/AdamW, SGD, LAMB) and learning-rate schedules."""

from zerotrain.optim.adam import Adam
from zerotrain.optim.base import FlatOptimizer
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.sgd import SGD

__all__ = ["SGD", "Adam", "FlatOptimizer", "Lamb"]
