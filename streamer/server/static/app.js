// The chat page: one WebSocket session (/v1/chat/ws); the server keeps the conversation.
"use strict";

const $ = (id) => document.getElementById(id);
const messages = $("messages"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop");
let ws = null;
let current = null;      // the assistant message being streamed
let queued = null;       // a message typed while (re)connecting
let apiKey = new URLSearchParams(location.search).get("api_key") || localStorage.getItem("streamer-api-key");

function status(text) { $("status").textContent = text; }

function setStreaming(on) {
  sendBtn.disabled = on;
  stopBtn.disabled = !on;
}

function add(kind, text) {
  const el = document.createElement("div");
  el.className = `msg ${kind}`;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  el.append(body);
  messages.append(el);
  messages.scrollTop = messages.scrollHeight;
  return el;
}

function connect() {
  const url = new URL("/v1/chat/ws", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if (apiKey) url.searchParams.set("api_key", apiKey);
  ws = new WebSocket(url);
  ws.onopen = () => {
    status("connected");
    if (queued) { ws.send(JSON.stringify(queued)); queued = null; }
  };
  ws.onmessage = (ev) => handle(JSON.parse(ev.data));
  ws.onclose = (ev) => {
    ws = null;
    finishTurn("stopped", "connection closed");
    if (ev.code === 1008) {
      const key = prompt("This server needs an API key:");
      if (key) { apiKey = key; localStorage.setItem("streamer-api-key", key); connect(); return; }
    }
    status(`disconnected (${ev.reason || ev.code}); sending starts a new session`);
  };
}

function finishTurn(state, meta) {
  if (current) {
    current.dataset.state = state;
    if (meta) {
      const m = document.createElement("div");
      m.className = "meta";
      m.textContent = meta;
      current.append(m);
    }
  }
  current = null;
  setStreaming(false);
}

function handle(msg) {
  switch (msg.type) {
    case "session":
      $("model").textContent = msg.model;
      status("connected");
      break;
    case "delta":
      if (current) {
        current.querySelector(".body").textContent += msg.text;
        messages.scrollTop = messages.scrollHeight;
      }
      break;
    case "done": {
      const u = msg.usage;
      finishTurn(msg.finish_reason === "abort" ? "stopped" : "done",
        `${u.completion_tokens} tokens · ${u.cached_tokens} of ${u.prompt_tokens} prompt tokens cached · ${msg.finish_reason}`);
      break;
    }
    case "reset":  // the page cleared itself when the button was pressed
      status("new chat");
      break;
    case "error":
      add("error", msg.message);
      finishTurn("error");
      break;
  }
}

function send() {
  const text = input.value.trim();
  if (!text || current) return;
  const payload = { type: "user", content: text };
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  if (maxTokens > 0) payload.max_tokens = maxTokens;
  if (temperature >= 0) payload.temperature = temperature;
  add("user", text);
  current = add("assistant", "");
  current.dataset.state = "streaming";
  input.value = "";
  setStreaming(true);
  if (ws && ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify(payload));
  } else {
    queued = payload;
    if (!ws) { add("note", "new session: the server has forgotten earlier messages"); connect(); }
  }
}

$("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); send(); }
});
stopBtn.addEventListener("click", () => {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "cancel" }));
});
$("new-chat").addEventListener("click", () => {
  finishTurn("stopped");
  messages.replaceChildren();
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "reset" }));
  input.focus();
});

connect();
