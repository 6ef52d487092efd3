"""Mixed precision: the compute dtype versus fp32 master weights, loss scaling, and whether
a device can compute in a dtype at all."""

from zerotrain.precision.dtypes import UnsupportedDtypeError, check_device_supports
from zerotrain.precision.loss_scaler import LossScaler

__all__ = ["LossScaler", "UnsupportedDtypeError", "check_device_supports"]
