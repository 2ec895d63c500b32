// Template builds with the TypeScript SDK against aenv's builder (real VMs): a template
// from the OCI image that tests/integration/test_ts_sdk.py pushed to a local registry
// (AENV_TEST_IMAGE) with COPY (uploaded in parallel by this SDK), RUN, ENV, WORKDIR and a
// start command; a sandbox of it; a cached rebuild; buildInBackground + getBuildStatus; a
// failing RUN; tags; delete. Several builds of about a minute each under TCG.
import { after, before, describe, test } from 'node:test'
import assert from 'node:assert/strict'
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import http from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

import {
  BuildError,
  RUN_ID,
  Sandbox,
  Template,
  api,
  killTracked,
  sleep,
  tracked,
  waitForPort,
} from './helpers.mjs'

const IMAGE = process.env.AENV_TEST_IMAGE
const GREETING = 'hello from the ts template'
const PAGE = '<h1>built by aenv for the TypeScript SDK</h1>\n'

/** The template under test; `then` adds one more RUN before the start command. */
function definition(context, then = '') {
  let t = Template({ fileContextPath: context })
    .fromImage(IMAGE)
    .copy('www/', '/srv/www')
    .copy('ts-tool.sh', '/usr/local/bin/', { user: 'root', mode: 0o755 })
    .runCmd('echo ts-built-as-$(whoami) > /home/user/ts-built.txt')
    .setEnvs({ TS_GREETING: GREETING, TS_HOME: '/srv/www' })
    .runCmd(`test "$TS_GREETING" = "${GREETING}"`)
    .setWorkdir('/srv/www')
  if (then) t = t.runCmd(then)
  return t.setStartCmd('python3 -m http.server 8000', waitForPort(8000))
}

/** Template.build collecting every log line the callback receives. */
async function build(template, name, opts = {}) {
  const lines = []
  const started = Date.now()
  const info = await Template.build(template, name, { ...opts, onBuildLogs: (e) => lines.push(e.message) })
  return { info, lines, ms: Date.now() - started }
}

/** GET through the data plane the way a browser reaches sbx.getHost(port): by Host. */
function getByHost(host, path) {
  const base = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = http.get({ hostname: base.hostname, port: base.port, path, headers: { Host: host }, timeout: 30_000 },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (d) => { body += d })
        res.on('end', () => resolve({ status: res.statusCode, body }))
      })
    req.on('timeout', () => req.destroy(new Error(`GET ${path} (Host ${host}) timed out`)))
    req.on('error', reject)
  })
}

