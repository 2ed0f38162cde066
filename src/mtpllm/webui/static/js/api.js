// Requests to this server: the API key (when the server asks for one) and server-sent events.

import { getKey, setKey } from "./store.js";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

let askKey = async () => "";  // set by the page: shows the key dialog, resolves to the key or ""

export function onKeyNeeded(fn) {
  askKey = fn;
}

async function errorOf(resp) {
  let msg = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) msg = body.error.message;
  } catch { /* not JSON */ }
  return new ApiError(msg, resp.status);
}

// fetch() with the API key; on 401 asks for a key and tries again (until the user gives up).
export async function request(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const resp = await fetch(path, { ...options, headers });
    if (resp.status !== 401) {
      if (!resp.ok) throw await errorOf(resp);
      return resp;
    }
    const err = await errorOf(resp);
    setKey("");
    const k = await askKey(key ? "That key was not accepted." : "This server needs an API key.");
    if (!k) throw err;
    setKey(k);
  }
}

export async function getJSON(path) {
  return (await request(path)).json();
}

// POST a streaming request; yields each event's parsed JSON object (stops at [DONE]).
// Aborting `signal` closes the connection, which stops the generation on the server.
export async function* streamEvents(path, body, signal) {
  const resp = await request(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const obj = JSON.parse(data);
          if (obj && obj.error) throw new ApiError(obj.error.message || "server error", obj.error.code || 500);
          yield obj;
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
