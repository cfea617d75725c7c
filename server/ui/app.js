// ember's dashboard: one ES module, no framework. Every request goes to /ui/api/... with the
// session cookie (HttpOnly: this script never sees it); actions also send the session's CSRF
// token in X-Ember-Csrf. Pages poll (every 1.5 s) instead of holding a stream open.

const POLL_MS = 1500;
const SAMPLES = 240; // overview chart: last 6 minutes at POLL_MS
const $ = (sel) => document.querySelector(sel);

// xterm.js's DOM renderer writes its theme and cell sizes into <style> elements it creates;
// the page's CSP admits a style element only with this response's nonce, so they get it.
const STYLE_NONCE = document.querySelector('meta[name="ember-style-nonce"]')?.content || '';
const createElement = Document.prototype.createElement;
Document.prototype.createElement = function (tag, opts) {
  const el = createElement.call(this, tag, opts);
  if (STYLE_NONCE && String(tag).toLowerCase() === 'style') el.nonce = STYLE_NONCE;
  return el;
};

let csrf = null;
let timer = null;
let leave = null; // what the current view does when the page moves on (closes its terminal)
const samples = []; // {t, running, paused, mem, creates, cpm, lat, lat_sum, lat_n}
window.emberSamples = samples; // the UI test reads the overview's samples

// ----- helpers -----

/** An element: h('td', {class: 'x'}, 'text', child...). Text is never parsed as HTML. */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function svg(tag, attrs = {}) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

/** A /ui/api request; JSON both ways. Non-GET requests carry the CSRF token. */
async function api(path, { method = 'GET', body } = {}) {
  const headers = {};
  if (method !== 'GET') {
    headers['x-ember-csrf'] = csrf || '';
    headers['content-type'] = 'application/json';
  }
  const resp = await fetch(path, {
    method, headers, credentials: 'same-origin',
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (resp.status === 401) {
    showSignin();
    throw new ApiError(401, 'signed out');
  }
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) {
    const msg = data && data.error ? data.error.message : `HTTP ${resp.status}`;
    throw new ApiError(resp.status, msg);
  }
  return data;
}

function flash(msg) {
  const f = $('#flash');
  f.textContent = msg || '';
  f.hidden = !msg;
}

function badge(state) { return h('span', { class: `badge ${state}` }, state); }
function when(t) { return t ? t.replace('T', ' ').replace(/\.\d+Z$|Z$/, '') : ''; }
function mib(n) { return n >= 1024 ? `${(n / 1024).toFixed(1)} GiB` : `${n} MiB`; }
function stop() { if (timer) clearTimeout(timer); timer = null; }

/** Runs `f` now and every POLL_MS while the view it was started for is shown. */
function poll(f) {
  stop();
  const route = location.hash;
  const tick = async () => {
    try { await f(); } catch (e) { if (e.status !== 401) flash(e.message); }
    if (location.hash === route && csrf) timer = setTimeout(tick, POLL_MS);
  };
  tick();
}

// ----- sign-in -----

function showSignin() {
  stop();
  csrf = null;
  $('#nav').hidden = true;
  $('#view').replaceChildren();
  $('#signin').hidden = false;
  $('#signin-error').hidden = !new URLSearchParams(location.search).has('signin');
  $('#token').focus();
}

async function start() {
  $('#signout').addEventListener('click', async () => {
    try { await api('/ui/logout', { method: 'POST' }); } catch { /* signed out anyway */ }
    history.replaceState(null, '', '/ui/');
    showSignin();
  });
  window.addEventListener('hashchange', route);
  try {
    csrf = (await api('/ui/api/session')).csrf;
  } catch (e) {
    return; // the sign-in form is shown
  }
  if (location.search) history.replaceState(null, '', `/ui/${location.hash}`);
  $('#signin').hidden = true;
  $('#nav').hidden = false;
  route();
}

// ----- views -----

function route() {
  if (!csrf) return;
  stop();
  if (leave) leave();
  leave = null;
  flash('');
  const parts = (location.hash || '#/overview').slice(2).split('/');
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('active', a.dataset.view === parts[0]);
  }
  const view = $('#view');
  view.replaceChildren();
  if (parts[0] === 'sandboxes' && parts[1]) sandboxView(view, decodeURIComponent(parts[1]));
  else if (parts[0] === 'sandboxes') listView(view);
  else if (parts[0] === 'templates') templatesView(view);
  else overviewView(view);
}

