// The official Node SDK (npm @e2b/code-interpreter) against the code interpreter's server in
// debug mode (E2B_DEBUG, E2B_SANDBOX_URL: no API call, port-49999 calls go to the server), run
// by tests/code_interpreter/test_js_sdk.py. It covers what differs from the Python SDK: fetch
// with a request timer that stops only when headers arrive, `timeoutMs` aborting the body,
// `?source=` on every URL (E2B_USER_AGENT_SOURCE), and unknown result keys as extra formats.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { createRequire } from 'node:module'
import path from 'node:path'

const require = createRequire(path.join(process.env.AENV_CI_TS_DIR, 'package.json'))
const { Sandbox } = require('@e2b/code-interpreter')

const sbx = await Sandbox.create()

test('runCode: value, logs, error', async () => {
  const execution = await sbx.runCode('print("hi"); 1 + 1')
  assert.equal(execution.text, '2')
  assert.deepEqual(execution.logs.stdout, ['hi\n'])
  const failed = await sbx.runCode('1 / 0')
  assert.equal(failed.error.name, 'ZeroDivisionError')
})

test('streaming callbacks arrive before the call returns', async () => {
  const seen = []
  const execution = await sbx.runCode('import time; print("a", flush=True); time.sleep(1.5); print("b")', {
    onStdout: (m) => seen.push([m.line, Date.now()]),
  })
  const returned = Date.now()
  // The kernel's stdout may arrive as "a" and "\n" when its flush timer fires between
  // print's two writes (a loaded host): the text and its timing are what is promised.
  assert.equal(seen.map(([line]) => line).join(''), 'a\nb\n')
  assert.ok(returned - seen[0][1] >= 1000, `${returned - seen[0][1]} ms`)
  assert.equal(execution.logs.stdout.join(''), 'a\nb\n')
})

test('a chart: png, chart, no extra formats', async () => {
  const execution = await sbx.runCode(
    'import matplotlib.pyplot as plt\nplt.bar(["a", "b"], [1, 2]); plt.title("t"); plt.show()')
  const [result] = execution.results
  assert.ok(Buffer.from(result.png, 'base64').subarray(0, 4).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47])))
  assert.equal(result.chart.title, 't')
  assert.ok(result.text.startsWith('<Figure'))
  assert.deepEqual(result.formats(), ['png']) // no unknown top-level keys turned into extra formats
  assert.deepEqual(result.extra, {})
})

test('contexts and languages', async () => {
  const ctx = await sbx.createCodeContext({ language: 'js' })
  assert.equal(ctx.language, 'javascript')
  await sbx.runCode('var n = 20', { context: ctx })
  assert.equal((await sbx.runCode('n + 22', { context: ctx })).text, '42')
  const listed = await sbx.listCodeContexts()
  assert.equal(listed.at(-1).id, ctx.id)
  await sbx.restartCodeContext(ctx)
  assert.equal((await sbx.runCode('typeof n', { context: ctx })).text, 'undefined')
  await sbx.removeCodeContext(ctx.id)
  // (a short request timer: the SDK leaves it running when the answer is an error)
  await assert.rejects(sbx.runCode('1', { context: ctx, requestTimeoutMs: 2000 }), /not found/i)
})

test('timeoutMs interrupts the kernel and the context keeps its state', async () => {
  await sbx.runCode('survivor = 7')
  const t0 = Date.now()
  await assert.rejects(sbx.runCode('import time; time.sleep(300)', { timeoutMs: 3000 }), /timed out|timeout|abort/i)
  assert.ok(Date.now() - t0 < 8000, `${Date.now() - t0} ms`)
  const t1 = Date.now()
  assert.equal((await sbx.runCode('survivor * 6', { timeoutMs: 10000 })).text, '42')
  assert.ok(Date.now() - t1 < 5000)
})

test('envs for one execution', async () => {
  assert.equal((await sbx.runCode('import os; os.getenv("FOO")', { envs: { FOO: 'bar' } })).text, 'bar')
  assert.equal((await sbx.runCode('import os; os.getenv("FOO", "none")')).text, 'none')
})
