// E2B's sandboxKilledDuringRun test, in both routing modes: a background command, the
// sandbox killed while nothing reads the command's stream, then wait() rejects with
// "sandbox was killed or reached its end of life" (the data plane resets the stream, the
// SDK probes /health: 502 "was not found"). Host routing goes through the test's TLS
// terminator (tests/integration/tls_ingress.py) as the SDK's `proxy`, given by
// tests/integration/test_ts_sdk.py in AENV_TEST_INGRESS_PROXY (its CA in NODE_EXTRA_CA_CERTS).
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import { Sandbox, SandboxError, killTracked, tracked } from './helpers.mjs'

const INGRESS = process.env.AENV_TEST_INGRESS_PROXY
const GONE = /sandbox was killed or reached its end of life/

async function killedDuringRun(opts = {}) {
  const sbx = tracked(await Sandbox.create({ timeoutMs: 120_000, ...opts }))
  const cmd = await sbx.commands.run('sleep 60', { background: true })
  await sbx.kill()
  const started = Date.now()
  const err = await cmd.wait().then(() => new Error('wait() resolved although the sandbox was killed'), (e) => e)
  assert.ok(Date.now() - started < 20_000, `wait() ended ${Date.now() - started} ms after the kill`)
  return { sbx, err }
}

describe('killed during a run', { timeout: 120_000 }, () => {
  after(killTracked)

  test('behind E2B_SANDBOX_URL', async () => {
    const { err } = await killedDuringRun()
    assert.ok(err instanceof SandboxError, `expected a SandboxError, got ${err}`)
    assert.match(err.message, GONE)
  })

  test('with host routing (https://49983-<id>.<domain>)', { skip: !INGRESS && 'AENV_TEST_INGRESS_PROXY is not set' },
    async () => {
      const sandboxUrl = process.env.E2B_SANDBOX_URL
      delete process.env.E2B_SANDBOX_URL // read by each ConnectionConfig as it is made
      try {
        const { sbx, err } = await killedDuringRun({ proxy: INGRESS })
        assert.match(sbx.envdApiUrl ?? '', new RegExp(`^https://49983-${sbx.sandboxId}\\.`))
        assert.ok(err instanceof SandboxError, `expected a SandboxError, got ${err}`)
        assert.match(err.message, GONE)
      } finally {
        process.env.E2B_SANDBOX_URL = sandboxUrl
      }
    })
})