// Overview: counts, capacity, and two charts of the samples taken while the page is open.
function overviewView(view) {
  const cards = h('div', { class: 'cards', id: 'cards' });
  const charts = h('div', { class: 'charts' });
  view.append(h('h1', {}, 'Overview'), cards, charts);
  poll(async () => {
    const o = await api('/ui/api/overview');
    const n = (s) => o.by_state[s] || 0;
    // Creates per minute and their mean latency, from the counters' change since the last
    // sample (the latency is held while there are no creates).
    const now = Date.now();
    const prev = samples[samples.length - 1];
    let cpm = 0;
    let lat = prev ? prev.lat : 0;
    if (prev && now > prev.t) {
      cpm = Math.max(0, ((o.creates - prev.creates) * 60000) / (now - prev.t));
      const dn = o.create_ms_count - prev.lat_n;
      if (dn > 0) lat = (o.create_ms_sum - prev.lat_sum) / dn;
    }
    samples.push({ t: now, running: n('running'), paused: n('paused'), mem: o.committed_memory_mib,
      creates: o.creates, cpm, lat, lat_sum: o.create_ms_sum, lat_n: o.create_ms_count });
    if (samples.length > SAMPLES) samples.shift();
    const card = (id, value, label) => h('div', { class: 'card', id }, h('div', { class: 'n' }, value), h('div', { class: 'l' }, label));
    cards.replaceChildren(
      card('c-running', n('running'), 'running'),
      card('c-paused', n('paused'), 'paused'),
      card('c-failed', n('failed'), 'failed'),
      card('c-vms', o.max_running ? `${o.with_vmm} / ${o.max_running}` : o.with_vmm, 'sandboxes with a VM (cap)'),
      card('c-mem', o.max_memory_mib ? `${mib(o.committed_memory_mib)} / ${mib(o.max_memory_mib)}` : mib(o.committed_memory_mib), 'guest memory committed (cap)'),
      card('c-creates', o.creates, `creates (${o.create_failures} failed)`),
    );
    charts.replaceChildren(
      chart('Sandboxes: running (green), paused (blue)', [['running', 's-running'], ['paused', 's-paused']]),
      chart('Guest memory committed, MiB', [['mem', 's-mem']]),
      chart('Creates per minute', [['cpm', 's-running']], samples, SAMPLES, null, 'chart-cpm'),
      chart('Create latency, ms (mean of each sample\'s creates)', [['lat', 's-mem']], samples, SAMPLES, null, 'chart-lat'),
    );
  });
}

/** An SVG line chart of the keys `series` names in `pts` (room for `cap` points). */
function chart(title, series, pts = samples, cap = SAMPLES, noteText = null, id = null) {
  const W = 400, H = 150, L = 36, B = 16;
  const s = svg('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': title });
  // A multiple of 4 (at least 4), so the four grid lines fall on whole numbers.
  const max = 4 * Math.max(1, Math.ceil(Math.max(0, ...pts.flatMap((p) => series.map(([k]) => p[k]))) / 4));
  for (let i = 0; i <= 4; i++) {
    const y = 6 + ((H - B - 6) * i) / 4;
    s.append(svg('line', { class: 'grid', x1: L, x2: W, y1: y, y2: y }));
    const label = svg('text', { x: 2, y: y + 3 });
    label.textContent = String(Math.round((max * (4 - i)) / 4));
    s.append(label);
  }
  const x = (i) => L + ((W - L) * i) / Math.max(1, cap - 1);
  const y = (v) => 6 + (H - B - 6) * (1 - v / max);
  const off = cap - pts.length;
  for (const [k, cls] of series) {
    const line = pts.map((p, i) => `${x(off + i).toFixed(1)},${y(p[k]).toFixed(1)}`).join(' ');
    s.append(svg('polyline', { class: cls, points: line, 'data-points': pts.length }));
  }
  const note = svg('text', { x: L, y: H - 3 });
  note.textContent = noteText || `last ${Math.round((cap * POLL_MS) / 60000)} min, sampled every ${POLL_MS / 1000} s`;
  s.append(note);
  return h('div', { class: 'card', id }, h('div', { class: 'l' }, title), s);
}

