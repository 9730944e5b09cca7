"""The HTTP / WebSocket front end: an OpenAI-compatible API, chat sessions, a chat page, metrics.

  app.py         create_app(engine, server_config): routes, middleware, the engine's lifespan
  serve.py       `streamer serve`: its flags, the engine it starts, uvicorn
  state.py       ServerState: admission, the server's policy, streams of engine requests
  openai_api.py  /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models
  native_api.py  /generate, /tokenize, /apply_chat_template (the frontend language's server API)
  websocket.py   /v1/chat/ws chat sessions (the protocol is in its docstring)
  protocol.py    request/response bodies (msgspec Structs) and their mapping to SamplingParams
  limits.py      request limits, checked before any work
  guard.py       Host / Origin, API key and JSON body middleware
  transport.py   connection limits and timeouts under uvicorn
  metrics.py     Prometheus metrics, one registry per app
  static/        the chat page served at /

The server depends on the engine through engine/protocol.py's Engine alone, and never
tokenizes for it: prompts, token ids and messages go to the engine as they are.
"""
