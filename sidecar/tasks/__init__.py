"""Sidecar tasks: the engine that runs a main output by speculative decoding and then each task by the
draft alone, its requests and outputs, the task definitions and the prompts."""