const STATES = ['live', 'all', 'creating', 'running', 'pausing', 'paused', 'resuming', 'stopped', 'failed'];

// Sandboxes: one page (at most 50 rows) of the filtered list, refreshed in place.
function listView(view) {
  const q = { state: 'live', template: '', metadata: '', page: 0 };
  const state = h('select', { id: 'f-state', onchange: () => { q.state = state.value; q.page = 0; load(); } },
    STATES.map((s) => h('option', { value: s }, s)));
  const template = h('select', { id: 'f-template', onchange: () => { q.template = template.value; q.page = 0; load(); } },
    h('option', { value: '' }, 'any template'));
  const metadata = h('input', { id: 'f-metadata', class: 'mono', size: 24, placeholder: 'key=value,key2=value2',
    onchange: () => { q.metadata = metadata.value; q.page = 0; load(); } });
  const body = h('tbody', { id: 'sandbox-rows' });
  const info = h('span', { id: 'page-info' });
  const prev = h('button', { id: 'prev', onclick: () => { q.page--; load(); } }, '‹ newer');
  const next = h('button', { id: 'next', onclick: () => { q.page++; load(); } }, 'older ›');
  view.append(
    h('h1', {}, 'Sandboxes'),
    h('div', { class: 'filters' }, h('label', {}, 'State ', state), h('label', {}, 'Template ', template), h('label', {}, 'Metadata ', metadata)),
    h('table', {}, h('thead', {}, h('tr', {}, ['id', 'state', 'template', 'created', 'memory', 'ends'].map((c) => h('th', {}, c)))), body),
    h('div', { class: 'pager' }, prev, info, next),
  );
  let seq = 0;
  const load = async () => {
    const mine = ++seq;
    const p = new URLSearchParams({ state: q.state, template: q.template, metadata: q.metadata, page: q.page });
    const page = await api(`/ui/api/sandboxes?${p}`);
    if (mine !== seq) return; // a newer request is on its way
    q.page = page.page;
    const known = new Set([...template.options].map((o) => o.value));
    for (const t of page.templates) if (!known.has(t)) template.append(h('option', { value: t }, t));
    body.replaceChildren(...page.items.map((s) => h('tr', { 'data-id': s.id },
      h('td', { class: 'mono' }, h('a', { href: `#/sandboxes/${s.id}` }, s.id)),
      h('td', {}, badge(s.state)),
      h('td', {}, s.template || s.snapshot || ''),
      h('td', {}, when(s.created_at)),
      h('td', {}, mib(s.resources.memory_mib)),
      h('td', {}, when(s.ends_at)),
    )));
    if (!page.items.length) body.append(h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'No sandboxes.')));
    const pages = Math.max(1, Math.ceil(page.total / page.per_page));
    info.textContent = `page ${page.page + 1} of ${pages} · ${page.total} sandboxes`;
    prev.disabled = page.page === 0;
    next.disabled = page.page + 1 >= pages;
  };
  poll(load);
}

