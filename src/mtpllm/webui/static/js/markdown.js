// Model output as markdown, rendered safely: raw HTML in the text is shown as text, the HTML that
// marked makes is sanitized by DOMPurify, code blocks are highlighted by highlight.js and get a copy
// button, and the characters that came from accepted draft tokens are marked.

import { Marked } from "../vendor/marked/marked.esm.js";
import DOMPurify from "../vendor/dompurify/purify.es.mjs";
import hljs from "../vendor/highlight/core.min.js";
import bash from "../vendor/highlight/languages/bash.min.js";
import c from "../vendor/highlight/languages/c.min.js";
import cpp from "../vendor/highlight/languages/cpp.min.js";
import css from "../vendor/highlight/languages/css.min.js";
import diff from "../vendor/highlight/languages/diff.min.js";
import go from "../vendor/highlight/languages/go.min.js";
import java from "../vendor/highlight/languages/java.min.js";
import javascript from "../vendor/highlight/languages/javascript.min.js";
import json from "../vendor/highlight/languages/json.min.js";
import markdown from "../vendor/highlight/languages/markdown.min.js";
import plaintext from "../vendor/highlight/languages/plaintext.min.js";
import python from "../vendor/highlight/languages/python.min.js";
import rust from "../vendor/highlight/languages/rust.min.js";
import shell from "../vendor/highlight/languages/shell.min.js";
import sql from "../vendor/highlight/languages/sql.min.js";
import typescript from "../vendor/highlight/languages/typescript.min.js";
import xml from "../vendor/highlight/languages/xml.min.js";
import yaml from "../vendor/highlight/languages/yaml.min.js";

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, plaintext, python, rust,
  shell, sql, typescript, xml, yaml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);
hljs.configure({ ignoreUnescapedHTML: true });

export function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[ch]);
}

const md = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    // raw HTML in the model's text (block or inline) is text, never markup
    html(token) {
      return escapeHtml(token.text || token.raw || "");
    },
    // images become links: nothing is loaded from anywhere because a model wrote it
    image(token) {
      return `<a href="${escapeHtml(token.href || "")}">${escapeHtml(token.text || token.href || "image")}</a>`;
    },
  },
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "form", "button", "textarea", "select", "option", "video", "audio", "iframe"],
  FORBID_ATTR: ["style"],
};

export function sanitizeMarkdown(text) {
  return DOMPurify.sanitize(md.parse(text, { async: false }), PURIFY);
}

// Where each character of the rendered text `v` sits in the source, searching from `cursor`: an
// array of source offsets (-1: not found), or null when the text is not there. Markdown syntax
// between text nodes is skipped; inside one node the characters are matched in order, skipping a
// few source characters where markdown dropped them (a backslash escape) and taking any white
// space for any other (a code span's line breaks become spaces).
const SKIP = 8;

function locate(src, v, cursor) {
  const pos = src.indexOf(v, cursor);
  // a short piece found far ahead is more likely a chance match than the right place
  if (pos >= 0 && !(v.length < 4 && pos - cursor > 16)) return Array.from({ length: v.length }, (_, i) => pos + i);
  const lead = v.length - v.trimStart().length;
  let j = src.indexOf(v[lead], cursor);
  if (j < 0 || j - cursor > 64) return null;
  const ws = (ch) => ch === " " || ch === "\n" || ch === "\t" || ch === "\r";
  const out = new Array(v.length).fill(-1);
  for (let i = lead; i < v.length; i++) {
    let k = j;
    while (k < src.length && k - j <= SKIP && !(src[k] === v[i] || (ws(src[k]) && ws(v[i])))) k++;
    if (k >= src.length || k - j > SKIP) break;  // lost: the rest of this node stays plain
    out[i] = k;
    j = k + 1;
  }
  return out;
}

// Wrap the text of `root` (rendered from `src`) in spans that say where each character came from.
// `runs` is [length, draft, length, draft, ...] over `src` (draft: 1 for accepted draft tokens, 0 for
// the target model's). A text node that cannot be found in the source (an entity written out in
// the source) stays plain.
export function markTokens(root, src, runs) {
  if (!runs || !runs.length) return;
  const ends = [];
  const flags = [];
  let acc = 0;
  for (let i = 0; i + 1 < runs.length; i += 2) {
    acc += runs[i];
    ends.push(acc);
    flags.push(runs[i + 1]);
  }
  const kind = (p) => {  // the class of source offset p
    let lo = 0, hi = ends.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (ends[mid] <= p) lo = mid + 1; else hi = mid;
    }
    if (p < 0 || lo >= ends.length) return "tk";
    return flags[lo] ? "tk tk-draft" : "tk tk-target";
  };
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  let cursor = 0;
  for (const node of nodes) {
    const v = node.nodeValue;
    if (!v.trim()) continue;
    const where = locate(src, v, cursor);
    if (!where) continue;
    const frag = document.createDocumentFragment();
    let start = 0;
    let cls = kind(where[0]);
    for (let i = 1; i <= v.length; i++) {
      const c = i < v.length ? kind(where[i]) : null;
      if (c === cls) continue;
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = v.slice(start, i);
      frag.appendChild(span);
      start = i;
      cls = c;
    }
    node.replaceWith(frag);
    cursor = Math.max(cursor, ...where) + 1;
  }
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const ta = document.createElement("textarea");  // plain http on another host: the old way
  ta.value = text;
  ta.setAttribute("readonly", "");
  ta.className = "offscreen";
  document.body.appendChild(ta);
  ta.select();
  document.execCommand("copy");
  ta.remove();
}

function decorateCode(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (!code) continue;
    const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9) || "";
    const wrap = document.createElement("div");
    wrap.className = "codeblock";
    const bar = document.createElement("div");
    bar.className = "codebar";
    const name = document.createElement("span");
    name.textContent = lang || "code";
    const btn = document.createElement("button");
    btn.type = "button";
    btn.className = "copy";
    btn.textContent = "Copy";
    btn.title = "Copy the code";
    btn.addEventListener("click", async () => {
      try {
        await copyText(code.textContent);
        btn.textContent = "Copied";
      } catch {
        btn.textContent = "Copy failed";
      }
      setTimeout(() => { btn.textContent = "Copy"; }, 1500);
    });
    bar.append(name, btn);
    pre.replaceWith(wrap);
    wrap.append(bar, pre);
  }
}

function highlight(root) {
  for (const code of root.querySelectorAll("pre code")) {
    const lang = [...code.classList].find((c) => c.startsWith("language-"))?.slice(9);
    if (lang && !hljs.getLanguage(lang)) {
      code.classList.add("hljs");  // a language we do not ship: plain, same look
      continue;
    }
    hljs.highlightElement(code);
  }
}

// The answer `text` as sanitized markdown into `el` (its old content replaced), with token marks.
export function renderMarkdown(el, text, runs) {
  const tpl = document.createElement("template");
  tpl.innerHTML = sanitizeMarkdown(text);
  const frag = tpl.content;
  highlight(frag);
  markTokens(frag, text, runs);
  decorateCode(frag);
  el.replaceChildren(frag);
}
