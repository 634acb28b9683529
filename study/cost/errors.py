"""Errors the cost model raises for inputs it cannot use."""


class CostInputError(ValueError):
    """Inputs the cost model cannot use (non-positive sizes, unsupported model type, bad mode)."""


class UnknownGPUError(CostInputError):
    """A GPU name that is not in the catalog."""
