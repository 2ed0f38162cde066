// Conversations and settings in the browser's localStorage; the API key in sessionStorage only.

const CONV_KEY = "mtpllm.conversations";
const SETTINGS_KEY = "mtpllm.settings";
const KEY_KEY = "mtpllm.apiKey";

export const DEFAULT_SETTINGS = {
  system: "",
  temperature: 0.7,
  top_p: 0.95,
  max_tokens: 1024,
  k: null,            // draft length; null: the server's
  marks: true,        // colour accepted draft tokens
};

function readJSON(storage, key, fallback) {
  try {
    const v = JSON.parse(storage.getItem(key));
    return v ?? fallback;
  } catch {
    return fallback;
  }
}

export function loadSettings() {
  const s = readJSON(localStorage, SETTINGS_KEY, {});
  return { ...DEFAULT_SETTINGS, ...(typeof s === "object" && !Array.isArray(s) ? s : {}) };
}

export function saveSettings(s) {
  try { localStorage.setItem(SETTINGS_KEY, JSON.stringify(s)); } catch { /* full: settings stay for this tab */ }
}

function validConversation(c) {
  return c && typeof c === "object" && typeof c.id === "string" && Array.isArray(c.messages)
    && c.messages.every((m) => m && typeof m.role === "string" && typeof m.content === "string");
}

// Conversations, most recently updated first.
export function loadConversations() {
  const all = readJSON(localStorage, CONV_KEY, []);
  return (Array.isArray(all) ? all.filter(validConversation) : [])
    .sort((a, b) => (b.updated || 0) - (a.updated || 0));
}

// Save all conversations; when the browser's quota is full, drop the oldest ones until it fits.
// Returns how many were dropped.
export function saveConversations(list) {
  const keep = [...list].sort((a, b) => (b.updated || 0) - (a.updated || 0));
  for (let dropped = 0; ; dropped++) {
    try {
      localStorage.setItem(CONV_KEY, JSON.stringify(keep));
      return dropped;
    } catch (e) {
      if (keep.length <= 1) return dropped;  // cannot even keep one: leave the stored copy as it was
      keep.pop();
    }
  }
}

export function newConversation() {
  const id = (crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random().toString(16).slice(2));
  const now = Date.now();
  return { id, title: "", created: now, updated: now, messages: [] };
}

export function getKey() {
  try { return sessionStorage.getItem(KEY_KEY) || ""; } catch { return ""; }
}

export function setKey(k) {
  try {
    if (k) sessionStorage.setItem(KEY_KEY, k); else sessionStorage.removeItem(KEY_KEY);
  } catch { /* storage off: the key is asked again */ }
}
