#include "server/page.hpp"

namespace strata::server {

// Plain HTML and JavaScript, no external resources. Nothing on the page acts on
// URL parameters: a link can never start a generation or inject a failure. The
// injection buttons appear only when the server runs with --allow-inject (and
// carry the API key typed into the page, when the server has one).
const std::string& page_html() {
  static const std::string page = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>strata</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:70em;color:#222}
textarea{width:100%;height:5em;font:inherit}
pre{background:#f4f4f4;padding:.8em;white-space:pre-wrap;min-height:4em}
table{border-collapse:collapse;margin-top:.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
.down{color:#b00}.up{color:#070}button{margin:0 .15em}#status{color:#555}
</style></head><body>
<h1>strata</h1>
<p>Generation across the cluster's shard nodes. With injections enabled, inject a failure while it runs: the text must not change.</p>
API key <input id="key" type="password" style="width:12em" placeholder="(if the server has one)">
<textarea id="prompt">Once upon a time</textarea><br>
max tokens <input id="max_tokens" type="number" value="64" min="1" style="width:5em">
temperature <input id="temperature" type="number" value="0" min="0" max="2" step="0.1" style="width:4em">
<button id="go" onclick="generate()">Generate</button>
<pre id="out"></pre><div id="status"></div>
<h2>Route <small id="epoch"></small></h2>
<div id="route"></div>
<button id="bump" onclick="inject('epoch')" hidden>bump epoch</button>
<script>
let tokens = 0, injections = false;
function headers() {
  const h = {'Content-Type': 'application/json'}, k = document.getElementById('key').value;
  if (k) h['Authorization'] = 'Bearer ' + k;
  return h;
}
async function inject(kind, node) {
  const r = await fetch('/v1/cluster/inject', {method: 'POST', headers: headers(),
    body: JSON.stringify({kind: kind, node: node === undefined ? undefined : String(node)})});
  const j = await r.json();
  document.getElementById('status').textContent = j.done || (j.error && j.error.message) || '';
}
async function refresh() {
  try {
    const c = await (await fetch('/v1/cluster', {headers: headers()})).json();
    injections = !!c.inject;
    document.getElementById('bump').hidden = !injections;
    document.getElementById('epoch').textContent = 'epoch ' + c.epoch + (c.route_complete ? '' : ' (incomplete)');
    let h = '<table><tr><th>#</th><th>node</th><th>layers</th><th>state</th><th>cache bytes</th><th>sessions</th><th>recoveries</th><th></th></tr>';
    for (const s of c.shards)
      h += '<tr><td>' + s.index + '</td><td>' + s.node + '</td><td>' + s.first + '-' + s.last + '</td><td class="' +
           (s.up ? 'up">up' : 'down">down') + '</td><td>' + s.cache_bytes + '</td><td>' + s.sessions + '</td><td>' +
           s.recoveries + '</td><td>' + (injections ?
           '<button id="kill-' + s.index + '" onclick="inject(\'kill\',' + s.index + ')">kill</button>' +
           '<button onclick="inject(\'freeze\',' + s.index + ')">freeze</button>' +
           '<button onclick="inject(\'evict\',' + s.index + ')">evict</button>' : '') + '</td></tr>';
    document.getElementById('route').innerHTML = h + '</table>';
  } catch (e) { document.getElementById('route').textContent = 'cluster not reachable'; }
}
async function generate() {
  const out = document.getElementById('out'), status = document.getElementById('status');
  out.textContent = ''; tokens = 0; status.textContent = 'generating...';
  document.body.dataset.finish = '';
  const body = {prompt: document.getElementById('prompt').value, stream: true,
                max_tokens: Number(document.getElementById('max_tokens').value),
                temperature: Number(document.getElementById('temperature').value)};
  const r = await fetch('/v1/completions', {method: 'POST', headers: headers(), body: JSON.stringify(body)});
  if (!r.ok) { const j = await r.json(); status.textContent = 'error: ' + j.error.message; document.body.dataset.finish = 'error'; return; }
  const reader = r.body.getReader(), dec = new TextDecoder();
  let buf = '', finish = null;
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
      if (j.error) { status.textContent = 'error: ' + j.error.message; finish = 'error'; continue; }
      const c = j.choices[0];
      if (c.text) { out.textContent += c.text; tokens++; document.body.dataset.tokens = tokens; }
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  status.textContent += ' finished: ' + finish;
  document.body.dataset.finish = finish || 'none';
}
refresh(); setInterval(refresh, 500);
</script></body></html>
)HTML";
  return page;
}

} // namespace strata::server
