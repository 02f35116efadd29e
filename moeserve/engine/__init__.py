"""The engine loop (scheduler + model runner) and the offline LLM API."""
