// The official E2B JavaScript SDKs (`e2b`, `@e2b/code-interpreter`; Node 20, ESM) against
// `ember serve`: the core flows of test_sdk.py.
//
// Prints `ok <name> (<seconds>)` per passing check, `FAIL <name>: <error>` otherwise, and
// `skip <name>` when a prerequisite failed; exits 1 if any check failed or was skipped. Every
// sandbox made here is killed at the end, also on failure or SIGTERM.
//
// Usage: node test_sdk.mjs [--only NAME,NAME...] [--list]
// Configuration is the SDK's own environment: E2B_API_KEY plus E2B_API_URL=E2B_SANDBOX_URL
// (header route) or E2B_DOMAIN (TLS route). The packages are resolved from a `node_modules`
// beside this file (tests/e2b.rs copies the script next to a link to the installed ones).

import { createHash, randomBytes, randomUUID } from 'node:crypto'
import { CommandExitError } from 'e2b'
import { Sandbox } from '@e2b/code-interpreter'

const RUN_ID = randomUUID().replaceAll('-', '').slice(0, 12)
const CHECKS = []
const CREATED = new Set()
const STATE = {}

const check = (name, needs, fn) => CHECKS.push({ name, needs, fn })
const expect = (cond, what) => {
  if (!cond) throw new Error(what)
}
const eq = (got, want, what) => {
  if (JSON.stringify(got) !== JSON.stringify(want))
    throw new Error(`${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`)
}
const made = (s) => {
  CREATED.add(s.sandboxId)
  return s
}
const sbx = () => STATE.sbx
const note = (m) => console.log(`   ${m}`)
const timed = async (f) => {
  const t = performance.now()
  const r = await f()
  return [r, (performance.now() - t) / 1000]
}
const D = '/home/user/e2b-js'

check('create', [], async () => {
  const [s, dt] = await timed(() =>
    Sandbox.create({
      envs: { FOO: 'bar-from-create' },
      metadata: { suite: RUN_ID },
      timeoutMs: 1_800_000, // the shared sandbox lives through every check (test_sdk.py says why)
      requestTimeoutMs: 300_000, // and its calls get 300 s, not the SDK's 60 s (a slow kvm_pvm host)
    })
  )
  made(s)
  expect(s.sandboxId, 'no sandbox id')
  note(`Sandbox.create() ${s.sandboxId} in ${dt.toFixed(2)} s`)
  STATE.sbx = s
})

check('run_code_state', ['create'], async () => {
  const r1 = await sbx().runCode('x = 1')
  expect(!r1.error, `x = 1 failed: ${JSON.stringify(r1.error)}`)
  const [r, dt] = await timed(() => sbx().runCode('x + 1'))
  eq(r.text, '2', "runCode('x + 1').text")
  note(`runCode round trip ${(dt * 1000).toFixed(0)} ms`)
})

check('run_code_plot', ['create'], async () => {
  const r = await sbx().runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()'
  )
  expect(!r.error, `plot failed: ${JSON.stringify(r.error)}`)
  const png = r.results.find((x) => x.png)?.png
  expect(png, `no result with .png: ${JSON.stringify(r.results).slice(0, 300)}`)
  const bytes = Buffer.from(png, 'base64')
  eq([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a], 'PNG magic')
})

check('run_code_error', ['create'], async () => {
  const r = await sbx().runCode('1 / 0')
  expect(r.error, 'no error for 1 / 0')
  eq(r.error.name, 'ZeroDivisionError', 'error.name')
})

check('envs_from_create', ['create'], async () => {
  eq((await sbx().commands.run('echo $FOO')).stdout.trim(), 'bar-from-create', 'echo $FOO')
  eq((await sbx().runCode("import os; os.environ['FOO']")).text, 'bar-from-create', 'os.environ')
})

check('commands_run', ['create'], async () => {
  const r = await sbx().commands.run('echo out; echo err >&2')
  eq([r.stdout, r.stderr, r.exitCode], ['out\n', 'err\n', 0], 'stdout, stderr, exitCode')
  const c = await sbx().commands.run('echo $A; pwd', { envs: { A: 'b' }, cwd: '/tmp' })
  eq(c.stdout, 'b\n/tmp\n', 'envs and cwd')
})

