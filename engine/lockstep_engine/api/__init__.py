"""The engine's OpenAI-compatible HTTP server (API process side); imports FastAPI only in `app`."""
