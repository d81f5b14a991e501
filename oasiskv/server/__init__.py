"""OpenAI-compatible HTTP server around ``LLMEngine`` (needs the ``server`` extra: fastapi, uvicorn,
prometheus-client). ``api.serve`` runs it; the engine never imports this package."""
