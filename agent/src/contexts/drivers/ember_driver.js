// ember's JavaScript and TypeScript context driver (Node.js). Embedded in ember-agent and
// written to /run/ember/drivers when a context of either language first starts; run as
// `node --expose-internals ember_driver.js [--ts]`.
//
// Descriptors (see "Code contexts" in agent/PROTOCOL.md): fd 0 is the agent's socket, on which
// requests arrive; fd 3 a pipe on which events go back, in the agent's framing (u32 LE length +
// JSON), the same events as the Python driver's (ready, result, display, exception, end, error);
// fd 1/2 are pipes the agent reads. A request is one frame whose body is a list of fields, each
// `NAME LEN\n` + LEN bytes + `\n` (op = run | setup | ack; code; cwd; reseed; env.KEY).
//
// Cells run as scripts in the one global context (vm.Script.runInThisContext), so top-level
// const/let/class/function declarations stay visible to later cells; a cell with a top-level
// `await` is rewritten by Node's own REPL transform (internal/repl/await: declarations hoisted,
// the body in an async function). The value of the last expression is the result
// (util.inspect text, plus HTML or an image when the value offers them). SIGINT interrupts a
// running cell (breakOnSigint), or an await in progress.
'use strict';

const fs = require('fs');
const vm = require('vm');
const util = require('util');
const v8 = require('v8');
const path = require('path');
const url = require('url');
const Module = require('module');

const REQUESTS = 0;
const EVENTS = 3;
const TS = process.argv.includes('--ts');

let processTopLevelAwait = null;
try {
  ({ processTopLevelAwait } = require('internal/repl/await'));
} catch (_) {
  // Without --expose-internals (or in a Node that moved it): await needs an async function.
}
const ts = TS ? require('typescript') : null;

// ---- the channel ----

function send(...events) {
  const parts = [];
  for (const ev of events) {
    const body = Buffer.from(JSON.stringify(ev));
    const head = Buffer.alloc(4);
    head.writeUInt32LE(body.length);
    parts.push(head, body);
  }
  const buf = Buffer.concat(parts);
  let off = 0;
  while (off < buf.length) off += fs.writeSync(EVENTS, buf, off);
}

function parseFields(body) {
  const msg = { env: {} };
  let i = 0;
  while (i < body.length) {
    const nl = body.indexOf(10, i);
    if (nl < 0) break;
    const [name, len] = body.toString('utf8', i, nl).split(' ');
    const n = Number(len);
    const value = body.toString('utf8', nl + 1, nl + 1 + n);
    i = nl + 2 + n;
    if (name.startsWith('env.')) msg.env[name.slice(4)] = value;
    else msg[name] = value;
  }
  return msg;
}

let inbuf = Buffer.alloc(0);
const rbuf = Buffer.alloc(1 << 20);

function takeFrame() {
  if (inbuf.length < 4) return null;
  const len = inbuf.readUInt32LE(0);
  if (inbuf.length < 4 + len) return null;
  const body = inbuf.subarray(4, 4 + len);
  inbuf = inbuf.subarray(4 + len);
  return parseFields(body);
}

// The next request (asynchronously: the event loop keeps running between cells).
function nextRequest() {
  return new Promise((resolve) => {
    const loop = () => {
      const msg = takeFrame();
      if (msg) return resolve(msg);
      fs.read(REQUESTS, rbuf, 0, rbuf.length, null, (err, n) => {
        if (err && (err.code === 'EINTR' || err.code === 'EAGAIN')) return loop();
        if (err || n === 0) process.exit(0);
        inbuf = Buffer.concat([inbuf, rbuf.subarray(0, n)]);
        loop();
      });
    };
    loop();
  });
}

// The agent's ack of a display (a blocking read: no other read is outstanding during a cell).
function waitAck() {
  for (;;) {
    const msg = takeFrame();
    if (msg) {
      if (msg.op === 'ack') return;
      continue;
    }
    let n;
    try {
      n = fs.readSync(REQUESTS, rbuf, 0, rbuf.length, null);
    } catch (e) {
      if (e.code === 'EINTR' || e.code === 'EAGAIN') continue;
      process.exit(0);
    }
    if (n === 0) process.exit(0);
    inbuf = Buffer.concat([inbuf, rbuf.subarray(0, n)]);
  }
}

// ---- rich values ----

const PNG = Buffer.from([0x89, 0x50, 0x4e, 0x47]);

function bundle(value) {
  if (value && typeof value === 'object') {
    if (value[DISPLAY]) return value[DISPLAY];
    if (typeof value.toMimeBundle === 'function') {
      try {
        const b = value.toMimeBundle();
        if (b && typeof b === 'object') return { 'text/plain': util.inspect(value), ...b };
      } catch (_) { /* fall back to text */ }
    }
  }
  const data = { 'text/plain': typeof value === 'string' ? util.inspect(value) : util.inspect(value, { depth: 4 }) };
  if (Buffer.isBuffer(value) && value.subarray(0, 4).equals(PNG)) data['image/png'] = value.toString('base64');
  if (value && typeof value === 'object' && typeof value.toHTML === 'function') {
    try { data['text/html'] = String(value.toHTML()); } catch (_) { /* text only */ }
  }
  return data;
}

