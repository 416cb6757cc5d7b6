"""The HTTP face of Freight: the OpenAI-compatible /v1 API and the web console."""
