"""Errors that callers are expected to handle."""


class InputError(ValueError):
    """A request the engine cannot run as given (empty prompt, over-context, bad settings)."""


class PairError(ValueError):
    """A draft/target pair that cannot work together (different tokenizers, unknown name)."""
