// One parent sandbox with a file and a running background process, through the
// lifecycle: pause -> Sandbox.connect, createSnapshot -> Sandbox.create(snapshotId),
// fork({count: 2}). Four VMs in all (parent, one restored, two children).
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import {
  RUN_ID,
  Sandbox,
  killTracked,
  listAll,
  readCounter,
  startCounter,
  tracked,
  waitFor,
} from './helpers.mjs'

/** The counter keeps its pid and keeps counting: the process survived and runs. */
async function assertCounterRuns(sbx, pid, atLeast) {
  const now = await readCounter(sbx)
  assert.equal(now.pid, pid, `the background process in ${sbx.sandboxId} was restarted, not kept`)
  assert.ok(now.n >= atLeast, `counter went back: ${now.n} < ${atLeast}`)
  await waitFor(async () => (await readCounter(sbx)).n > now.n, {
    timeoutMs: 15_000,
    what: `the background process in ${sbx.sandboxId} to keep counting`,
  })
}

describe('lifecycle: pause/connect, snapshot, fork', { timeout: 300_000 }, () => {
  const run = `lifecycle-${RUN_ID}`
  const metadata = { suite: 'ts-sdk', run }
  let parent
  let counter

  before(async () => {
    parent = tracked(await Sandbox.create({ metadata, timeoutMs: 600_000 }))
    await parent.files.write('/home/user/state.txt', 'from parent')
    counter = await startCounter(parent)
  })
  after(killTracked)

  test('pause -> Sandbox.connect keeps the file and the running process', async () => {
    const id = parent.sandboxId
    assert.equal(await parent.pause(), true)
    const paused = await Sandbox.getInfo(id)
    assert.equal(paused.state, 'paused')
    assert.deepEqual(paused.metadata, metadata)
    assert.deepEqual((await listAll({ query: { metadata: { run }, state: ['paused'] } })).map((s) => s.sandboxId), [id])
    assert.deepEqual(await listAll({ query: { metadata: { run }, state: ['running'] } }), [])
    assert.equal(await parent.isRunning(), false)
    assert.equal(await parent.pause(), false, 'pausing a paused sandbox answers false (409)')

    const again = await Sandbox.connect(id, { timeoutMs: 600_000 })
    assert.equal(again.sandboxId, id)
    assert.equal((await again.getInfo()).state, 'running')
    assert.equal(await again.isRunning(), true)
    assert.equal(await again.files.read('/home/user/state.txt'), 'from parent')
    assert.equal((await again.commands.run('echo back')).stdout, 'back\n')
    await assertCounterRuns(again, counter.pid, counter.n)
    // connecting to a running sandbox is fine too and changes nothing
    const same = await Sandbox.connect(id)
    assert.equal(same.sandboxId, id)
    assert.equal((await same.getInfo()).state, 'running')
    parent = again
  })

  test('createSnapshot -> Sandbox.create(snapshotId) has the file and the process', async () => {
    await parent.files.write('/home/user/snap.txt', 'captured')
    const name = `ts-snap-${RUN_ID}`
    const snap = await parent.createSnapshot({ name })
    assert.equal(typeof snap.snapshotId, 'string')
    assert.ok(snap.snapshotId.length > 0)
    assert.ok(snap.names.includes(name), `names ${JSON.stringify(snap.names)} lack ${name}`)
    // the source keeps running with its id; later changes do not reach the snapshot
    assert.equal((await parent.getInfo()).state, 'running')
    await parent.files.write('/home/user/snap.txt', 'changed after the snapshot')
    const listed = await parent.listSnapshots().nextItems()
    assert.deepEqual(listed.map((s) => s.snapshotId), [snap.snapshotId])

    const restored = tracked(await Sandbox.create(snap.snapshotId, { metadata: { ...metadata, from: 'snapshot' } }))
    assert.notEqual(restored.sandboxId, parent.sandboxId)
    assert.equal(await restored.files.read('/home/user/snap.txt'), 'captured')
    assert.equal(await restored.files.read('/home/user/state.txt'), 'from parent')
    await assertCounterRuns(restored, counter.pid, counter.n)
    const info = await restored.getInfo()
    assert.equal(info.state, 'running')
    assert.deepEqual(info.metadata, { ...metadata, from: 'snapshot' })
    assert.equal(await parent.files.read('/home/user/snap.txt'), 'changed after the snapshot')

    assert.equal(await restored.kill(), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.deepEqual(await parent.listSnapshots().nextItems(), [])
  })

  test('fork({count: 2}) gives exactly two children with the parent\'s file and process', async () => {
    await parent.files.write('/home/user/fork.txt', 'before fork')
    const endBefore = (await parent.getInfo()).endAt.getTime()
    const results = await parent.fork({ count: 2 })
    for (const r of results) if (!(r instanceof Error)) tracked(r)
    const errors = results.filter((r) => r instanceof Error)
    assert.deepEqual(errors.map(String), [])
    assert.equal(results.length, 2)
    const children = results
    const ids = new Set([parent.sandboxId, ...children.map((c) => c.sandboxId)])
    assert.equal(ids.size, 3, 'children need ids of their own')

    for (const child of children) {
      assert.ok(child instanceof Sandbox)
      assert.equal(await child.files.read('/home/user/fork.txt'), 'before fork')
      assert.equal(await child.files.read('/home/user/state.txt'), 'from parent')
      assert.equal((await child.getInfo()).state, 'running')
      await assertCounterRuns(child, counter.pid, counter.n)
    }
    // a child's write is its own
    await children[0].files.write('/home/user/fork.txt', 'child 0 was here')
    assert.equal(await children[1].files.read('/home/user/fork.txt'), 'before fork')
    assert.equal(await parent.files.read('/home/user/fork.txt'), 'before fork')
    // the parent keeps its id, its expiry and its process
    const parentInfo = await parent.getInfo()
    assert.equal(parentInfo.state, 'running')
    assert.equal(parentInfo.endAt.getTime(), endBefore)
    await assertCounterRuns(parent, counter.pid, counter.n)
    // the children show up in the list (they are sandboxes of this team)
    const all = new Set((await listAll({})).map((s) => s.sandboxId))
    for (const c of children) assert.ok(all.has(c.sandboxId), `${c.sandboxId} not listed`)

    await Promise.all(children.map(async (c) => assert.equal(await c.kill(), true)))
  })
})
