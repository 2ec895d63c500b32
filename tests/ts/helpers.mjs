// Shared helpers for the TypeScript SDK suite (run by tests/integration/test_ts_sdk.py).
//
// The official `e2b` npm package is not committed: scripts/setup_ts_sdk.sh installs it
// into var/node/e2b-ts/ (or $AENV_E2B_TS_DIR). ESM ignores NODE_PATH, so the SDK is
// imported by absolute path, resolved from that install folder's package.json.
import { createRequire } from 'node:module'
import { readFileSync } from 'node:fs'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath, pathToFileURL } from 'node:url'

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..')
const SDK_DIR = process.env.AENV_E2B_TS_DIR || join(ROOT, 'var', 'node', 'e2b-ts')

function sdkEntry() {
  const require = createRequire(join(SDK_DIR, 'package.json'))
  let manifestPath
  try {
    manifestPath = require.resolve('e2b/package.json')
  } catch (err) {
    throw new Error(`e2b is not installed under ${SDK_DIR} (run scripts/setup_ts_sdk.sh): ${err.message}`)
  }
  const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'))
  return {
    url: pathToFileURL(join(dirname(manifestPath), manifest.module || manifest.main)).href,
    version: manifest.version,
  }
}

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[name]) throw new Error(`${name} is not set: these tests run against a live aenv stack`)
}

const entry = sdkEntry()
const e2b = await import(entry.url)
export const SDK_VERSION = entry.version
export const {
  ALL_TRAFFIC,
  ApiClient,
  ConnectionConfig,
  E2B,
  Sandbox,
  Template,
  BuildError,
  waitForPort,
  CommandExitError,
  FileNotFoundError,
  FileType,
  FilesystemEventType,
  NotFoundError,
  SandboxError,
  SandboxNotFoundError,
  Secret,
  SecretNotFoundError,
  TimeoutError,
  Volume,
  VolumeError,
  VolumeFileType,
  VolumeNotFoundError,
  VolumePathNotFoundError,
} = e2b

/** A call to aenv's REST API with the suite's key (for what the SDK has no method for). */
export function api(path, init = {}) {
  const headers = { 'X-API-KEY': process.env.E2B_API_KEY, ...(init.headers || {}) }
  return fetch(new URL(path, process.env.E2B_API_URL), { ...init, headers })
}

/** Unique per test process: tags the sandboxes this run creates (metadata). */
export const RUN_ID = `${Date.now().toString(36)}-${process.pid}`

const created = new Map()

/** Remembers a sandbox so that `killTracked` kills it whatever the tests did. */
export function tracked(sbx) {
  created.set(sbx.sandboxId, sbx)
  return sbx
}

/** Kills every tracked sandbox (an `after` hook); a kill failure is reported, not thrown. */
export async function killTracked() {
  const all = [...created.values()]
  created.clear()
  const results = await Promise.allSettled(all.map((s) => Sandbox.kill(s.sandboxId)))
  results.forEach((r, i) => {
    if (r.status === 'rejected') console.error(`cleanup: kill ${all[i].sandboxId} failed: ${r.reason}`)
  })
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/** Polls `check` (sync or async) until it returns a truthy value; fails with `what` after `timeoutMs`. */
export async function waitFor(check, { timeoutMs = 20_000, intervalMs = 100, what = 'condition' } = {}) {
  const end = Date.now() + timeoutMs
  for (;;) {
    const value = await check()
    if (value) return value
    if (Date.now() > end) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`)
    await sleep(intervalMs)
  }
}

/** All pages of a Sandbox.list paginator. */
export async function listAll(opts) {
  const paginator = Sandbox.list(opts)
  const items = []
  while (paginator.hasNext) items.push(...(await paginator.nextItems()))
  return items
}

// A background process the lifecycle tests watch (no /proc reads): a shell loop in the
// guest that rewrites /home/user/counter.txt ("<pid> <n>") every 0.2 s, detached from envd.
// Its pid shows whether the process survived (pause, snapshot, fork); its count, that it runs.
const COUNTER = 'n=0; while :; do n=$((n+1)); echo "$$ $n" > /home/user/counter.tmp; ' +
  'mv /home/user/counter.tmp /home/user/counter.txt; sleep 0.2; done'

export async function readCounter(sbx) {
  const [pid, n] = (await sbx.files.read('/home/user/counter.txt')).trim().split(/\s+/).map(Number)
  return { pid, n }
}

export async function startCounter(sbx) {
  await sbx.commands.run(`setsid sh -c '${COUNTER}' >/dev/null 2>&1 </dev/null &`)
  await waitFor(() => sbx.files.exists('/home/user/counter.txt'), { timeoutMs: 30_000, what: 'counter.txt' })
  await waitFor(async () => (await readCounter(sbx)).n >= 3, { timeoutMs: 30_000, what: 'the counter to count' })
  return readCounter(sbx)
}
