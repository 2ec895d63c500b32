// Secrets through the unchanged TypeScript SDK (Secret): create, getInfo by id and name,
// exists, update (a new version), list with paging, fill, destroy; another name's absence;
// no value in any answer. Needs no VM: only the API.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import { RUN_ID, Secret, api } from './helpers.mjs'

describe('secrets', { timeout: 60_000 }, () => {
  const name = `ts-${RUN_ID}`.toLowerCase()
  const value = `value-${RUN_ID}-never-shown`
  after(async () => { await Secret.destroy(name).catch(() => {}) })

  test('create, read, update, list, destroy', async () => {
    const made = await Secret.create(name, value, { metadata: { by: 'ts' } })
    assert.match(made.secretId, /^sec_/)
    assert.equal(made.name, name)
    assert.equal(made.version, 1)
    assert.deepEqual(made.metadata, { by: 'ts' })
    assert.ok(made.createdAt instanceof Date)

    assert.equal((await Secret.getInfo(made.secretId)).name, name)
    assert.equal((await Secret.getInfo(name.toUpperCase())).secretId, made.secretId)
    assert.equal(await Secret.exists(name), true)
    assert.equal(await Secret.exists(`${name}-absent`), false)

    const updated = await Secret.update(name, `${value}-2`)
    assert.equal(updated.version, 2)

    const seen = []
    const pages = Secret.list({ limit: 1 })
    while (pages.hasNext) seen.push(...(await pages.nextItems()))
    assert.ok(seen.some((s) => s.secretId === made.secretId))

    assert.equal(Secret.fill(name), `\${e2b.secrets.${name}}`)
    for (const path of ['/secrets', `/secrets/${name}`, `/secrets/${name}/versions`]) {
      assert.ok(!(await (await api(path)).text()).includes(value), path)
    }
    assert.equal(await Secret.destroy(name), true)
    assert.equal(await Secret.destroy(name), false)
  })
})
