// The TypeScript SDK's updateNetwork on a running sandbox another test made (no sandbox of its
// own): `node update_network.mjs <sandboxId> <step> <address>`, run by
// tests/integration/test_network_e2e.py, which then probes from the guest what the step allows.
//   allow-only: sbx.updateNetwork({ allowOut: [address], denyOut: ({ allTraffic }) => [allTraffic] })
//   closed:     Sandbox.updateNetwork(id, { allowInternetAccess: false })
// Prints the sandbox's `network` and `allowInternetAccess` after the update, as JSON.
import { Sandbox } from '../helpers.mjs'

const [sandboxId, step, address] = process.argv.slice(2)
const sbx = await Sandbox.connect(sandboxId)
if (step === 'allow-only') {
  await sbx.updateNetwork({ allowOut: [address], denyOut: ({ allTraffic }) => [allTraffic] })
} else if (step === 'closed') {
  await Sandbox.updateNetwork(sandboxId, { allowInternetAccess: false })
} else {
  throw new Error(`unknown step ${step}`)
}
const info = await sbx.getInfo()
console.log(JSON.stringify({ network: info.network ?? null, allowInternetAccess: info.allowInternetAccess ?? null }))
