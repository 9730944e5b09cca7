"""The HTTP / WebSocket front end: an OpenAI-compatible API, chat sessions, a chat page, metrics.

  app.py         create_app(engine, server_config): routes, middleware, the engine's lifespan
  serve.py       `streamer serve`: its flags, the engine it starts, uvicorn
  state.py       ServerState: admission, the server's policy, streams of engine requests
  openai_api.py  /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{model}
  openai_output.py  engine outputs -> OpenAI's responses and SSE chunks, logprobs, echo
  native_api.py  /generate, /tokenize, /detokenize, /apply_chat_template, /version
  websocket.py   /v1/chat/ws chat sessions (the protocol is in its docstring)
  protocol.py    request bodies (msgspec Structs) and their mapping to SamplingParams
  responses.py   response bodies (msgspec Structs)
  chat_output.py tools and reasoning of a chat request: parsers and grammar chosen once, per-choice output
  tool_parsers.py, tool_stream.py  tool-call markup (hermes, llama3_json, mistral, openai) -> calls, whole or streamed
  tool_parsers_deepseek.py  DeepSeek's tool-call markup (deepseek_v3, deepseek_v31), as a tool_stream.ToolStream
  tool_grammar.py  the grammar of tool_choice (xgrammar structural tags), and grammars after reasoning
  reasoning.py   <think> text -> reasoning_content (qwen3, deepseek_r1; openai_gptoss), whole or streamed
  harmony.py     gpt-oss's harmony markers, and its messages read as they stream
  fields.py      each OpenAI field: implemented, accepted without effect (why), or refused
  openapi.py     the OpenAPI document at /openapi.json
  limits.py      request limits, checked before any work
  guard.py       Host / Origin, API key and JSON body middleware
  transport.py   connection limits and timeouts under uvicorn
  metrics.py     Prometheus metrics, one registry per app
  static/        the chat page served at /

The server depends on the engine through engine/protocol.py's Engine alone, and never
tokenizes for it: prompts, token ids and messages go to the engine as they are.
"""
