"""The OpenAI-compatible HTTP server (`specserve serve`): protocol.py (request/response shapes),
async_engine.py (the engine in its own thread), metrics.py (Prometheus), app.py (FastAPI + uvicorn)."""
