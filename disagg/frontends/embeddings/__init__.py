"""Embeddings: Ollama's `/api/embed` (and the older `/api/embeddings`) and OpenAI's
`/v1/embeddings`, computed by the model's prefill agent."""
