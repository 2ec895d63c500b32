// The TypeScript SDK's typed REST client (the exported ApiClient, whose `paths` include
// /teams, /teams/{teamID}/metrics and /metrics/max; E2B's CLI calls them through it), no VM:
// GET /teams with a person's access token (AENV_TEST_ACCESS_TOKEN) as E2B's CLI sends it, the
// team's key it hands out working in the SDK, and the team metrics with the API key
// (AENV_TEST_TEAM_ID). tests/unit/test_ts_sdk_api.py sets both.
import { describe, test } from 'node:test'
import assert from 'node:assert/strict'

import { ApiClient, ConnectionConfig, Sandbox } from '../helpers.mjs'

const TEAM_ID = process.env.AENV_TEST_TEAM_ID
const TOKEN = process.env.AENV_TEST_ACCESS_TOKEN

describe('teams and team metrics through ApiClient', { timeout: 60_000 }, () => {
  test('GET /teams with an access token', async () => {
    const config = new ConnectionConfig({ apiKey: '', headers: { Authorization: `Bearer ${TOKEN}` } })
    const client = new ApiClient(config, { requireApiKey: false })
    const res = await client.api.GET('/teams')
    assert.equal(res.response.status, 200, JSON.stringify(res.error))
    assert.deepEqual(res.data.map((t) => t.teamID), [TEAM_ID])
    assert.equal(res.data[0].isDefault, true)
    const sandboxes = await Sandbox.list({ apiKey: res.data[0].apiKey }).nextItems()
    assert.ok(Array.isArray(sandboxes))

    const anonymous = new ApiClient(new ConnectionConfig({ apiKey: '' }), { requireApiKey: false })
    assert.equal((await anonymous.api.GET('/teams')).response.status, 401)
  })

  test('GET /teams/{teamID}/metrics and /metrics/max with the API key', async () => {
    const client = new ApiClient(new ConnectionConfig())
    const end = Math.floor(Date.now() / 1000)
    const start = end - 3600
    const series = await client.api.GET('/teams/{teamID}/metrics', {
      params: { path: { teamID: TEAM_ID }, query: { start, end } },
    })
    assert.equal(series.response.status, 200, JSON.stringify(series.error))
    assert.ok(series.data.length > 0)
    for (const point of series.data) {
      assert.deepEqual(Object.keys(point).sort(),
        ['concurrentSandboxes', 'sandboxStartRate', 'timestamp', 'timestampUnix'])
    }
    assert.ok(series.data.some((p) => p.concurrentSandboxes >= 1), 'the sandbox the runner started counts')

    for (const metric of ['concurrent_sandboxes', 'sandbox_start_rate']) {
      const max = await client.api.GET('/teams/{teamID}/metrics/max', {
        params: { path: { teamID: TEAM_ID }, query: { metric, start, end } },
      })
      assert.equal(max.response.status, 200, JSON.stringify(max.error))
      assert.ok(max.data.value > 0, `${metric}: ${JSON.stringify(max.data)}`)
    }
    const other = await client.api.GET('/teams/{teamID}/metrics', {
      params: { path: { teamID: '00000000-0000-0000-0000-000000000000' } },
    })
    assert.equal(other.response.status, 403)
  })
})