check('commands_exit_code', ['create'], async () => {
  try {
    await sbx().commands.run('echo bad >&2; exit 3')
  } catch (e) {
    expect(e instanceof CommandExitError, `not a CommandExitError: ${e}`)
    eq([e.exitCode, e.stderr], [3, 'bad\n'], 'exitCode, stderr')
    return
  }
  throw new Error('no CommandExitError for exit 3')
})

check('commands_background', ['create'], async () => {
  const h = await sbx().commands.run('sleep 30', { background: true })
  expect(h.pid, 'no pid')
  const h2 = await sbx().commands.connect(h.pid)
  eq(h2.pid, h.pid, 'connect(pid).pid')
  eq(await sbx().commands.kill(h.pid), true, 'commands.kill(pid)')
  await h2.wait().then(
    (r) => {
      throw new Error(`a killed command ended normally: ${JSON.stringify(r)}`)
    },
    (e) => expect(e instanceof CommandExitError, `not a CommandExitError: ${e}`)
  )
})

check('files', ['create'], async () => {
  const f = sbx().files
  const w = await f.write(`${D}/a.txt`, 'alpha')
  eq(w.path, `${D}/a.txt`, 'WriteInfo.path')
  eq(await f.read(`${D}/a.txt`), 'alpha', 'read')
  eq(await f.exists(`${D}/a.txt`), true, 'exists')
  await f.makeDir(`${D}/sub`)
  const names = (await f.list(D)).map((e) => `${e.name}:${e.type}`).sort()
  eq(names, ['a.txt:file', 'sub:dir'], 'list')
  const data = randomBytes(4 << 20)
  await f.write(`${D}/big.bin`, new Blob([data]))
  const back = Buffer.from(await f.read(`${D}/big.bin`, { format: 'bytes' }))
  eq(
    createHash('sha256').update(back).digest('hex'),
    createHash('sha256').update(data).digest('hex'),
    '4 MiB round trip sha256'
  )
})

check('pause_resume', ['create'], async () => {
  const s = sbx()
  await s.runCode('y = 42')
  await s.files.write(`${D}/kept.txt`, 'kept')
  const [ok, dt] = await timed(() => s.pause())
  eq(ok, true, 'pause()')
  note(`pause ${dt.toFixed(2)} s`)
  const [r, dt2] = await timed(() => Sandbox.connect(s.sandboxId))
  note(`resume (Sandbox.connect) ${dt2.toFixed(2)} s`)
  eq((await r.runCode('x + y')).text, '43', 'interpreter state after resume')
  eq(await r.files.read(`${D}/kept.txt`), 'kept', 'file after resume')
  STATE.sbx = r
})

check('list_with_metadata', ['create'], async () => {
  const page = await Sandbox.list({ query: { metadata: { suite: RUN_ID } } }).nextItems()
  const ids = page.map((s) => s.sandboxId)
  expect(ids.includes(sbx().sandboxId), `${sbx().sandboxId} not listed: ${ids}`)
})

check('fork', ['create'], async () => {
  const s = sbx()
  await s.runCode("z = 'source'")
  const forks = await s.fork({ count: 2 })
  for (const f of forks) if (!(f instanceof Error)) made(f)
  const bad = forks.filter((f) => f instanceof Error)
  expect(!bad.length, `forks failed: ${bad}`)
  eq(forks.length, 2, 'number of forks')
  for (const [i, f] of forks.entries()) {
    eq((await f.runCode('z')).text, 'source', `fork ${i}: z`)
    await f.runCode(`z = 'fork${i}'`)
  }
  eq((await forks[1].runCode('z')).text, 'fork1', 'fork 1 keeps its own z')
  eq((await s.runCode('z')).text, 'source', "the source's z")
  for (const f of forks) eq(await f.kill(), true, 'kill fork')
})

