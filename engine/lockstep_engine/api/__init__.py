"""The engine's OpenAI-compatible HTTP server, API-process side (FastAPI/Starlette live in app, serving, errors)."""
