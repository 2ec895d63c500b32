// The unchanged TypeScript SDK's Volume calls that tests/ts/volumes.test.mjs (VM suite) does not
// make, no VM (tests/unit/test_ts_sdk_api.py serves the API with a mock node): Volume.connect,
// the instance getInfo and updateMetadata, readFile as bytes, blob and stream, writeFile from an
// ArrayBuffer, a Blob and a ReadableStream, makeDir with a mode, the SDK's errors, volumeMounts
// at create with a Volume and with a name and getInfo's volumeMounts, the 409 of a delete while
// mounted, and the E2B client's bound classes.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import {
  E2B,
  RUN_ID,
  Sandbox,
  Volume,
  VolumeError,
  VolumeFileType,
  VolumeNotFoundError,
  killTracked,
  tracked,
} from '../helpers.mjs'

process.env.E2B_VOLUME_API_URL ??= process.env.E2B_API_URL
const text = (bytes) => new TextDecoder().decode(bytes)

describe('volume calls', { timeout: 60_000 }, () => {
  const name = `ts-api-${RUN_ID}`.replace(/[^A-Za-z0-9_-]/g, '-')
  let vol
  after(async () => {
    await killTracked()
    if (vol) await Volume.destroy(vol.volumeId).catch(() => {})
  })

  test('content methods with every body and read format', async () => {
    const made = await Volume.create(name)
    vol = await Volume.connect(made.volumeId)
    assert.equal(vol.name, name)
    assert.equal(vol.token, made.token)

    const dir = await vol.makeDir('/d', { mode: 0o750 })
    assert.equal(dir.type, VolumeFileType.DIRECTORY)
    assert.equal(dir.mode, 0o750)
    const fromBuffer = await vol.writeFile('/d/buffer.bin', new Uint8Array([1, 2, 3]).buffer, { mode: 0o640 })
    assert.equal(fromBuffer.size, 3)
    assert.equal(fromBuffer.mode, 0o640)
    assert.ok(fromBuffer.mtime instanceof Date)
    await vol.writeFile('/d/blob.txt', new Blob(['from a blob']))
    const big = new Uint8Array(3 * 1024 * 1024).map((_, i) => i % 251)
    const stream = new ReadableStream({
      start(controller) {
        for (let i = 0; i < big.length; i += 256 * 1024) controller.enqueue(big.slice(i, i + 256 * 1024))
        controller.close()
      },
    })
    assert.equal((await vol.writeFile('/d/stream.bin', stream)).size, big.length)

    assert.deepEqual([...(await vol.readFile('/d/buffer.bin', { format: 'bytes' }))], [1, 2, 3])
    assert.equal(await (await vol.readFile('/d/blob.txt', { format: 'blob' })).text(), 'from a blob')
    const chunks = []
    for await (const chunk of await vol.readFile('/d/stream.bin', { format: 'stream' })) chunks.push(chunk)
    assert.deepEqual(Buffer.concat(chunks), Buffer.from(big))
    assert.equal(text(await vol.readFile('/d/blob.txt', { format: 'bytes' })), 'from a blob')

    const info = await vol.getInfo('/d/buffer.bin')
    assert.equal(info.type, VolumeFileType.FILE)
    assert.equal(info.name, 'buffer.bin')
    assert.equal((await vol.updateMetadata('/d/buffer.bin', { mode: 0o600 })).mode, 0o600)
    assert.deepEqual((await vol.list('/d')).map((e) => e.name).sort(), ['blob.txt', 'buffer.bin', 'stream.bin'])

    await assert.rejects(vol.getInfo('/absent'), (err) => err instanceof VolumeError || /not found/i.test(err.message))
    await assert.rejects(vol.readFile('/absent'), /not found/i)
    await assert.rejects(vol.makeDir('/x/y'), /not found|no such/i) // no parents without force
    await assert.rejects(new Volume(vol.volumeId, name, 'not-the-token').list('/'), /401|unauthori[sz]ed|token/i)
  })

  test('volumeMounts at create, getInfo, the 409 of a delete while mounted', async () => {
    const byVolume = tracked(await Sandbox.create({ volumeMounts: { '/home/user/v': vol } }))
    const byName = tracked(await Sandbox.create({ volumeMounts: { '/mnt/a': name, '/mnt/b': vol } }))
    assert.deepEqual((await byVolume.getInfo()).volumeMounts, [{ name, path: '/home/user/v' }])
    assert.deepEqual((await Sandbox.getInfo(byName.sandboxId)).volumeMounts,
      [{ name, path: '/mnt/a' }, { name, path: '/mnt/b' }])
    await assert.rejects(Volume.destroy(vol.volumeId), /mounted by/)
    await assert.rejects(Sandbox.create({ volumeMounts: { '/data': `${name}-absent` } }), /not found/)
    await byVolume.kill()
    await byName.kill()
    assert.equal(await Volume.destroy(vol.volumeId), true)
    assert.equal(await Volume.destroy(vol.volumeId), false)
    await assert.rejects(Volume.getInfo(vol.volumeId), VolumeNotFoundError)
    vol = undefined
  })

  test('the E2B client binds its key and URL', async () => {
    const key = process.env.E2B_API_KEY
    delete process.env.E2B_API_KEY // only the client's own options from here
    try {
      const client = new E2B({ apiKey: key, apiUrl: process.env.E2B_API_URL })
      const bound = await client.Volume.create(`${name}-bound`)
      assert.ok((await client.Volume.list()).some((v) => v.volumeId === bound.volumeId))
      await bound.writeFile('/f.txt', 'bound')
      const secret = await client.Secret.create(`${name}-bound`.toLowerCase(), 'bound-value')
      assert.equal((await client.Secret.getInfo(secret.secretId)).name, secret.name)
      const sbx = tracked(await client.Sandbox.create({ volumeMounts: { '/v': bound } }))
      assert.deepEqual((await sbx.getInfo()).volumeMounts, [{ name: bound.name, path: '/v' }])
      await sbx.kill()
      assert.equal(await client.Secret.destroy(secret.secretId), true)
      assert.equal(await client.Volume.destroy(bound.volumeId), true)
      await assert.rejects(new E2B({ apiKey: 'e2b_' + '0'.repeat(40), apiUrl: process.env.E2B_API_URL })
        .Volume.list(), /401|unauthori[sz]ed|invalid/i)
    } finally {
      process.env.E2B_API_KEY = key
    }
  })
})
