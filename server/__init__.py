"""specserve's OpenAI-compatible HTTP server."""
