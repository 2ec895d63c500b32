// The unchanged TypeScript SDK's network calls, no VM (tests/unit/test_ts_sdk_api.py serves the
// API with a mock node and runs this file): Sandbox.create with `network` (addresses, CIDRs and
// domain names in allowOut, the selector callbacks, `rules` as an object and as a Map with a
// static and a callback transform, allowPublicTraffic, maskRequestHost) and allowInternetAccess,
// getInfo's `network`, updateNetwork on the instance and the class, and what aenv refuses (400).
// Whether a guest obeys the policy is the VM tests'.
import { after, describe, test } from 'node:test'
import assert from 'node:assert/strict'

import { ALL_TRAFFIC, Sandbox, SandboxError, Secret, killTracked, tracked } from '../helpers.mjs'

const RULED = 'api.example.com'
const MARKER = Secret.fill('tok') // what the guest may see of a secret

describe('network options', { timeout: 60_000 }, () => {
  after(killTracked)

  test('create with every enforced option, read it back', async () => {
    const sbx = tracked(await Sandbox.create({
      allowInternetAccess: true,
      network: {
        allowOut: ['1.1.1.1', '10.1.0.0/16', RULED, '*.example.org'],
        denyOut: ({ allTraffic }) => [allTraffic],
        rules: {
          [RULED]: [{ transform: { headers: { Authorization: `Bearer ${MARKER}` } } }],
          '*.example.org': [{ transform: () => ({ headers: { 'X-From': 'callback' } }) }],
        },
        allowPublicTraffic: false,
        maskRequestHost: '${PORT}-masked.example',
      },
    }))
    assert.ok(sbx.trafficAccessToken, 'allowPublicTraffic: false gives the user ports a token')
    const info = await sbx.getInfo()
    assert.equal(info.allowInternetAccess, true)
    assert.deepEqual(info.network.allowOut, ['1.1.1.1', '10.1.0.0/16', RULED, '*.example.org'])
    assert.deepEqual(info.network.denyOut, [ALL_TRAFFIC])
    assert.deepEqual(info.network.rules, {
      [RULED]: [{ transform: { headers: { Authorization: `Bearer ${MARKER}` } } }],
      '*.example.org': [{ transform: { headers: { 'X-From': 'callback' } } }],
    })
    assert.equal(info.network.allowPublicTraffic, false)
    assert.equal(info.network.maskRequestHost, '${PORT}-masked.example')
    assert.equal(info.network.egressProxy, undefined)
    assert.equal(await sbx.kill(), true)
    assert.equal((await Sandbox.list({ query: { state: ['running'] } }).nextItems())
      .some((s) => s.sandboxId === sbx.sandboxId), false)
  })

  test('rules as a Map and allowOut from the rules callback', async () => {
    const rules = new Map([[RULED, [{ transform: { headers: { 'X-Key': MARKER } } }]]])
    const sbx = tracked(await Sandbox.create({
      network: { rules, allowOut: ({ rules: r }) => [...r.keys()], denyOut: [ALL_TRAFFIC] },
    }))
    const { network } = await Sandbox.getInfo(sbx.sandboxId)
    assert.deepEqual(network.allowOut, [RULED])
    assert.deepEqual(network.rules, { [RULED]: [{ transform: { headers: { 'X-Key': MARKER } } }] })
  })

  test('allowInternetAccess: false closes egress', async () => {
    const sbx = tracked(await Sandbox.create({ allowInternetAccess: false }))
    assert.equal((await sbx.getInfo()).allowInternetAccess, false)
  })

  test('updateNetwork on the instance and the class replaces the policy', async () => {
    const sbx = tracked(await Sandbox.create({ network: { denyOut: ['8.8.8.8'] } }))
    await sbx.updateNetwork({
      allowOut: [RULED], denyOut: ({ allTraffic }) => [allTraffic],
      rules: { [RULED]: [{ transform: { headers: { 'X-Key': MARKER } } }] },
    })
    let { network } = await sbx.getInfo()
    assert.deepEqual(network.allowOut, [RULED])
    assert.deepEqual(network.rules, { [RULED]: [{ transform: { headers: { 'X-Key': MARKER } } }] })

    await Sandbox.updateNetwork(sbx.sandboxId, { denyOut: ['7.7.7.0/24'] })
    ;({ network } = await sbx.getInfo())
    assert.deepEqual(network.denyOut, ['7.7.7.0/24'])
    assert.equal(network.allowOut, undefined)
    assert.equal(network.rules, undefined)

    await Sandbox.updateNetwork(sbx.sandboxId, { allowInternetAccess: false })
    assert.equal((await sbx.getInfo()).allowInternetAccess, false)
    await sbx.updateNetwork({})
    const info = await sbx.getInfo()
    assert.equal(info.network, undefined)
    assert.equal(info.allowInternetAccess, undefined)
  })

  test('what aenv refuses is a 400 with its reason', async () => {
    const refused = [
      [{ httpsPorts: [8443] }, /httpsPorts/],
      [{ denyOut: [RULED] }, /invalid denied CIDR/],
      [{ allowOut: ['1.1.1.1'], rules: { [RULED]: [{}] } }, /rules/],
    ]
    for (const [network, reason] of refused) {
      await assert.rejects(Sandbox.create({ network }), (err) => {
        assert.ok(err instanceof SandboxError, String(err))
        assert.match(err.message, reason)
        assert.equal(err.statusCode, 400)
        return true
      })
    }
    const sbx = tracked(await Sandbox.create())
    await assert.rejects(sbx.updateNetwork({ denyOut: [RULED] }), /invalid denied CIDR/)
  })
})
