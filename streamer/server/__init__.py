"""The HTTP / WebSocket front end: an OpenAI-compatible API, chat sessions, a chat page, metrics.

  app.py         create_app(engine, server_config) and `streamer serve`
  openai_api.py  /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models
  websocket.py   /v1/chat/ws chat sessions (the protocol is in its docstring)
  protocol.py    request/response bodies (msgspec Structs) and their mapping to SamplingParams
  metrics.py     Prometheus metrics, one registry per app
  static/        the chat page served at /
"""
