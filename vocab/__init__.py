"""Words shared by the engine's callers and storage, defined once; this package imports nothing of the project."""
