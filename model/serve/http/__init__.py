"""The HTTP layer: OpenAI and Anthropic APIs, health and Prometheus metrics over any engine with
the `EngineProtocol` shape (model/serve/engine/generation.py).

app.py builds the FastAPI app; protocol.py holds the request models and error shapes; serving.py
what both APIs share (prompts, limits, starting a generation); openai_api.py and
anthropic_api.py the response shapes; metrics.py the Prometheus metrics; server.py runs it all
(`autoopt serve`).
"""
