"""Serving runtime: engine, scheduler, KV cache, sampler, API, chat format."""
