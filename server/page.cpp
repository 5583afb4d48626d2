#include "server/page.hpp"

namespace strata::server {

// Plain HTML and JavaScript, no external resources. Nothing on the page acts on
// URL parameters: a link can never start a generation or inject a failure.
// Model text is only ever set with textContent (never parsed as HTML). The
// injection buttons appear only when the server runs with --allow-inject (and
// carry the API key typed into the page, when the server has one).
const std::string& page_html() {
  static const std::string page = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>strata chat</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
*{box-sizing:border-box}body{font-family:system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:.6em 1.2em;background:#223;color:#fff;display:flex;gap:1em;align-items:baseline}
header h1{font-size:1.2em;margin:0}header small{color:#bbc}
main{display:grid;grid-template-columns:minmax(0,3fr) minmax(16em,1.4fr);gap:1em;padding:1em;max-width:90em;margin:auto}
#conversation{background:#fff;border:1px solid #ddd;border-radius:.5em;padding:.8em;min-height:20em;max-height:65vh;overflow-y:auto}
.msg{margin:.4em 0;padding:.5em .8em;border-radius:.6em;white-space:pre-wrap;max-width:92%}
.user{background:#dbe8ff;margin-left:auto}.assistant{background:#eee}.system{background:#fff4d6;font-size:.9em}
.meta{font-size:.75em;color:#777;margin-top:.2em}
#composer{display:flex;gap:.5em;margin-top:.6em}#composer textarea{flex:1;height:4.5em;font:inherit;padding:.4em}
#composer button{min-width:5.5em}aside section{background:#fff;border:1px solid #ddd;border-radius:.5em;padding:.6em .8em;margin-bottom:1em}
aside h2{font-size:1em;margin:.2em 0 .5em}label{display:flex;justify-content:space-between;gap:.5em;margin:.25em 0;font-size:.9em}
label input{width:7em}#system{width:100%;height:4em;font:inherit}
table{border-collapse:collapse;font-size:.85em;width:100%}td,th{border:1px solid #ddd;padding:.2em .4em;text-align:left}
.down{color:#b00}.up{color:#070}#status{color:#555;font-size:.9em;margin-top:.4em;min-height:1.2em}
td button{font-size:.75em;margin:1px;padding:1px 4px}td:last-child{white-space:nowrap}#inject_status{overflow-wrap:anywhere}
@media (max-width:50em){main{grid-template-columns:1fr}}
</style></head><body>
<header><h1>strata</h1><small id="model">connecting...</small></header>
<main>
<div>
  <div id="conversation" aria-live="polite"></div>
  <div id="composer">
    <textarea id="message" placeholder="Write a message (Enter sends, Shift+Enter for a new line)"></textarea>
    <div style="display:flex;flex-direction:column;gap:.3em">
      <button id="send">Send</button><button id="stop" disabled>Stop</button><button id="clear">New chat</button>
    </div>
  </div>
  <div id="status"></div>
</div>
<aside>
  <section><h2>Settings</h2>
    <textarea id="system" placeholder="System prompt (optional)"></textarea>
    <label>max tokens <input id="max_tokens" type="number" value="256" min="1"></label>
    <label>temperature <input id="temperature" type="number" value="0.7" min="0" max="2" step="0.1"></label>
    <label>top_p <input id="top_p" type="number" value="1" min="0.01" max="1" step="0.05"></label>
    <label>top_k <input id="top_k" type="number" value="0" min="0"></label>
    <label>min_p <input id="min_p" type="number" value="0" min="0" max="1" step="0.01"></label>
    <label>presence penalty <input id="presence_penalty" type="number" value="0" min="-2" max="2" step="0.1"></label>
    <label>frequency penalty <input id="frequency_penalty" type="number" value="0" min="-2" max="2" step="0.1"></label>
    <label>seed <input id="seed" type="number" placeholder="random"></label>
    <label>API key <input id="key" type="password" placeholder="if required"></label>
  </section>
  <section><h2>Cluster <small id="epoch"></small></h2>
    <div id="route"></div>
    <button id="bump" hidden>bump epoch</button>
    <div id="inject_status" style="font-size:.85em;color:#555"></div>
  </section>
</aside>
</main>
<script>
'use strict';
const $ = (id) => document.getElementById(id);
let history = [], controller = null, injections = false;
function headers() {
  const h = {'Content-Type': 'application/json'}, k = $('key').value;
  if (k) h['Authorization'] = 'Bearer ' + k;
  return h;
}
function bubble(role, text) {
  const d = document.createElement('div');
  d.className = 'msg ' + role;
  d.textContent = text;
  $('conversation').appendChild(d);
  $('conversation').scrollTop = $('conversation').scrollHeight;
  return d;
}
function setting(id) { const v = $(id).value; return v === '' ? undefined : Number(v); }
async function send() {
  const text = $('message').value;
  if (!text.trim() || controller) return;
  $('message').value = '';
  history.push({role: 'user', content: text});
  bubble('user', text);
  const answer = bubble('assistant', ''), meta = document.createElement('div');
  meta.className = 'meta';
  const messages = ($('system').value.trim() ? [{role: 'system', content: $('system').value}] : []).concat(history);
  const body = {messages, stream: true, stream_options: {include_usage: true}, max_tokens: setting('max_tokens'),
                temperature: setting('temperature'), top_p: setting('top_p'), top_k: setting('top_k'),
                min_p: setting('min_p'), presence_penalty: setting('presence_penalty'),
                frequency_penalty: setting('frequency_penalty'), seed: setting('seed')};
  controller = new AbortController();
  $('send').disabled = true; $('stop').disabled = false;
  $('status').textContent = 'generating...';
  document.body.dataset.finish = ''; document.body.dataset.tokens = '0';
  let finish = null, tokens = 0, text_out = '', usage = null;
  const t0 = performance.now();
  try {
    const r = await fetch('/v1/chat/completions', {method: 'POST', headers: headers(), body: JSON.stringify(body),
                                                   signal: controller.signal});
    if (!r.ok) {
      const j = await r.json();
      throw new Error(j.error ? j.error.message : 'HTTP ' + r.status);
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const ev = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!ev.startsWith('data: ')) continue;
        const data = ev.slice(6);
        if (data === '[DONE]') continue;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        if (j.usage) usage = j.usage;
        const c = j.choices && j.choices[0];
        if (!c) continue;
        const piece = c.delta && c.delta.content;
        if (piece) {
          text_out += piece; answer.textContent = text_out; tokens++;
          document.body.dataset.tokens = String(tokens);
          $('conversation').scrollTop = $('conversation').scrollHeight;
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === 'AbortError') finish = 'stopped';
    else { finish = 'error'; $('status').textContent = 'error: ' + e.message; }
  }
  const secs = (performance.now() - t0) / 1000;
  history.push({role: 'assistant', content: text_out});
  meta.textContent = (finish || 'none') + (usage ? ' \u00b7 ' + usage.completion_tokens + ' tokens' : '') +
                     ' \u00b7 ' + secs.toFixed(1) + ' s';
  answer.appendChild(meta);
  if (finish !== 'error') $('status').textContent = 'finished: ' + finish;
  document.body.dataset.finish = finish || 'none';
  controller = null;
  $('send').disabled = false; $('stop').disabled = true;
}
$('send').onclick = send;
$('stop').onclick = () => { if (controller) controller.abort(); };
$('clear').onclick = () => { if (!controller) { history = []; $('conversation').textContent = ''; $('status').textContent = ''; } };
$('message').addEventListener('keydown', (e) => { if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); send(); } });
async function inject(kind, node) {
  const r = await fetch('/v1/cluster/inject', {method: 'POST', headers: headers(),
    body: JSON.stringify({kind: kind, node: node === undefined ? undefined : String(node)})});
  const j = await r.json();
  $('inject_status').textContent = j.done || (j.error && j.error.message) || '';
}
$('bump').onclick = () => inject('epoch');
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
async function refresh() {
  try {
    const c = await (await fetch('/v1/cluster', {headers: headers()})).json();
    injections = !!c.inject;
    $('bump').hidden = !injections;
    $('epoch').textContent = 'epoch ' + c.epoch + (c.route_complete ? '' : ' (incomplete)');
    const t = document.createElement('table'), h = t.insertRow();
    for (const name of ['#', 'layers', 'state', 'sessions', 'recoveries', '']) { const th = document.createElement('th'); th.textContent = name; h.appendChild(th); }
    for (const s of c.shards) {
      const row = t.insertRow();
      row.title = s.node + ' \u00b7 cache ' + s.cache_bytes + ' bytes';
      cell(row, s.index); cell(row, s.first + '-' + s.last); cell(row, s.up ? 'up' : 'down', s.up ? 'up' : 'down');
      cell(row, s.sessions); cell(row, s.recoveries);
      const td = row.insertCell();
      if (injections)
        for (const kind of ['kill', 'freeze', 'evict']) {
          const b = document.createElement('button');
          b.textContent = kind; b.id = kind + '-' + s.index; b.onclick = () => inject(kind, s.index);
          td.appendChild(b);
        }
    }
    $('route').replaceChildren(t);
  } catch (e) { $('route').textContent = 'cluster not reachable'; }
}
async function model() {
  try {
    const m = await (await fetch('/v1/models', {headers: headers()})).json();
    $('model').textContent = m.data && m.data[0] ? m.data[0].id + ' \u00b7 context ' + m.data[0].context_length : '';
  } catch (e) { $('model').textContent = ''; }
}
model(); refresh(); setInterval(refresh, 1000);
</script></body></html>
)HTML";
  return page;
}

} // namespace strata::server
