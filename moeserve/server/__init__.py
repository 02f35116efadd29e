"""The OpenAI-compatible HTTP server: a FastAPI front end and an engine process behind ZeroMQ."""
