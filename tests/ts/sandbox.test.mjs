// One sandbox from the default template, created with metadata and timeoutMs: commands
// (streamed output, exit codes, background + kill), PTY, files, watchDir, signed download
// and upload URLs, getHost + a user port, getMetrics, getInfo, setTimeout.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import os from 'node:os'

import {
  CommandExitError,
  FileNotFoundError,
  FileType,
  FilesystemEventType,
  RUN_ID,
  Sandbox,
  killTracked,
  tracked,
  waitFor,
} from './helpers.mjs'

const encode = (s) => new TextEncoder().encode(s)

describe('a sandbox from the default template', { timeout: 240_000 }, () => {
  const metadata = { suite: 'ts-sdk', file: 'sandbox', run: RUN_ID }
  const timeoutMs = 240_000
  let sbx

  before(async () => {
    sbx = tracked(await Sandbox.create({ metadata, timeoutMs }))
  })
  after(killTracked)

  test('create() uses the base template and keeps metadata and timeoutMs (getInfo)', async () => {
    assert.match(sbx.sandboxId, /^\S+$/)
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.equal(info.templateId, 'base')
    assert.deepEqual(info.metadata, metadata)
    assert.equal(info.state, 'running')
    assert.ok(info.startedAt instanceof Date && info.endAt instanceof Date)
    const ttl = info.endAt.getTime() - info.startedAt.getTime()
    assert.ok(Math.abs(ttl - timeoutMs) < 5_000, `endAt - startedAt = ${ttl} ms, expected ~${timeoutMs}`)
    assert.ok(info.endAt.getTime() > Date.now() + timeoutMs - 60_000, `endAt ${info.endAt.toISOString()} too early`)
    assert.equal(await sbx.isRunning(), true)
    // the static form answers the same
    const same = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(same.sandboxId, sbx.sandboxId)
    assert.deepEqual(same.metadata, metadata)
    // and commands run in the guest, not on the host
    const uname = await sbx.commands.run('uname -r; . /etc/os-release; echo "$ID $VERSION_ID"')
    const [kernel, release] = uname.stdout.trim().split('\n')
    assert.notEqual(kernel, os.release())
    assert.equal(release, 'debian 12')
  })

  test('commands.run streams stdout and stderr through onStdout / onStderr', async () => {
    const out = []
    const err = []
    const res = await sbx.commands.run('for i in 1 2 3; do echo out$i; echo err$i >&2; done', {
      onStdout: (d) => out.push(d),
      onStderr: (d) => err.push(d),
    })
    assert.equal(res.exitCode, 0)
    assert.equal(res.stdout, 'out1\nout2\nout3\n')
    assert.equal(res.stderr, 'err1\nerr2\nerr3\n')
    assert.equal(out.join(''), res.stdout)
    assert.equal(err.join(''), res.stderr)

    // output arrives while the command still runs, not only at its end
    const seen = []
    const handle = await sbx.commands.run('echo first; sleep 6; echo second', {
      background: true,
      onStdout: (d) => seen.push(d),
    })
    await waitFor(() => seen.join('').includes('first\n'), { timeoutMs: 10_000, what: 'the first line' })
    assert.equal(handle.exitCode, undefined, 'the command should still be running')
    assert.ok(!seen.join('').includes('second'))
    const done = await handle.wait()
    assert.equal(done.exitCode, 0)
    assert.equal(done.stdout, 'first\nsecond\n')
    assert.equal(seen.join(''), 'first\nsecond\n')

    // envs and cwd reach the command
    const env = await sbx.commands.run('pwd; echo "$ONLY_HERE"; whoami', { cwd: '/tmp', envs: { ONLY_HERE: 'x1' } })
    assert.deepEqual(env.stdout.split('\n'), ['/tmp', 'x1', 'user', ''])
  })

  test('a failing command throws CommandExitError with its exit code and output', async () => {
    await assert.rejects(sbx.commands.run('echo partial; echo oops >&2; exit 7'), (e) => {
      assert.ok(e instanceof CommandExitError, `expected CommandExitError, got ${e}`)
      assert.equal(e.exitCode, 7)
      assert.equal(e.stdout, 'partial\n')
      assert.equal(e.stderr, 'oops\n')
      return true
    })
    await assert.rejects(sbx.commands.run('false'), (e) => e instanceof CommandExitError && e.exitCode === 1)
    const ok = await sbx.commands.run('true')
    assert.equal(ok.exitCode, 0)
  })

  test('a background command is listed, killed, and then gone', async () => {
    const handle = await sbx.commands.run('sleep 300', { background: true })
    assert.ok(Number.isInteger(handle.pid) && handle.pid > 0)
    const listed = await sbx.commands.list()
    const proc = listed.find((p) => p.pid === handle.pid)
    assert.ok(proc, `pid ${handle.pid} not in commands.list(): ${JSON.stringify(listed)}`)
    assert.equal(await sbx.commands.kill(handle.pid), true)
    await assert.rejects(handle.wait(), (e) => {
      assert.ok(e instanceof CommandExitError, `expected CommandExitError, got ${e}`)
      assert.equal(e.exitCode, -1)
      assert.equal(e.error, 'signal: killed')
      return true
    })
    await waitFor(async () => !(await sbx.commands.list()).some((p) => p.pid === handle.pid), {
      timeoutMs: 10_000,
      what: 'the killed command to leave commands.list()',
    })
    assert.equal(await sbx.commands.kill(handle.pid), false)

    // the handle's own kill() does the same
    const other = await sbx.commands.run('sleep 300', { background: true })
    assert.equal(await other.kill(), true)
    await assert.rejects(other.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1)
  })

  test('PTY: create, sendInput, resize', async () => {
    const decoder = new TextDecoder()
    let text = ''
    const pty = await sbx.pty.create({
      cols: 80,
      rows: 24,
      timeoutMs: 60_000,
      onData: (d) => {
        text += decoder.decode(d, { stream: true })
      },
    })
    try {
      assert.ok(pty.pid > 0)
      const send = (s) => sbx.pty.sendInput(pty.pid, encode(s))
      // computed by the shell, so the marker proves the input ran (not just an echo of it)
      await send('echo PTY_$((6 * 7))_OK; [ -t 0 ] && echo IS_A_TTY_$((1 + 1))\n')
      await waitFor(() => text.includes('PTY_42_OK'), { what: `PTY_42_OK in the PTY output: ${JSON.stringify(text)}` })
      await waitFor(() => text.includes('IS_A_TTY_2'), { what: 'IS_A_TTY_2 in the PTY output' })
      await send("stty size | sed 's/^/SIZE=/'\n")
      await waitFor(() => /SIZE=24 80/.test(text), { what: `SIZE=24 80 in ${JSON.stringify(text.slice(-300))}` })
      await sbx.pty.resize(pty.pid, { cols: 120, rows: 40 })
      await send("stty size | sed 's/^/SIZE=/'\n")
      await waitFor(() => /SIZE=40 120/.test(text), { what: `SIZE=40 120 in ${JSON.stringify(text.slice(-300))}` })
      await send('exit 0\n')
      const res = await pty.wait()
      assert.equal(res.exitCode, 0)
    } finally {
      if (pty.exitCode === undefined) await sbx.pty.kill(pty.pid).catch(() => {})
    }
  })

  test('files: makeDir, write, read, list, getInfo, rename, remove, exists', async () => {
    const dir = `/home/user/ts-files-${RUN_ID}`
    assert.equal(await sbx.files.exists(dir), false)
    assert.equal(await sbx.files.makeDir(dir), true)
    assert.equal(await sbx.files.makeDir(dir), false)
    assert.equal(await sbx.files.makeDir(`${dir}/sub/deeper`), true)
    assert.equal(await sbx.files.exists(`${dir}/sub/deeper`), true)

    const written = await sbx.files.write(`${dir}/a.txt`, 'hello from ts')
    assert.equal(written.path, `${dir}/a.txt`)
    assert.equal(written.name, 'a.txt')
    assert.equal(await sbx.files.read(`${dir}/a.txt`), 'hello from ts')
    const bytes = new Uint8Array([0, 1, 2, 254, 255])
    await sbx.files.write(`${dir}/b.bin`, bytes.buffer)
    const readBack = await sbx.files.read(`${dir}/b.bin`, { format: 'bytes' })
    assert.ok(readBack instanceof Uint8Array)
    assert.deepEqual(Array.from(readBack), Array.from(bytes))
    // the guest sees the same file
    assert.equal((await sbx.commands.run(`cat ${dir}/a.txt`)).stdout, 'hello from ts')

    const entries = await sbx.files.list(dir)
    const byName = Object.fromEntries(entries.map((e) => [e.name, e]))
    assert.deepEqual(Object.keys(byName).sort(), ['a.txt', 'b.bin', 'sub'])
    assert.equal(byName['a.txt'].type, FileType.FILE)
    assert.equal(byName['a.txt'].size, 13)
    assert.equal(byName['a.txt'].path, `${dir}/a.txt`)
    assert.equal(byName['b.bin'].size, 5)
    assert.equal(byName.sub.type, FileType.DIR)
    const info = await sbx.files.getInfo(`${dir}/a.txt`)
    assert.equal(info.size, 13)
    assert.equal(info.owner, 'user')

    const renamed = await sbx.files.rename(`${dir}/a.txt`, `${dir}/c.txt`)
    assert.equal(renamed.path, `${dir}/c.txt`)
    assert.equal(renamed.name, 'c.txt')
    assert.equal(await sbx.files.exists(`${dir}/a.txt`), false)
    assert.equal(await sbx.files.read(`${dir}/c.txt`), 'hello from ts')

    await sbx.files.remove(`${dir}/c.txt`)
    assert.equal(await sbx.files.exists(`${dir}/c.txt`), false)
    await assert.rejects(sbx.files.read(`${dir}/c.txt`), FileNotFoundError)
    await sbx.files.remove(dir)
    assert.equal(await sbx.files.exists(dir), false)
  })

  test('files.watchDir sees a written file and a file a command creates', async () => {
    const dir = `/home/user/ts-watch-${RUN_ID}`
    await sbx.files.makeDir(dir)
    const events = []
    const handle = await sbx.files.watchDir(dir, (e) => events.push(e), { timeoutMs: 60_000 })
    try {
      await sbx.files.write(`${dir}/seen.txt`, 'x')
      await waitFor(
        () => events.some((e) => e.name === 'seen.txt' &&
          [FilesystemEventType.CREATE, FilesystemEventType.WRITE].includes(e.type)),
        { what: `a create/write event for seen.txt (got ${JSON.stringify(events)})` },
      )
      await sbx.commands.run(`touch ${dir}/by-command`)
      await waitFor(
        () => events.some((e) => e.name === 'by-command' && e.type === FilesystemEventType.CREATE),
        { what: `a create event for by-command (got ${JSON.stringify(events)})` },
      )
      await sbx.files.remove(`${dir}/seen.txt`)
      await waitFor(
        () => events.some((e) => e.name === 'seen.txt' && e.type === FilesystemEventType.REMOVE),
        { what: `a remove event for seen.txt (got ${JSON.stringify(events)})` },
      )
    } finally {
      await handle.stop()
    }
  })

  test('downloadUrl / uploadUrl: signed URLs a plain fetch uses behind E2B_SANDBOX_URL', async () => {
    const path = `/home/user/ts-url-${RUN_ID}.txt`
    await sbx.files.write(path, 'fetched by url')
    const url = await sbx.downloadUrl(path)
    assert.ok(url.startsWith(`${process.env.E2B_SANDBOX_URL}/files?`), url)
    assert.ok(!url.includes(sbx.sandboxId), 'the URL names no sandbox: its signature does')
    const got = await fetch(url)
    assert.equal(got.status, 200)
    assert.equal(await got.text(), 'fetched by url')

    const upPath = `/home/user/ts-upload-${RUN_ID}.txt`
    const form = new FormData()
    form.append('file', new Blob(['uploaded by url']), 'x.txt')
    const up = await fetch(await sbx.uploadUrl(upPath, { useSignatureExpiration: 60 }), { method: 'POST', body: form })
    assert.equal(up.status, 200, await up.clone().text())
    assert.equal((await up.json())[0].path, upPath)
    assert.equal(await sbx.files.read(upPath), 'uploaded by url')

    const expired = await fetch(await sbx.downloadUrl(path, { useSignatureExpiration: -10 }))
    assert.equal(expired.status, 401)
    assert.deepEqual(await expired.json(), { code: 401, message: 'signature is already expired' })
    const forged = await fetch(url.replace('signature=v1_', 'signature=v1_X'))
    assert.equal(forged.status, 401)
    assert.deepEqual(await forged.json(), { code: 401, message: 'invalid signature' })
  })

  test('getHost + a request to a user port through the data plane', async () => {
    await sbx.files.write('/tmp/ts-www/hello.txt', 'hello from a guest port')
    await sbx.commands.run('cd /tmp/ts-www && python3 -m http.server 8080 >/dev/null 2>&1', { background: true })
    const host = sbx.getHost(8080)
    assert.equal(host, `8080-${sbx.sandboxId}.${sbx.sandboxDomain ?? 'localhost'}`)
    // what an ingress for *.<domain> does: the data plane routes by that Host
    const plane = new URL(process.env.E2B_SANDBOX_URL)
    const get = () => new Promise((resolve, reject) => {
      const req = http.get({ host: plane.hostname, port: plane.port, path: '/hello.txt', headers: { Host: host } },
        (res) => {
          let body = ''
          res.setEncoding('utf8')
          res.on('data', (d) => { body += d })
          res.on('end', () => resolve({ status: res.statusCode, body }))
        })
      req.on('error', reject)
    })
    const res = await waitFor(async () => {
      const r = await get()
      return r.status === 200 && r
    }, { timeoutMs: 30_000, what: 'the guest HTTP server on port 8080' })
    assert.equal(res.body, 'hello from a guest port')
  })

  test('getMetrics returns the guest\'s own figures', async () => {
    const metrics = await waitFor(async () => {
      const found = await sbx.getMetrics()
      return found.length > 0 && found
    }, { timeoutMs: 60_000, intervalMs: 1_000, what: 'a metrics sample' })
    const m = metrics[metrics.length - 1]
    assert.ok(m.timestamp instanceof Date && !Number.isNaN(m.timestamp.getTime()))
    assert.equal(m.cpuCount, 2)
    assert.ok(m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100, `cpuUsedPct ${m.cpuUsedPct}`)
    assert.ok(m.memTotal > 256 * 2 ** 20 && m.memUsed > 0 && m.memUsed < m.memTotal, JSON.stringify(m))
    assert.ok(m.diskTotal > 0 && m.diskUsed > 0 && m.diskUsed < m.diskTotal, JSON.stringify(m))
    const same = await Sandbox.getMetrics(sbx.sandboxId)
    assert.ok(same.length >= metrics.length)
    // a window before the sandbox existed holds nothing
    const before = await sbx.getMetrics({ start: new Date(Date.now() - 3_600_000), end: new Date(Date.now() - 3_000_000) })
    assert.deepEqual(before, [])
  })

  test('setTimeout moves endAt (instance and static, longer and shorter)', async () => {
    const before = await sbx.getInfo()
    await sbx.setTimeout(600_000)
    const longer = await sbx.getInfo()
    const expected = Date.now() + 600_000
    assert.ok(Math.abs(longer.endAt.getTime() - expected) < 15_000,
      `endAt ${longer.endAt.toISOString()}, expected ~${new Date(expected).toISOString()}`)
    assert.ok(longer.endAt.getTime() - before.endAt.getTime() > 300_000,
      `endAt moved only from ${before.endAt.toISOString()} to ${longer.endAt.toISOString()}`)

    await Sandbox.setTimeout(sbx.sandboxId, 400_000)
    const shorter = await Sandbox.getInfo(sbx.sandboxId)
    const expectedShort = Date.now() + 400_000
    assert.ok(Math.abs(shorter.endAt.getTime() - expectedShort) < 15_000,
      `endAt ${shorter.endAt.toISOString()}, expected ~${new Date(expectedShort).toISOString()}`)
    assert.equal(shorter.state, 'running')
  })
})
