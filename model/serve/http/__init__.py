"""The HTTP layer: OpenAI and Anthropic APIs, health and Prometheus metrics over any engine with
the `EngineProtocol` shape (model/serve/engine/generation.py).

app.py builds the FastAPI app behind guard.py (origins, auth, body rules, status counts);
protocol.py, content.py and tools.py validate requests at the edge; errors.py shapes errors per
API; serving.py holds what both APIs share (prompts, limits, starting a generation);
openai_api.py and anthropic_api.py the response shapes, sse.py the event stream; metrics.py the
Prometheus metrics; limits.py the client limits; server.py runs it all (`autoopt serve`).
"""
