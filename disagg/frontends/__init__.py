"""Front doors above the Python API (`disagg.api`): the OpenAI- and Ollama-compatible
HTTP gateway with its guard, the web view it serves at /ui (with its Prometheus
/metrics), and the batch runner. Each turns its input into one
`GenerateRequest` by a pure function and hands it to a `Client`."""
