"""HTTP front end: OpenAI-compatible API, tokenization and Prometheus metrics; knows nothing about tensors."""
