"""The device side of decoding: the KV cache and its slots, one forward and prefill, prefill planning,
host-to-device transfers, sync counting and device timing. No decoding policy lives here."""
