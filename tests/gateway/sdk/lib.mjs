// Shared by the SDK conformance scripts: the environment run.sh sets up, and a tiny check runner
// (each check asserts with node:assert; a failure is printed with its name and the script exits 1).
import assert from 'node:assert/strict';

function need(name) {
  const v = process.env[name];
  if (!v) {
    console.error(`${name} is not set: run these scripts through tests/gateway/sdk/run.sh`);
    process.exit(2);
  }
  return v;
}

// What run.sh started: the gateway, a key with no budget limit, a key whose team budget is spent
// by any request, and the fake vendors behind the gateway (for /_fake/last_request).
export const env = {
  gateway: need('KEEL_GW_URL'), // http://127.0.0.1:PORT (no trailing slash)
  key: need('KEEL_GW_KEY'),
  budgetKey: need('KEEL_GW_BUDGET_KEY'),
  fakes: {
    openai: need('KEEL_FAKE_OPENAI_URL'),
    anthropic: need('KEEL_FAKE_ANTHROPIC_URL'),
    gemini: need('KEEL_FAKE_GEMINI_URL'),
  },
};

// Virtual models in run.sh's gateway config. The fakes answer "<the prompt's words> w2 w3 ..."
// (12 words), so "say hello" comes back as "say hello w2 ... w11".
export const models = {
  openai: 'sdk-openai', // -> fake OpenAI
  anthropic: 'sdk-anthropic', // -> fake Anthropic
  gemini: 'sdk-gemini', // -> fake Gemini
  openaiTools: 'sdk-openai-tools', // the fakes' "tools" switch: call the first tool with {"x":1}
  anthropicTools: 'sdk-anthropic-tools',
  geminiTools: 'sdk-gemini-tools',
  embeddings: 'sdk-embed', // -> fake OpenAI, 8 dimensions
  only429: 'sdk-only-429', // one target, which answers 429
  fallback: 'sdk-fallback', // a 429 target, then fake Anthropic
};
export const upstreamModels = [models.openai, models.anthropic, models.gemini];
export const REPLY = 'say hello w2 w3 w4 w5 w6 w7 w8 w9 w10 w11';

// The last request a fake vendor received (method, path, headers, raw body).
export async function lastUpstreamRequest(kind) {
  const res = await fetch(`${env.fakes[kind]}/_fake/last_request`);
  assert.equal(res.status, 200, `no request reached the ${kind} fake`);
  const j = await res.json();
  j.json = JSON.parse(j.body || 'null');
  return j;
}

const results = [];
const CHECK_TIMEOUT_MS = 30000;

// Runs one named check. A thrown error or a timeout is a failure; the run continues.
export async function check(name, fn) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${CHECK_TIMEOUT_MS} ms`)), CHECK_TIMEOUT_MS);
  });
  try {
    await Promise.race([fn(), timeout]);
    results.push({ name, ok: true });
    console.log(`ok   ${name}`);
  } catch (e) {
    results.push({ name, ok: false, error: e });
    console.log(`FAIL ${name}\n     ${String(e && e.stack ? e.stack : e).split('\n').slice(0, 6).join('\n     ')}`);
  } finally {
    clearTimeout(timer);
  }
}

// Prints the summary and sets the exit code: 1 if any check failed.
export function finish(suite) {
  const failed = results.filter((r) => !r.ok);
  console.log(`${suite}: ${results.length - failed.length} of ${results.length} checks passed` +
              (failed.length ? `; failed: ${failed.map((r) => r.name).join(', ')}` : ''));
  process.exitCode = failed.length ? 1 : 0;
  return results;
}

// Asserts that `promise` rejects with an instance of `cls` and the given HTTP status; returns the error.
export async function rejectsWith(promise, cls, status) {
  let error;
  try {
    await promise;
  } catch (e) {
    error = e;
  }
  assert.ok(error, `expected ${cls.name} (${status}), but the call succeeded`);
  assert.ok(error instanceof cls, `expected ${cls.name}, got ${error && error.constructor && error.constructor.name}: ${error && error.message}`);
  assert.equal(error.status, status, `status of ${cls.name}: ${error.message}`);
  return error;
}

// Fetch that counts the requests a client makes (to see whether an SDK retried).
export function countingFetch() {
  const counter = { calls: 0 };
  counter.fetch = (...args) => {
    counter.calls += 1;
    return fetch(...args);
  };
  return counter;
}

export { assert };
