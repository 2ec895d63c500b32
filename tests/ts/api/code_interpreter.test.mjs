// npm @e2b/code-interpreter (installed by scripts/setup_ts_code_interpreter.sh; AENV_CI_TS_DIR)
// re-exports its own `e2b` dependency and subclasses its Sandbox: the same network, volume and
// secret calls through that package, no VM (tests/unit/test_ts_sdk_api.py serves the API).
import { describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'
import path from 'node:path'

const require = createRequire(path.join(process.env.AENV_CI_TS_DIR, 'package.json'))
const { Sandbox, Secret, Volume } = require('@e2b/code-interpreter')
process.env.E2B_VOLUME_API_URL ??= process.env.E2B_API_URL

describe('@e2b/code-interpreter', { timeout: 60_000 }, () => {
  test('network, volumeMounts and secrets through the code interpreter package', async () => {
    const name = `ci-${process.pid}`
    const vol = await Volume.create(name)
    await vol.writeFile('/x.txt', 'x')
    const secret = await Secret.create(name, 'ci-secret-value')
    const rules = { 'api.example.com': [{ transform: { headers: { 'X-Key': Secret.fill(name) } } }] }
    const sbx = await Sandbox.create('base', {
      network: { allowOut: ['api.example.com'], denyOut: ({ allTraffic }) => [allTraffic], rules },
      volumeMounts: { '/home/user/v': vol },
    })
    try {
      const info = await sbx.getInfo()
      assert.deepEqual(info.network.rules, rules)
      assert.deepEqual(info.volumeMounts, [{ name, path: '/home/user/v' }])
      await sbx.updateNetwork({ denyOut: ['8.8.8.8'] })
      assert.deepEqual((await sbx.getInfo()).network.denyOut, ['8.8.8.8'])
    } finally {
      await sbx.kill()
    }
    assert.equal(await Secret.destroy(secret.secretId), true)
    assert.equal(await Volume.destroy(vol.volumeId), true)
  })
})