describe('template builds', { timeout: 1_500_000, skip: !IMAGE && 'AENV_TEST_IMAGE (a registry image) is not set' },
  () => {
    const name = `ts-tpl-${RUN_ID}`
    const bgName = `${name}-bg`
    const templateIds = new Set()
    let context
    let first
    let second

    before(() => {
      context = mkdtempSync(join(tmpdir(), 'aenv-ts-template-'))
      mkdirSync(join(context, 'www', 'nested'), { recursive: true })
      writeFileSync(join(context, 'www', 'index.html'), PAGE)
      writeFileSync(join(context, 'www', 'nested', 'deep.txt'), 'deep from ts\n')
      writeFileSync(join(context, 'ts-tool.sh'), '#!/bin/sh\necho ts-tool-ran\n')
    })
    after(async () => {
      await killTracked()
      for (const id of templateIds) { // whatever the tests did: no template outlives the run
        const res = await api(`/templates/${encodeURIComponent(id)}`, { method: 'DELETE' })
        if (res.status !== 204 && res.status !== 404) console.error(`cleanup: DELETE ${id} -> ${res.status}`)
      }
      if (context) rmSync(context, { recursive: true, force: true })
    })

    test('Template.build: COPY, RUN, ENV, WORKDIR and a start command; exists', async () => {
      assert.equal(await Template.exists(name), false)
      first = await build(definition(context), name, { cpuCount: 2, memoryMB: 1024 })
      templateIds.add(first.info.templateId)
      const { info, lines } = first
      assert.equal(info.name, name)
      assert.deepEqual(info.tags, ['default'])
      assert.match(info.buildId, /^[0-9a-f-]{36}$/)
      // the SDK's own lines: both COPY sources uploaded (in parallel), then the server's
      assert.ok(lines.includes("Uploaded 'www/'") && lines.includes("Uploaded 'ts-tool.sh'"), lines.join('\n'))
      assert.ok(lines.some((l) => l.startsWith(`[base] FROM ${IMAGE}`)), lines.join('\n'))
      assert.ok(lines.some((l) => l.includes('[builder 1/')), lines.join('\n'))
      assert.ok(lines.includes('Template is ready'), lines.join('\n'))
      assert.deepEqual(lines.filter((l) => l.startsWith('CACHED')), [])
      assert.equal(await Template.exists(name), true)
      assert.equal(await Template.exists(`${name}:default`), true)
      assert.equal(await Template.exists(`${name}:nope`), false)
    })

    test('Sandbox.create(name): files, workdir, env, user and the start command\'s server', async () => {
      assert.ok(first, 'the first build did not complete')
      const sbx = tracked(await Sandbox.create(name, { timeoutMs: 300_000 }))
      assert.equal((await sbx.commands.run('pwd')).stdout.trim(), '/srv/www')
      assert.equal((await sbx.commands.run('whoami')).stdout.trim(), 'user')
      assert.equal((await sbx.commands.run('echo "$TS_GREETING|$TS_HOME"')).stdout.trim(), `${GREETING}|/srv/www`)
      assert.equal((await sbx.commands.run('cat /home/user/ts-built.txt')).stdout.trim(), 'ts-built-as-user')
      assert.equal(await sbx.files.read('/srv/www/index.html'), PAGE)
      assert.equal(await sbx.files.read('/srv/www/nested/deep.txt'), 'deep from ts\n')
      assert.deepEqual((await sbx.commands.run("stat -c '%U %a' /usr/local/bin/ts-tool.sh && ts-tool.sh"))
        .stdout.split(/\s+/).filter(Boolean), ['root', '755', 'ts-tool-ran'])
      assert.equal((await sbx.commands.run('stat -c %U /srv/www/index.html')).stdout.trim(), 'user')
      // the start command was running in the template's snapshot: nothing started it here
      assert.match((await sbx.commands.run('ps -eo args')).stdout, /http\.server 8000/)

      const host = sbx.getHost(8000)
      assert.ok(host.startsWith(`8000-${sbx.sandboxId}.`), host)
      const byHost = await getByHost(host, '/index.html')
      assert.equal(byHost.status, 200)
      assert.equal(byHost.body, PAGE)
      const byHeaders = await fetch(new URL('/nested/deep.txt', process.env.E2B_SANDBOX_URL), {
        headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '8000' },
      })
      assert.equal(byHeaders.status, 200)
      assert.equal(await byHeaders.text(), 'deep from ts\n')
      assert.equal(await sbx.kill(), true)
    })

    test('a second build of the same template reuses every step (CACHED) and no upload', async () => {
      assert.ok(first, 'the first build did not complete')
      second = await build(definition(context), name)
      const { info, lines } = second
      assert.equal(info.templateId, first.info.templateId)
      assert.notEqual(info.buildId, first.info.buildId)
      assert.ok(lines.includes("Skipping upload of 'www/', already cached"), lines.join('\n'))
      assert.ok(lines.includes("Skipping upload of 'ts-tool.sh', already cached"), lines.join('\n'))
      const cached = lines.filter((l) => l.startsWith('CACHED [builder'))
      assert.equal(cached.length, 6, lines.join('\n'))
      assert.ok(cached[5].startsWith('CACHED [builder 6/6] WORKDIR'), cached.join('\n'))
      // nothing changed: the template snapshot of the first build serves again, no VM boots
      assert.ok(lines.some((l) => l.startsWith('CACHED [finalize] template snapshot')), lines.join('\n'))
      assert.ok(second.ms < first.ms, `rebuild ${second.ms} ms, first build ${first.ms} ms`)
    })

    test('a failing RUN rejects with a BuildError (exit status 3); the ready build stays in service', async () => {
      assert.ok(second, 'the second build did not complete')
      const broken = definition(context, 'echo ts about to fail >&2; exit 3')
      await assert.rejects(build(broken, name), (err) => {
        assert.ok(err instanceof BuildError, `${err?.name}: ${err?.message}`)
        assert.match(err.message, /exit status 3/)
        assert.match(err.message, /ts about to fail/)
        return true
      })
      const still = tracked(await Sandbox.create(name, { timeoutMs: 120_000 }))
      assert.equal((await still.commands.run('cat /home/user/ts-built.txt')).stdout.trim(), 'ts-built-as-user')
      assert.equal(await still.kill(), true)
    })

    test('buildInBackground + getBuildStatus: building, then ready, logs paged by logsOffset', async () => {
      const bg = Template().skipCache().fromImage(IMAGE).runCmd('sleep 5 && echo ts-background-done')
      const info = await Template.buildInBackground(bg, bgName, { cpuCount: 1, memoryMB: 512 })
      templateIds.add(info.templateId)
      assert.equal(info.name, bgName)
      const right = await Template.getBuildStatus(info)
      assert.equal(right.status, 'building')
      assert.equal(right.buildID, info.buildId)
      assert.equal(right.templateID, info.templateId)

      const messages = [...right.logEntries.map((e) => e.message)]
      let offset = right.logEntries.length
      let status = right.status
      const end = Date.now() + 900_000
      while (status === 'building' || status === 'waiting') {
        assert.ok(Date.now() < end, `the background build is still ${status}`)
        await sleep(1_000)
        const page = await Template.getBuildStatus(info, { logsOffset: offset })
        for (const e of page.logEntries) {
          assert.ok(e.timestamp instanceof Date && !Number.isNaN(e.timestamp.getTime()))
          messages.push(e.message)
        }
        offset += page.logEntries.length
        status = page.status
      }
      assert.equal(status, 'ready', messages.join('\n'))
      // the rest after ready, then nothing more: every entry seen exactly once, in order
      for (let page; (page = await Template.getBuildStatus(info, { logsOffset: offset })).logEntries.length;) {
        messages.push(...page.logEntries.map((e) => e.message))
        offset += page.logEntries.length
      }
      const all = await Template.getBuildStatus(info, { logsOffset: 0 })
      assert.deepEqual(all.logEntries.map((e) => e.message), messages.slice(0, all.logEntries.length))
      assert.ok(messages.some((m) => m.includes('ts-background-done')), messages.join('\n'))
      assert.ok(messages.some((m) => m.startsWith('[finalize]')), messages.join('\n'))
      assert.deepEqual(messages.filter((m) => m.startsWith('CACHED')), [])
      assert.equal(await Template.exists(bgName), true)
    })

    test('tags: assignTags moves a tag to the newest ready build, getTags lists, removeTags removes', async () => {
      assert.ok(second, 'the second build did not complete')
      const assigned = await Template.assignTags(`${name}:default`, ['prod', 'stable'])
      assert.equal(assigned.buildId, second.info.buildId) // the failed third build is not ready
      assert.deepEqual([...assigned.tags].sort(), ['prod', 'stable'])
      const listed = await Template.getTags(name)
      const byTag = Object.fromEntries(listed.map((t) => [t.tag, t]))
      assert.deepEqual(Object.keys(byTag).sort(), ['default', 'prod', 'stable'])
      assert.equal(byTag.prod.buildId, second.info.buildId)
      assert.ok(byTag.prod.createdAt instanceof Date && !Number.isNaN(byTag.prod.createdAt.getTime()))
      assert.equal(await Template.exists(`${name}:prod`), true)

      await Template.removeTags(name, 'prod')
      assert.deepEqual((await Template.getTags(name)).map((t) => t.tag).sort(), ['default', 'stable'])
      assert.equal(await Template.exists(`${name}:prod`), false)
      await assert.rejects(Sandbox.create(`${name}:prod`), /prod/)
      await assert.rejects(Template.removeTags(name, 'default'))
      await assert.rejects(Template.assignTags(`${name}:default`, 'not a tag!'))
    })

    test('DELETE /templates/{id} removes the templates', async () => {
      assert.ok(templateIds.size >= 1, 'no template was built')
      for (const id of [...templateIds]) {
        const res = await api(`/templates/${encodeURIComponent(id)}`, { method: 'DELETE' })
        assert.equal(res.status, 204, `DELETE /templates/${id}: ${res.status} ${await res.text()}`)
        templateIds.delete(id)
      }
      assert.equal(await Template.exists(name), false)
      assert.equal(await Template.exists(bgName), false)
      const gone = await api(`/templates/${encodeURIComponent(first.info.templateId)}`)
      assert.equal(gone.status, 404)
    })
  })
