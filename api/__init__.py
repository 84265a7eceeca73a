"""HTTP API (Litestar): multipart uploads and OpenAI-compatible routes."""