check('snapshot', ['create'], async () => {
  const s = sbx()
  await s.runCode("w = 'snap'")
  const info = await s.createSnapshot()
  expect(info.snapshotId, 'no snapshotId')
  const t = made(await Sandbox.create(info.snapshotId))
  eq((await t.runCode('w')).text, 'snap', 'variable in the sandbox from the snapshot')
  eq(await t.kill(), true, 'kill')
})

// Per language, in the sandbox of `create` (code-interpreter-v1: ember's code-interpreter):
// state across three cells, a rich result, stdout streamed before the end, an error's name, a
// timeout that interrupts and keeps the state, two contexts isolated from each other.
const LANGUAGES = {
  javascript: {
    state: ['const base = 40', 'function add(x) { return base + x }', "console.log('sum', add(2)); ({ sum: add(2) })"],
    text: '{ sum: 42 }',
    stream: "console.log('first'); await new Promise(r => setTimeout(r, 1500)); 'later'",
    error: ['null.x', 'TypeError'],
    spin: "while (true) require('fs').fstatSync(1)",
    probe: ['add(1)', '41'],
    absent: ["typeof base === 'undefined'", 'true'],
  },
  typescript: {
    state: ['const base: number = 40', 'interface P { v: number }', "const p: P = { v: base + 2 }; console.log('sum', p.v); p"],
    text: '{ v: 42 }',
    stream: "console.log('first'); await new Promise<void>(r => setTimeout(r, 1500)); 'later'",
    error: ['let x: = 1', 'SyntaxError'],
    spin: "while (true) require('fs').fstatSync(1)",
    probe: ['base + 1', '41'],
    absent: ["typeof base === 'undefined'", 'true'],
  },
  r: {
    state: ['base <- 40', 'add <- function(x) base + x', "cat('sum', add(2), '\\n'); data.frame(a = 1:2)"],
    html: '<table',
    stream: "cat('first\\n'); Sys.sleep(1.5); 'later'",
    error: ["stop('bad')", 'simpleError'],
    spin: 'repeat Sys.getpid()',
    probe: ['add(1)', '[1] 41'],
    absent: ["exists('base')", '[1] FALSE'],
  },
  java: {
    state: ['int base = 40;', 'int add(int x) { return base + x; }', 'System.out.println("sum " + add(2)); add(2)'],
    text: '42',
    stream: 'System.out.println("first"); Thread.sleep(1500); "later"',
    error: ['Integer.parseInt("zz")', 'java.lang.NumberFormatException'],
    spin: 'while (true) { new java.io.File("/").exists(); }',
    probe: ['add(1)', '41'],
    absent: ['base', null],
  },
}