function templatesView(view) {
  const body = h('tbody', { id: 'template-rows' });
  const name = h('input', { id: 'build-name', class: 'mono', size: 24, value: 'default', list: 'recipes', spellcheck: 'false' });
  const recipes = h('datalist', { id: 'recipes' });
  const rebuild = h('input', { id: 'build-rebuild', type: 'checkbox' });
  const buildLog = h('pre', { id: 'build-log', class: 'log', hidden: true });
  const buildState = h('span', { id: 'build-state', class: 'muted' });
  const build = h('button', { id: 'build', class: 'primary', onclick: () => startBuild() }, 'Build');
  view.append(h('h1', {}, 'Templates'),
    h('table', {}, h('thead', {}, h('tr', {}, ['name', 'key', 'built', 'vCPUs', 'memory', 'disk', 'snapshot'].map((c) => h('th', {}, c)))), body),
    h('div', { class: 'box' }, h('h2', {}, 'Build a template'),
      h('p', { class: 'muted' }, 'Builds the recipe (or finds it built: nothing is rebuilt unless asked). Its log streams below; a build goes on to its end even if you leave the page.'),
      h('div', { class: 'actions' }, h('label', {}, 'Recipe ', name), recipes, h('label', {}, rebuild, ' rebuild'), build, buildState),
      buildLog));
  const load = () => api('/ui/api/templates').then((list) => {
    body.replaceChildren(...list.map((t) => h('tr', {},
      h('td', {}, t.name || ''), h('td', { class: 'mono' }, (t.key || '').slice(0, 16)), h('td', {}, when(t.built_at)),
      h('td', {}, t.vm.vcpus), h('td', {}, mib(t.vm.memory_mib)), h('td', {}, mib(t.vm.disk_mib)),
      h('td', {}, `${Math.round(t.snapshot_bytes / 1048576)} MiB`))));
    if (!list.length) body.append(h('tr', {}, h('td', { colspan: 7, class: 'muted' }, 'No templates built.')));
    recipes.replaceChildren(...list.map((t) => h('option', { value: t.name || '' })));
  }).catch((e) => flash(e.message));
  load();

  // The build's NDJSON lines, shown as they arrive (fetch's body stream, read line by line).
  async function startBuild() {
    const recipe = name.value.trim();
    if (!recipe) return;
    if (rebuild.checked && !confirm(`Rebuild template ${recipe} from scratch? This can take many minutes.`)) return;
    build.disabled = true;
    buildLog.hidden = false;
    buildLog.replaceChildren();
    buildState.textContent = 'building…';
    buildState.dataset.state = 'running';
    const add = (text, cls) => { buildLog.append(h('span', { class: cls }, `${text}\n`)); buildLog.scrollTop = buildLog.scrollHeight; };
    let end = 'failed';
    try {
      const resp = await fetch(`/ui/api/templates/${encodeURIComponent(recipe)}/build`, {
        method: 'POST', credentials: 'same-origin',
        headers: { 'x-ember-csrf': csrf || '', 'content-type': 'application/json' },
        body: JSON.stringify({ rebuild: rebuild.checked }),
      });
      if (resp.status === 401) { showSignin(); return; }
      if (!resp.ok) {
        const t = await resp.text();
        let msg = `HTTP ${resp.status}`;
        try { msg = JSON.parse(t).error.message; } catch { /* not JSON */ }
        add(`error: ${msg}`, 'stderr');
      } else {
        const reader = resp.body.getReader();
        const dec = new TextDecoder();
        let buf = '';
        const take = (l) => {
          if (!l.trim()) return;
          let m;
          try { m = JSON.parse(l); } catch { add(l, ''); return; }
          if (m.type === 'step') add(`== ${m.message}`, 'step');
          else if (m.type === 'output') add(m.text, '');
          else if (m.type === 'up_to_date') add('(up to date: already built)', 'step');
          else if (m.type === 'done') { end = 'done'; add(`done: ${m.template && m.template.name ? m.template.name : recipe}`, 'step'); }
          else if (m.type === 'error') add(`error: ${m.error ? m.error.message : JSON.stringify(m)}`, 'stderr');
          else add(l, '');
        };
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          const lines = buf.split('\n');
          buf = lines.pop();
          lines.forEach(take);
        }
        take(buf);
      }
    } catch (e) {
      add(`error: ${e.message}`, 'stderr');
    }
    buildState.textContent = end;
    buildState.dataset.state = end;
    build.disabled = false;
    load();
  }
}

// ----- one sandbox -----

const HTML_TAGS = new Set(['TABLE', 'THEAD', 'TBODY', 'TFOOT', 'TR', 'TH', 'TD', 'CAPTION', 'COLGROUP', 'COL',
  'DIV', 'SPAN', 'P', 'BR', 'HR', 'B', 'I', 'U', 'EM', 'STRONG', 'CODE', 'PRE', 'SMALL', 'SUB', 'SUP',
  'UL', 'OL', 'LI', 'DL', 'DT', 'DD', 'H1', 'H2', 'H3', 'H4', 'H5', 'H6', 'BLOCKQUOTE']);
const HTML_DROP = new Set(['SCRIPT', 'STYLE', 'IFRAME', 'FRAME', 'OBJECT', 'EMBED', 'TEMPLATE', 'SVG', 'MATH',
  'LINK', 'META', 'BASE', 'FORM', 'INPUT', 'BUTTON', 'TEXTAREA', 'SELECT', 'NOSCRIPT', 'IMG', 'VIDEO', 'AUDIO']);
