"""HTTP serving: the engine on its own thread (async_engine), the OpenAI and SGLang APIs (app)."""