check('languages', ['create'], async () => {
  const s = sbx()
  // A cell may take a minute on a loaded kvm_pvm host (a JVM's third cell took 63 s beside
  // the other SDK's checks): 600 s, not the SDK's 60 s.
  const timeoutMs = 600_000
  for (const [language, c] of Object.entries(LANGUAGES)) {
    for (const code of c.state.slice(0, -1)) {
      const r = await s.runCode(code, { language, timeoutMs })
      expect(!r.error, `${language}: ${code}: ${JSON.stringify(r.error)}`)
    }
    const r = await s.runCode(c.state[c.state.length - 1], { language, timeoutMs })
    expect(!r.error, `${language}: third cell: ${JSON.stringify(r.error)}`)
    eq(r.logs.stdout.join('').trim(), 'sum 42', `${language}: stdout`)
    if (c.text) eq(r.text, c.text, `${language}: the result's text`)
    if (c.html) expect(r.results.some((x) => x.html?.includes(c.html)), `${language}: no HTML table`)
    const seen = []
    const t0 = performance.now()
    await s.runCode(c.stream, { language, timeoutMs, onStdout: () => seen.push(performance.now() - t0) })
    const took = performance.now() - t0
    expect(seen.length && took - seen[0] > 800, `${language}: stdout not streamed (${seen}, end ${took})`)
    const e = await s.runCode(c.error[0], { language, timeoutMs })
    eq(e.error?.name, c.error[1], `${language}: error.name`)
    let ended = false
    try {
      // Known bug (docs/e2b.md): an interrupt that lands while Node.js still transpiles or
      // compiles the cell is lost; javascript and typescript give up later, after that work.
      const giveUp = language === 'javascript' || language === 'typescript' ? 10_000 : 3000
      await s.runCode(c.spin, { language, timeoutMs: giveUp })
      ended = true
    } catch (_) {
      // the SDK's timeout
    }
    expect(!ended, `${language}: an endless loop ended`)
    // The client's timeout cancelled the run (the server closed its agent connection): that
    // cell was interrupted, the context and its state kept, and the next cell runs.
    const p = await s.runCode(c.probe[0], { language, timeoutMs })
    expect(!p.error, `${language}: after the timeout: ${JSON.stringify(p.error)}`)
    eq(p.text, c.probe[1], `${language}: the state after the timeout`)
    const [ctx, dt] = await timed(() => s.createCodeContext({ language }))
    note(`${language}: createCodeContext ${(dt * 1000).toFixed(0)} ms`)
    const a = await s.runCode(c.absent[0], { context: ctx, timeoutMs })
    if (c.absent[1] === null) expect(a.error, `${language}: ${c.absent[0]} in a new context did not fail`)
    else eq(a.text, c.absent[1], `${language}: a new context does not see the default one's state`)
  }
  let refused = null
  try {
    await s.runCode('1', { language: 'cobol' })
  } catch (e) {
    refused = e
  }
  // The JS SDK reports a 400 by its status line alone (the body, with the list, is the
  // Python SDK's check).
  expect(refused && /400|javascript/.test(String(refused.message)), `cobol not refused: ${refused}`)
})

check('kill', ['create'], async () => {
  const s = sbx()
  await s.kill()
  CREATED.delete(s.sandboxId)
  eq(await s.isRunning(), false, 'isRunning() after kill')
  eq(await Sandbox.kill(`i${RUN_ID}unknown`), false, 'Sandbox.kill(unknown id)')
})

async function cleanup() {
  for (const id of CREATED) {
    try {
      await Sandbox.kill(id, { requestTimeoutMs: 30_000 })
    } catch (e) {
      console.log(`   cleanup: kill ${id}: ${e}`)
    }
  }
  CREATED.clear()
}

async function main(argv) {
  const names = CHECKS.map((c) => c.name)
  if (argv.includes('--list')) {
    console.log(names.join('\n'))
    return 0
  }
  let only = null
  if (argv.includes('--only')) {
    only = argv[argv.indexOf('--only') + 1].split(',')
    const unknown = only.filter((n) => !names.includes(n))
    if (unknown.length) {
      console.error(`unknown checks ${unknown}; known: ${names}`)
      return 2
    }
  }
  const route = process.env.E2B_SANDBOX_URL || `https://*.${process.env.E2B_DOMAIN || 'e2b.app'}`
  console.log(`e2b JS SDK checks, run ${RUN_ID}, sandbox route ${route}`)
  process.on('SIGTERM', async () => {
    await cleanup()
    process.exit(143)
  })
  const passed = [], failed = [], skipped = []
  try {
    for (const { name, needs, fn } of CHECKS) {
      if (only && !only.includes(name) && name !== 'create') continue
      const missing = needs.filter((n) => !passed.includes(n))
      if (missing.length) {
        console.log(`skip ${name}: needs ${missing.join(', ')}`)
        skipped.push(name)
        continue
      }
      const t = performance.now()
      try {
        await fn()
      } catch (e) {
        console.log(`FAIL ${name}: ${e?.name}: ${e?.message}`)
        console.log(e?.stack)
        failed.push(name)
        continue
      }
      console.log(`ok ${name} (${((performance.now() - t) / 1000).toFixed(2)} s)`)
      passed.push(name)
    }
  } finally {
    await cleanup()
  }
  console.log(
    `${passed.length} passed, ${failed.length} failed (${failed.join(', ') || '-'}), ${skipped.length} skipped`
  )
  return failed.length || skipped.length ? 1 : 0
}

process.exitCode = await main(process.argv.slice(2))