const DISPLAY = Symbol('ember.display');

// display(value) shows a value now: a bundle ({'text/html': ...}), an object offering
// toMimeBundle()/toHTML(), a PNG Buffer, or anything else as text. display.html(s),
// display.png(buffer or base64), display.svg(s), display.markdown(s) make one of a kind.
function display(value, mime) {
  let data;
  if (mime) data = { [mime]: Buffer.isBuffer(value) ? value.toString('base64') : String(value) };
  else if (value && typeof value === 'object' && !Array.isArray(value) && !Buffer.isBuffer(value) &&
           Object.keys(value).length > 0 && Object.keys(value).every((k) => k.includes('/'))) data = value;
  else data = bundle(value);
  if (!current) {
    process.stderr.write('display() outside a running cell is ignored\n');
    return;
  }
  send({ ev: 'display', data });
  waitAck();
}
display.html = (s) => display(s, 'text/html');
display.markdown = (s) => display(s, 'text/markdown');
display.svg = (s) => display(s, 'image/svg+xml');
display.png = (b) => display(b, 'image/png');
display.json = (v) => display({ 'application/json': v });

// ---- cells ----

let count = 0;
let current = null; // the running cell: { errors, interrupt }

class Interrupted extends Error {}

function errorEvent(err) {
  if (err instanceof Interrupted || (err && err.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED')) {
    return { ev: 'exception', name: 'KeyboardInterrupt', value: 'interrupted', traceback: [] };
  }
  if (err instanceof Error || (err && typeof err === 'object' && 'stack' in err)) {
    const name = err.name || (err.constructor && err.constructor.name) || 'Error';
    const stack = String(err.stack || `${name}: ${err.message}`)
      .split('\n')
      .filter((l) => !l.includes(__filename) && !l.includes('node:vm') && !l.includes('node:internal'));
    return { ev: 'exception', name, value: String(err.message ?? ''), traceback: stack };
  }
  return { ev: 'exception', name: 'Uncaught', value: util.inspect(err), traceback: [] };
}

process.on('uncaughtException', (err) => {
  if (current) current.errors.push(err);
  else process.stderr.write(`Uncaught ${util.inspect(err)}\n`);
});
process.on('unhandledRejection', (reason) => {
  if (current) current.errors.push(reason);
  else process.stderr.write(`Unhandled rejection: ${util.inspect(reason)}\n`);
});
process.on('SIGINT', () => {
  if (current) current.interrupt();
});

function transpile(code) {
  const out = ts.transpileModule(code, {
    fileName: 'cell.ts',
    reportDiagnostics: true,
    compilerOptions: {
      target: ts.ScriptTarget.ES2022,
      module: ts.ModuleKind.CommonJS,
      esModuleInterop: true,
    },
  });
  const errors = (out.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length) {
    const lines = errors.map((d) => {
      const text = ts.flattenDiagnosticMessageText(d.messageText, '\n');
      if (d.file && d.start !== undefined) {
        const { line, character } = d.file.getLineAndCharacterOfPosition(d.start);
        return `cell.ts(${line + 1},${character + 1}): error TS${d.code}: ${text}`;
      }
      return `error TS${d.code}: ${text}`;
    });
    const err = new SyntaxError(lines[0].replace(/^.*?error /, ''));
    err.stack = lines.join('\n');
    throw err;
  }
  // A cell without imports/exports is a script; with them, CommonJS needs `exports`.
  return out.outputText.replace(/\n\/\/# sourceMappingURL=.*$/, '');
}

function compile(src, filename) {
  // import() in a vm.Script needs --experimental-vm-modules: it calls a global instead (from
  // the context's working directory). `x.import(` and `importX(` are left alone.
  src = src.replace(/(^|[^.\w$])import\s*\(/g, '$1__ember_import(');
  const options = { filename };
  // `{ a: 1 }` is an object, not a block (as in Node's REPL).
  if (/^\s*\{/.test(src) && !/;\s*$/.test(src)) {
    try {
      return new vm.Script(`(${src}\n)`, options);
    } catch (_) { /* a block after all */ }
  }
  return new vm.Script(src, options);
}

function importFromCwd(spec) {
  if (!spec.startsWith('node:') && !Module.builtinModules.includes(spec)) {
    try {
      return import(url.pathToFileURL(globalThis.require.resolve(spec)).href);
    } catch (_) { /* as given */ }
  }
  return import(spec);
}

async function runCell(msg) {
  count += 1;
  const cell = { errors: [], interrupted: false, interrupt: null };
  const stop = new Promise((_, reject) => {
    cell.interrupt = () => {
      cell.interrupted = true;
      reject(new Interrupted());
    };
  });
  stop.catch(() => {});
  current = cell;
  // The event loop must not run dry while the cell awaits something that never settles (the
  // next request is read only after the cell): one timer, cleared at the end.
  const keepAlive = setInterval(() => {}, 1 << 30);
  const saved = applyEnv(msg.env);
  const closing = [];
  let status = 'ok';
  try {
    if (msg.reseed) reseed();
    let src = msg.code || '';
    if (TS) src = transpile(src);
    let awaited = false;
    if (processTopLevelAwait && /\bawait\b/.test(src)) {
      try {
        const wrapped = processTopLevelAwait(src);
        if (wrapped !== null) {
          src = wrapped;
          awaited = true;
        }
      } catch (_) { /* a syntax error: compile() reports it */ }
    }
    const script = compile(src, `<cell ${count}>`);
    // A SIGINT that came while the cell was transpiled or compiled waits for the event loop,
    // which a synchronous cell would never give a turn (breakOnSigint watches only from here
    // on): one turn now lets the listener see it first.
    await new Promise((resolve) => setImmediate(resolve));
    if (cell.interrupted) throw new Interrupted();
    let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
    if (awaited) {
      const wrapper = await Promise.race([value, stop]);
      value = wrapper ? wrapper.value : undefined;
    }
    if (value && typeof value.then === 'function') value = await Promise.race([value, stop]);
    // Rejections and errors of the cell's own promises land in the handlers above.
    await new Promise((resolve) => setImmediate(resolve));
    if (cell.errors.length) throw cell.errors[0];
    if (value !== undefined) closing.push({ ev: 'result', data: bundle(value), execution_count: count });
  } catch (err) {
    const ev = errorEvent(err);
    status = ev.name === 'KeyboardInterrupt' ? 'interrupted' : 'error';
    closing.push(ev);
  } finally {
    current = null;
    clearInterval(keepAlive);
    restoreEnv(saved);
  }
  closing.push({ ev: 'end', status, execution_count: count });
  send(...closing);
}

function applyEnv(env) {
  const saved = {};
  for (const [k, v] of Object.entries(env || {})) {
    saved[k] = process.env[k];
    process.env[k] = v;
  }
  return saved;
}

function restoreEnv(saved) {
  for (const [k, v] of Object.entries(saved)) {
    if (v === undefined) delete process.env[k];
    else process.env[k] = v;
  }
}

// Fresh Math.random state after a snapshot restore (every clone would otherwise draw the same
// numbers): xorshift128+ seeded from the kernel, whose pool the host reseeded.
function reseed() {
  const seed = Buffer.alloc(16);
  const fd = fs.openSync('/dev/urandom', 'r');
  try { fs.readSync(fd, seed, 0, 16, null); } finally { fs.closeSync(fd); }
  let s0 = seed.readBigUInt64LE(0) | 1n;
  let s1 = seed.readBigUInt64LE(8);
  const mask = (1n << 64n) - 1n;
  Math.random = function random() {
    let x = s0;
    const y = s1;
    s0 = y;
    x ^= (x << 23n) & mask;
    s1 = x ^ y ^ (x >> 17n) ^ (y >> 26n);
    return Number(((s1 + y) & mask) >> 11n) / 2 ** 53;
  };
}

function setup(msg) {
  for (const [k, v] of Object.entries(msg.env || {})) process.env[k] = v;
  if (msg.cwd) process.chdir(msg.cwd);
  globals();
}

function globals() {
  const req = Module.createRequire(path.join(process.cwd(), '[cell]'));
  globalThis.require = req;
  globalThis.module = { exports: {}, require: req };
  globalThis.exports = globalThis.module.exports;
  globalThis.display = display;
  globalThis.__ember_import = importFromCwd;
}

// One of each kind of cell before `ready`, so that a context's first real cell finds the code
// it runs compiled and loaded (a warm spare, in the template's snapshot).
async function warm() {
  const cells = [
    '({ a: [1, 2], b: "x" })',
    'await Promise.resolve(1)',
    'throw new TypeError("warm-up")',
    '({ w: 1 })',
  ];
  for (const code of cells) {
    let src = TS ? transpile(code) : code;
    try {
      if (processTopLevelAwait && /\bawait\b/.test(src)) src = processTopLevelAwait(src) || src;
      let v = compile(src, '<warm-up>').runInThisContext({ breakOnSigint: true, displayErrors: false });
      if (v && typeof v.then === 'function') v = await v;
      bundle(v);
    } catch (err) {
      errorEvent(err);
    }
  }
  count = 0;
  // A full collection now, so that the next one is far off: after a restore every heap page a
  // collection walks costs a fault (milliseconds each where guest memory faults are emulated).
  try {
    v8.setFlagsFromString('--expose-gc');
    vm.runInNewContext('gc')();
  } catch (_) { /* only a head start */ }
}

async function main() {
  globals();
  await warm();
  send({ ev: 'ready', pid: process.pid, cwd: process.cwd() });
  for (;;) {
    const msg = await nextRequest();
    if (msg.op === 'run') {
      await runCell(msg);
    } else if (msg.op === 'setup') {
      try {
        setup(msg);
        send({ ev: 'ready', pid: process.pid, cwd: process.cwd() });
      } catch (e) {
        send({ ev: 'error', message: `${msg.cwd}: ${e.message}` });
      }
    } else if (msg.op !== 'ack') {
      send({ ev: 'error', message: `unknown op ${msg.op}` });
    }
  }
}

main();