const HTML_ATTRS = new Set(['colspan', 'rowspan', 'align']);

/** Guest HTML → new, inert nodes: known tags and a few attributes are copied; scripts,
 *  styles, frames, forms, media and every other attribute (handlers, URLs) are dropped.
 *  DOMParser's document runs nothing; only the copies enter the page. */
function sanitize(html) {
  const doc = new DOMParser().parseFromString(html, 'text/html');
  const out = document.createDocumentFragment();
  const copy = (from, to) => {
    for (const n of from.childNodes) {
      if (n.nodeType === Node.TEXT_NODE) to.append(n.data);
      else if (n.nodeType !== Node.ELEMENT_NODE || HTML_DROP.has(n.tagName)) continue;
      else if (HTML_TAGS.has(n.tagName)) {
        const el = document.createElement(n.tagName.toLowerCase());
        for (const a of n.attributes) if (HTML_ATTRS.has(a.name) && /^[\w .-]*$/.test(a.value)) el.setAttribute(a.name, a.value);
        copy(n, el);
        to.append(el);
      } else copy(n, to); // unknown tag: its text only
    }
  };
  copy(doc.body, out);
  return out;
}

/** One output of a cell or command. */
function output(o) {
  if (o.type === 'stdout' || o.type === 'stderr') return h('pre', { class: o.type }, o.text);
  if (o.type === 'exception') return h('pre', { class: 'exception' }, `${o.name}: ${o.value}\n${(o.traceback || []).join('\n')}`);
  if (o.type === 'truncated') return h('p', { class: 'muted' }, `(output over ${o.limit} bytes dropped)`);
  const d = o.data || {};
  if (typeof d['image/png'] === 'string') return h('img', { src: `data:image/png;base64,${d['image/png'].replace(/\s/g, '')}`, alt: 'image/png result' });
  if (typeof d['image/jpeg'] === 'string') return h('img', { src: `data:image/jpeg;base64,${d['image/jpeg'].replace(/\s/g, '')}`, alt: 'image/jpeg result' });
  if (typeof d['text/html'] === 'string') return h('div', { class: 'rich-html' }, sanitize(d['text/html']));
  if (typeof d['text/plain'] === 'string') return h('pre', { class: 'result' }, d['text/plain']);
  return h('pre', { class: 'result' }, JSON.stringify(d, null, 2));
}

