// Volumes through the unchanged TypeScript SDK (Volume, volumeMounts): create, list, getInfo,
// the content methods with the volume's token (E2B_VOLUME_API_URL: the API itself), a sandbox
// that mounts the volume and sees what the content API wrote (and the other way round), the 409
// of a delete while it is mounted, destroy.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import { RUN_ID, Sandbox, Volume } from './helpers.mjs'

process.env.E2B_VOLUME_API_URL ??= process.env.E2B_API_URL

describe('volumes', { timeout: 300_000 }, () => {
  const name = `ts-${RUN_ID}`.replace(/[^A-Za-z0-9_-]/g, '-')
  let vol
  let sbx
  after(async () => {
    if (sbx) await sbx.kill().catch(() => {})
    if (vol) await Volume.destroy(vol.volumeId).catch(() => {})
  })

  test('the volume API and its content without a sandbox', async () => {
    vol = await Volume.create(name)
    assert.equal(vol.name, name)
    assert.ok(vol.token)
    assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId))
    assert.equal((await Volume.getInfo(vol.volumeId)).token, vol.token)

    const written = await vol.writeFile('/in/hello.txt', 'hello from ts')
    assert.equal(written.size, 13)
    assert.equal(written.path, '/in/hello.txt')
    assert.equal(await vol.readFile('/in/hello.txt'), 'hello from ts')
    const dir = await vol.makeDir('/a/b', { force: true })
    assert.equal(dir.name, 'b')
    const entries = await vol.list('/', { depth: 2 })
    assert.deepEqual(entries.map((e) => e.path).sort(), ['/a', '/a/b', '/in', '/in/hello.txt'])
    assert.equal(await vol.exists('/in/hello.txt'), true)
    assert.equal(await vol.exists('/missing'), false)
    await vol.remove('/a')
    assert.equal(await vol.exists('/a'), false)
  })

  test('a sandbox mounts it', async () => {
    sbx = await Sandbox.create({ volumeMounts: { '/home/user/vol': vol }, timeoutMs: 300_000 })
    const read = await sbx.commands.run('cat /home/user/vol/in/hello.txt')
    assert.equal(read.stdout, 'hello from ts')
    await sbx.commands.run('echo from-the-guest > /home/user/vol/out.txt')
    assert.equal((await vol.readFile('/out.txt')).trim(), 'from-the-guest')
    assert.deepEqual((await sbx.getInfo()).volumeMounts, [{ name, path: '/home/user/vol' }])
    await assert.rejects(Volume.destroy(vol.volumeId), /mounted by/)
    await sbx.kill()
    sbx = undefined
    assert.equal(await Volume.destroy(vol.volumeId), true)
    vol = undefined
  })
})
