// Three sandboxes with unique metadata (one from the named template "base"):
// Sandbox.list pagination (limit, hasNext, nextToken, nextItems), metadata and state
// filters; then kill (a wait() in flight ends at once), after which list and getInfo no
// longer show the sandbox.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import {
  CommandExitError,
  RUN_ID,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  TimeoutError,
  killTracked,
  listAll,
  tracked,
} from './helpers.mjs'

describe('three sandboxes: list, filter, kill', { timeout: 240_000 }, () => {
  const run = `list-${RUN_ID}`
  const sandboxes = []

  before(async () => {
    // sequential: a create is a restore of the template snapshot (~0.3 s), and this box is small
    sandboxes.push(tracked(await Sandbox.create('base', { metadata: { run, idx: '0' }, timeoutMs: 300_000 })))
    for (const idx of ['1', '2']) {
      sandboxes.push(tracked(await Sandbox.create({ metadata: { run, idx }, timeoutMs: 300_000 })))
    }
  })
  after(killTracked)

  test('create("base") starts the named template', async () => {
    const info = await sandboxes[0].getInfo()
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, { run, idx: '0' })
    assert.equal(info.state, 'running')
    assert.equal((await sandboxes[0].commands.run('echo named')).stdout, 'named\n')
    assert.equal(new Set(sandboxes.map((s) => s.sandboxId)).size, 3)
  })

  test('Sandbox.list pages with limit, hasNext and nextToken', async () => {
    const paginator = Sandbox.list({ query: { metadata: { run } }, limit: 2 })
    assert.equal(paginator.hasNext, true)
    const first = await paginator.nextItems()
    assert.equal(first.length, 2, `first page: ${JSON.stringify(first.map((s) => s.sandboxId))}`)
    assert.equal(paginator.hasNext, true)
    const token = paginator.nextToken
    assert.ok(token, 'a next token after a full first page')
    const second = await paginator.nextItems()
    assert.equal(second.length, 1, `second page: ${JSON.stringify(second.map((s) => s.sandboxId))}`)
    assert.equal(paginator.hasNext, false)
    assert.equal(paginator.nextToken, undefined)
    await assert.rejects(paginator.nextItems(), /No more items/)

    const ids = [...first, ...second].map((s) => s.sandboxId)
    assert.equal(new Set(ids).size, 3, `duplicates across pages: ${ids}`)
    assert.deepEqual([...ids].sort(), sandboxes.map((s) => s.sandboxId).sort())
    for (const item of [...first, ...second]) {
      const idx = String(sandboxes.findIndex((s) => s.sandboxId === item.sandboxId))
      assert.deepEqual(item.metadata, { run, idx })
      assert.equal(item.templateId, 'base')
      assert.equal(item.state, 'running')
      assert.ok(item.startedAt instanceof Date && !Number.isNaN(item.startedAt.getTime()))
      assert.ok(item.endAt.getTime() > item.startedAt.getTime())
    }

    // a new paginator started from the token returns the same second page
    const resumed = Sandbox.list({ query: { metadata: { run } }, limit: 2, nextToken: token })
    const again = await resumed.nextItems()
    assert.deepEqual(again.map((s) => s.sandboxId), second.map((s) => s.sandboxId))
    assert.equal(resumed.hasNext, false)
  })

  test('Sandbox.list filters by metadata (AND of pairs) and state', async () => {
    const one = await listAll({ query: { metadata: { run, idx: '1' } } })
    assert.deepEqual(one.map((s) => s.sandboxId), [sandboxes[1].sandboxId])
    assert.deepEqual(await listAll({ query: { metadata: { run, idx: 'no-such' } } }), [])
    assert.deepEqual(await listAll({ query: { metadata: { run: `${run}-other` } } }), [])
    const running = await listAll({ query: { metadata: { run }, state: ['running'] } })
    assert.equal(running.length, 3)
    assert.deepEqual(await listAll({ query: { metadata: { run }, state: ['paused'] } }), [])
  })

  test('kill: a wait() in flight ends at once, and the sandbox is gone from list and getInfo', async () => {
    const victim = sandboxes[2]
    // a background command waited on while the sandbox is killed: the SDK's stream breaks,
    // it probes /health and reports the sandbox gone (not a timeout minutes later)
    const handle = await victim.commands.run('echo started; sleep 300', { background: true })
    const waited = handle.wait().then(
      () => ({ error: new Error('wait() resolved although the sandbox was killed') }),
      (error) => ({ error, at: Date.now() }),
    )
    await new Promise((r) => setTimeout(r, 1000))
    const killedAt = Date.now()
    assert.equal(await victim.kill(), true)
    const { error, at } = await waited
    assert.ok(error instanceof TimeoutError, `expected TimeoutError, got ${error}`)
    assert.match(error.message, /sandbox was killed or reached its end of life/)
    assert.ok(at - killedAt < 10_000, `wait() ended ${at - killedAt} ms after the kill`)
    assert.equal(await victim.isRunning(), false)
    const left = await listAll({ query: { metadata: { run } } })
    assert.deepEqual(left.map((s) => s.sandboxId).sort(), [sandboxes[0].sandboxId, sandboxes[1].sandboxId].sort())
    await assert.rejects(Sandbox.getInfo(victim.sandboxId), SandboxNotFoundError)
    await assert.rejects(victim.getInfo(), SandboxNotFoundError)
    assert.equal(await Sandbox.kill(victim.sandboxId), false)
    await assert.rejects(victim.commands.run('echo too late'), (e) => {
      assert.ok(e instanceof SandboxError && !(e instanceof CommandExitError), `unexpected ${e}`)
      return true
    })
    // the others are untouched
    assert.equal((await sandboxes[1].commands.run('echo still here')).stdout, 'still here\n')
  })
})