function sandboxView(view, id) {
  const base = `/ui/api/sandboxes/${encodeURIComponent(id)}`;
  const state = h('span', { id: 'sb-state' });
  const meta = h('p', { class: 'muted', id: 'sb-meta' });
  const act = (name, label, cls, question) => h('button', {
    id: name, class: cls, onclick: async (ev) => {
      if (!confirm(question)) return;
      ev.target.disabled = true;
      try { await api(`${base}/${name}`, { method: 'POST' }); await refresh(); } catch (e) { flash(e.message); }
      ev.target.disabled = false;
    },
  }, label);
  const pause = act('pause', 'Pause', '', `Pause sandbox ${id}? Its memory is written to disk and its VM stops.`);
  const resume = act('resume', 'Resume', '', `Resume sandbox ${id}?`);
  const kill = act('kill', 'Kill', 'danger', `Kill sandbox ${id}? This cannot be undone.`);
  const forked = h('span', { id: 'fork-result' });
  const fork = h('button', { id: 'fork', onclick: async () => {
    if (!confirm(`Fork sandbox ${id}? A new sandbox starts from its current state (the parent keeps running).`)) return;
    fork.disabled = true;
    try {
      const kids = await api(`${base}/fork`, { method: 'POST' });
      forked.replaceChildren('forked: ', ...kids.map((k) => h('a', { href: `#/sandboxes/${k.id}`, class: 'mono' }, k.id)));
    } catch (e) { flash(e.message); }
    fork.disabled = false;
  } }, 'Fork');
  const snap = h('button', { id: 'snapshot', onclick: async () => {
    const name = prompt(`Snapshot sandbox ${id} under a name (letters, digits, - _ .; empty: a generated one)`, '');
    if (name === null) return;
    snap.disabled = true;
    try {
      const sn = await api(`${base}/snapshot`, { method: 'POST', body: name.trim() ? { name: name.trim() } : {} });
      forked.replaceChildren(`snapshot ${sn.name} taken`);
      forked.dataset.snapshot = sn.name;
    } catch (e) { flash(e.message); }
    snap.disabled = false;
  } }, 'Snapshot');

  const cell = h('textarea', { id: 'cell', spellcheck: 'false', placeholder: 'Python code, e.g. import pandas as pd; pd.DataFrame({"a": [1, 2]})' });
  const cellOut = h('div', { class: 'out', id: 'cell-out' });
  const runCell = h('button', { id: 'run-cell', class: 'primary', onclick: () => run(runCell, cellOut, 'code', { code: cell.value }) }, 'Run cell');
  const cmd = h('input', { id: 'cmd', class: 'mono', size: 60, placeholder: 'shell command, e.g. ls -l /workspace' });
  const cmdOut = h('div', { class: 'out', id: 'cmd-out' });
  const runCmd = h('button', { id: 'run-cmd', class: 'primary', onclick: () => run(runCmd, cmdOut, 'exec', { command: cmd.value }) }, 'Run');
  cmd.addEventListener('keydown', (e) => { if (e.key === 'Enter') runCmd.click(); });
  cell.addEventListener('keydown', (e) => { if (e.key === 'Enter' && (e.ctrlKey || e.shiftKey)) { e.preventDefault(); runCell.click(); } });

  const termBox = h('div', { id: 'term', class: 'term', hidden: true });
  const termState = h('span', { id: 'term-state', class: 'muted' }, '');
  const openTerm = h('button', { id: 'open-term', class: 'primary', onclick: () => (termWs ? closeTerminal() : openTerminal()) }, 'Open terminal');
  let termWs = null;
  let term = null;
  leave = () => closeTerminal();

  const artifacts = h('ul', { id: 'artifacts' });
  const collect = h('button', { id: 'collect', onclick: async () => {
    try { await api(`${base}/artifacts/collect`, { method: 'POST' }); await refresh(); } catch (e) { flash(e.message); }
  } }, 'Collect /workspace/outputs now');
  const hist = h('tbody', { id: 'history' });
  const audit = h('tbody', { id: 'audit' });

  // Resources over time: host-side samples the server keeps while this page polls.
  const resCharts = h('div', { class: 'charts', id: 'res-charts' });
  const resNote = h('p', { class: 'muted', id: 'res-note' });
  // The serial console's (or the VMM log's) tail: the guest's bytes, shown as text only.
  const logKind = h('select', { id: 'log-kind', onchange: () => { logTail.textContent = ''; refreshLog(); } },
    h('option', { value: 'serial' }, 'serial console'), h('option', { value: 'vmm' }, 'VMM log'));
  const logTail = h('pre', { id: 'log-tail', class: 'log' });
  const logNote = h('span', { id: 'log-note', class: 'muted' });
  const liveView = h('div', { class: 'box', id: 'live-view-box', hidden: true }, h('h2', {}, 'Browser live view'),
    h('p', { class: 'muted' }, 'The sandbox\'s browser, live (screencast, clicks and keys), in a new tab.'),
    h('a', { id: 'live-view', target: '_blank', rel: 'noopener noreferrer' }, 'Open the live view'));

  view.append(
    h('h1', {}, 'Sandbox ', h('span', { class: 'mono' }, id), ' ', state), meta,
    h('div', { class: 'actions' }, pause, resume, fork, snap, kill, forked),
    h('div', { class: 'box' }, h('h2', {}, 'Python cell'), cell, h('div', { class: 'actions' }, runCell, h('span', { class: 'muted' }, 'Ctrl+Enter runs')), cellOut),
    h('div', { class: 'box' }, h('h2', {}, 'Command'),
      h('p', { class: 'muted' }, 'Runs with /bin/sh -c; output is shown when it ends (not a terminal: no input, no TTY).'),
      h('div', { class: 'actions' }, cmd, runCmd), cmdOut),
    h('div', { class: 'box' }, h('h2', {}, 'Terminal'),
      h('p', { class: 'muted' }, 'An interactive shell on a terminal in the sandbox; closing it (or leaving the page) ends the shell.'),
      h('div', { class: 'actions' }, openTerm, termState), termBox),
    h('div', { class: 'box' }, h('h2', {}, 'Artifacts'), collect, artifacts),
    liveView,
    h('div', { class: 'box' }, h('h2', {}, 'Resources over time'), resNote, resCharts),
    h('div', { class: 'box' }, h('h2', {}, 'Log tail'), h('div', { class: 'actions' }, logKind, logNote), logTail),
    h('div', { class: 'cols' },
      h('div', {}, h('h2', {}, 'State history'), h('table', {}, h('thead', {}, h('tr', {}, ['at', 'from', 'to', 'reason'].map((c) => h('th', {}, c)))), hist)),
      h('div', {}, h('h2', {}, 'Audit trail (newest first)'), h('table', {}, h('thead', {}, h('tr', {}, ['at', 'call', 'outcome', 'ms'].map((c) => h('th', {}, c)))), audit))),
  );

  // The terminal: xterm.js over a WebSocket. Binary frames are the terminal's bytes both
  // ways; text frames are control messages (resize from here, exit/error from the server).
  // The CSRF token travels as a subprotocol (a browser cannot set headers on a WebSocket).
  function openTerminal() {
    termBox.hidden = false;
    term = new window.Terminal({ fontSize: 13, scrollback: 2000, fontFamily: 'ui-monospace, "DejaVu Sans Mono", monospace' });
    const fit = new window.FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(termBox);
    fit.fit();
    window.emberTerm = term; // the UI test reads its buffer
    const url = `${location.protocol === 'https:' ? 'wss:' : 'ws:'}//${location.host}${base}/terminal?cols=${term.cols}&rows=${term.rows}`;
    const ws = new WebSocket(url, ['ember-terminal', `csrf.${csrf}`]);
    termWs = ws;
    ws.binaryType = 'arraybuffer';
    const enc = new TextEncoder();
    termState.textContent = 'connecting…';
    openTerm.textContent = 'Close terminal';
    ws.onopen = () => { termState.textContent = 'connected'; term.focus(); };
    ws.onmessage = (ev) => {
      if (typeof ev.data !== 'string') { term.write(new Uint8Array(ev.data)); return; }
      let m = {};
      try { m = JSON.parse(ev.data); } catch (e) { return; }
      term.write(m.type === 'exit' ? '\r\n[the shell ended]\r\n' : `\r\n[${m.message || m.type}]\r\n`);
    };
    ws.onclose = () => { if (termWs === ws) { termWs = null; termState.textContent = 'closed'; openTerm.textContent = 'Open terminal'; } };
    term.onData((d) => {
      const bytes = enc.encode(d);
      for (let i = 0; i < bytes.length && ws.readyState === WebSocket.OPEN; i += 16384) ws.send(bytes.subarray(i, i + 16384));
    });
    term.onResize(({ cols, rows }) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'resize', cols, rows })); });
    const onWindow = () => { if (term) fit.fit(); };
    window.addEventListener('resize', onWindow);
    term._emberOff = () => window.removeEventListener('resize', onWindow);
  }

  function closeTerminal() {
    if (termWs) { const ws = termWs; termWs = null; ws.close(); }
    if (term) { term._emberOff(); term.dispose(); term = null; window.emberTerm = null; }
    termBox.hidden = true;
    termState.textContent = '';
    openTerm.textContent = 'Open terminal';
  }

  async function run(button, out, what, body) {
    button.disabled = true;
    out.replaceChildren(h('p', { class: 'muted' }, 'running…'));
    try {
      const r = await api(`${base}/${what}`, { method: 'POST', body });
      const tail = what === 'exec'
        ? h('p', { class: 'muted status' }, r.exit ? `exit ${JSON.stringify(r.exit)}` : `status ${r.status}`)
        : h('p', { class: 'muted status' }, `${r.end.status}${r.end.duration_ms !== null ? ` in ${r.end.duration_ms} ms` : ''}`);
      out.replaceChildren(...r.outputs.map(output), tail);
    } catch (e) {
      out.replaceChildren(h('pre', { class: 'exception' }, e.message));
    }
    button.disabled = false;
    refresh().catch(() => {});
  }

  async function refreshUsage() {
    const u = await api(`${base}/usage`);
    const pts = u.samples.map((x) => ({ cpu: x.cpu_used_pct, mem: Math.round(x.mem_used_bytes / 1048576), disk: Math.round(x.disk_used_bytes / 1048576) }));
    const every = `last ${pts.length} samples (one per ${POLL_MS / 1000} s while this page is open)`;
    resCharts.replaceChildren(
      chart('VMM CPU, % of its vCPUs', [['cpu', 's-running']], pts, u.max_samples, every, 'res-cpu'),
      chart('Host memory of the VMM, MiB (orange); its disk layer, MiB (blue)', [['mem', 's-mem'], ['disk', 's-paused']], pts, u.max_samples, every, 'res-mem'),
    );
    resNote.textContent = u.idle ? `Not sampled now: ${u.idle}` : '';
  }

  async function refreshLog() {
    const kind = logKind.value;
    try {
      const t = await api(`${base}/log?kind=${kind}`);
      if (kind !== logKind.value) return;
      const atEnd = logTail.scrollTop + logTail.clientHeight >= logTail.scrollHeight - 4;
      // Line ends as the serial port sends them (\r\n) kept as lines; other control
      // characters (escape sequences of the guest's terminal output) shown as '·'.
      logTail.textContent = t.text.replace(/\r+\n/g, '\n').replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g, '·');
      logNote.textContent = t.size ? `${t.cut ? 'the last' : 'all'} ${t.text.length} of ${t.size} bytes` : 'empty so far (0 bytes)';
      if (atEnd) logTail.scrollTop = logTail.scrollHeight;
    } catch (e) {
      if (e.status === 401) throw e;
      logNote.textContent = e.message;
    }
  }

  async function refresh() {
    const d = await api(base);
    const live = ['creating', 'running', 'pausing', 'resuming'].includes(d.sandbox.state);
    await Promise.all([
      refreshUsage().catch((e) => { resNote.textContent = e.message; }),
      live ? refreshLog() : Promise.resolve(logNote.textContent = 'no VMM now (paused or ended): no log'),
    ]);
    liveView.hidden = !d.view_url;
    if (d.view_url) $('#live-view').setAttribute('href', d.view_url);
    const s = d.sandbox;
    state.replaceChildren(badge(s.state));
    state.dataset.state = s.state;
    meta.textContent = `template ${s.template || s.snapshot || '?'} · ${s.resources.vcpus} vCPU · ${mib(s.resources.memory_mib)} · created ${when(s.created_at)}${s.ends_at ? ` · ends ${when(s.ends_at)}` : ''}${s.reason ? ` · ${s.reason}` : ''}`;
    const final = s.state === 'stopped' || s.state === 'failed';
    pause.disabled = s.state !== 'running';
    resume.disabled = s.state !== 'paused';
    kill.disabled = final;
    fork.disabled = s.state !== 'running';
    snap.disabled = s.state !== 'running';
    runCell.disabled = runCell.disabled || final;
    runCmd.disabled = runCmd.disabled || final;
    openTerm.disabled = !termWs && s.state !== 'running';
    collect.disabled = s.state !== 'running';
    artifacts.replaceChildren(...d.artifacts.map((a) => h('li', {},
      h('a', { href: `${base}/artifact?${new URLSearchParams({ path: a.path })}`, download: a.path.split('/').pop() }, a.path),
      ` (${a.size} bytes, ${when(a.collected_at)})`)));
    if (!d.artifacts.length) artifacts.append(h('li', { class: 'muted' }, 'none collected'));
    hist.replaceChildren(...d.history.map((t) => h('tr', {}, h('td', {}, when(t.at)), h('td', {}, t.from || ''), h('td', {}, t.to), h('td', {}, t.reason || ''))));
    audit.replaceChildren(...d.audit.slice().reverse().map((r) => h('tr', {},
      h('td', {}, when(r.at)), h('td', {}, r.call), h('td', {}, r.outcome), h('td', {}, r.duration_ms !== undefined && r.duration_ms !== null ? Math.round(r.duration_ms) : ''))));
  }
  poll(refresh);
}

start();
