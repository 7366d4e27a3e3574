// SDK checks for gateway features landing now (issue 22). Each feature is one check named below;
// a failing feature fails the run only once its name is in REQUIRED (or in $KEEL_SDK_REQUIRE,
// comma-separated, or "all"), so the lead enables each as it lands. Run by run.sh.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { env, models, upstreamModels, REPLY, check, finish, rejectsWith, countingFetch, assert } from './lib.mjs';

// Features that must pass. Add a name when its feature lands.
const REQUIRED = new Set(['stream-upstream-error', 'stream-fallback', 'models-retrieve', 'count-tokens', 'request-id',
  'budget-429-no-retry', 'responses', 'oversize-413']);

const openai = new OpenAI({ apiKey: env.key, baseURL: `${env.gateway}/v1`, maxRetries: 0, timeout: 20000 });
const anthropic = new Anthropic({ apiKey: env.key, baseURL: env.gateway, maxRetries: 0, timeout: 20000 });
const say = [{ role: 'user', content: 'say hello' }];

const features = {
  // A streamed request whose only upstream answers 429 gets the 429 in the client's format (the
  // SDK's RateLimitError), not a 504 or a broken stream.
  'stream-upstream-error': async () => {
    await rejectsWith(openai.chat.completions.create({ model: models.only429, messages: say, stream: true }), OpenAI.RateLimitError, 429);
    await rejectsWith(anthropic.messages.create({ model: models.only429, max_tokens: 64, messages: say, stream: true }),
      Anthropic.RateLimitError, 429);
    const e = await rejectsWith(anthropic.messages.stream({ model: models.only429, max_tokens: 64, messages: say }).finalMessage(),
      Anthropic.RateLimitError, 429);
    assert.equal(e.error?.error?.type, 'rate_limit_error', JSON.stringify(e.error));
  },

  // A streamed request whose first target answers 429 falls back to the next one.
  'stream-fallback': async () => {
    let text = '';
    for await (const c of await openai.chat.completions.create({ model: models.fallback, messages: say, stream: true })) {
      text += c.choices[0]?.delta?.content ?? '';
    }
    assert.equal(text, REPLY);
    const m = await anthropic.messages.stream({ model: models.fallback, max_tokens: 256, messages: say }).finalMessage();
    assert.equal(m.content[0].text, REPLY);
  },

  // GET /v1/models/{id} (OpenAI shape), and Anthropic-shaped GET /v1/models items.
  'models-retrieve': async () => {
    const m = await openai.models.retrieve(models.openai);
    assert.equal(m.id, models.openai);
    assert.equal(m.object, 'model');
    await rejectsWith(openai.models.retrieve('no-such-model'), OpenAI.NotFoundError, 404);
    const ids = [];
    for await (const item of anthropic.models.list()) {
      assert.equal(item.type, 'model', JSON.stringify(item));
      assert.equal(typeof item.display_name, 'string', JSON.stringify(item));
      assert.ok(!Number.isNaN(Date.parse(item.created_at)), JSON.stringify(item));
      ids.push(item.id);
    }
    for (const model of upstreamModels) assert.ok(ids.includes(model), `${model} not in ${ids.join(', ')}`);
    const one = await anthropic.models.retrieve(models.anthropic);
    assert.equal(one.id, models.anthropic);
  },

  // POST /v1/messages/count_tokens.
  'count-tokens': async () => {
    const short = await anthropic.messages.countTokens({ model: models.anthropic, messages: [{ role: 'user', content: 'hi' }] });
    const long = await anthropic.messages.countTokens({ model: models.anthropic, system: 'be brief', messages: [{ role: 'user', content: 'hi '.repeat(200) }] });
    assert.ok(short.input_tokens > 0, JSON.stringify(short));
    assert.ok(long.input_tokens > short.input_tokens, `${long.input_tokens} <= ${short.input_tokens}`);
  },

  // The request ids SDKs read: Anthropic's request-id, OpenAI's x-request-id, on answers and errors.
  'request-id': async () => {
    const { data, request_id: rid } = await anthropic.messages.create({ model: models.anthropic, max_tokens: 64, messages: say }).withResponse();
    assert.ok(rid, 'no request-id header on an Anthropic answer');
    assert.equal(data._request_id, rid);
    const e = await rejectsWith(anthropic.messages.create({ model: 'no-such-model', max_tokens: 16, messages: say }), Anthropic.NotFoundError, 404);
    assert.ok(e.requestID, 'no request-id header on an Anthropic error');
    const c = await openai.chat.completions.create({ model: models.openai, messages: say });
    assert.ok(c._request_id, 'no x-request-id header on an OpenAI answer');
  },

  // An exhausted budget: 429 with retry-after and x-should-retry: false, so SDKs with their default
  // retries (2) send the request once.
  'budget-429-no-retry': async () => {
    const oc = countingFetch();
    const o = new OpenAI({ apiKey: env.budgetKey, baseURL: `${env.gateway}/v1`, fetch: oc.fetch, timeout: 20000 });
    const oe = await rejectsWith(o.chat.completions.create({ model: models.openai, messages: say, max_tokens: 64 }), OpenAI.RateLimitError, 429);
    assert.ok(oe.headers?.get('retry-after'), 'no retry-after header');
    assert.equal(oe.headers?.get('x-should-retry'), 'false');
    assert.equal(oc.calls, 1, `the OpenAI SDK sent the request ${oc.calls} times`);
    const ac = countingFetch();
    const a = new Anthropic({ apiKey: env.budgetKey, baseURL: env.gateway, fetch: ac.fetch, timeout: 20000 });
    await rejectsWith(a.messages.create({ model: models.anthropic, max_tokens: 64, messages: say }), Anthropic.RateLimitError, 429);
    assert.equal(ac.calls, 1, `the Anthropic SDK sent the request ${ac.calls} times`);
  },

  // POST /v1/responses (the Responses API), plain and streamed, through every upstream.
  'responses': async () => {
    for (const model of upstreamModels) {
      const r = await openai.responses.create({ model, input: 'say hello', instructions: 'be brief' });
      assert.equal(r.object, 'response');
      assert.equal(r.status, 'completed', model);
      assert.equal(r.output_text, REPLY, model);
      assert.ok(r.usage.input_tokens > 0 && r.usage.output_tokens > 0, JSON.stringify(r.usage));
      let text = '';
      let completed = null;
      for await (const ev of await openai.responses.create({ model, input: 'say hello', stream: true })) {
        if (ev.type === 'response.output_text.delta') text += ev.delta;
        if (ev.type === 'response.completed') completed = ev.response;
      }
      assert.equal(text, REPLY, model);
      const finalText = (completed?.output ?? []).filter((o) => o.type === 'message').flatMap((o) => o.content)
        .filter((c) => c.type === 'output_text').map((c) => c.text).join('');
      assert.equal(finalText, REPLY, `${model}: response.completed`);
    }
    const tool = { type: 'function', name: 'get_weather', parameters: { type: 'object', properties: {} } };
    const t = await openai.responses.create({ model: models.openaiTools, input: 'weather?', tools: [tool] });
    const call = t.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(t.output));
    assert.equal(call.name, 'get_weather');
    assert.deepEqual(JSON.parse(call.arguments), { x: 1 });
  },

  // A body over listen.max_body_bytes (1 MiB in run.sh) is a 413 the SDK can read, not a reset
  // connection while it is still uploading.
  'oversize-413': async () => {
    const big = 'x'.repeat(4 << 20);
    const e = await rejectsWith(openai.chat.completions.create({ model: models.openai, messages: [{ role: 'user', content: big }] }),
      OpenAI.APIError, 413);
    assert.ok(!(e instanceof OpenAI.APIConnectionError));
    await rejectsWith(anthropic.messages.create({ model: models.anthropic, max_tokens: 16, messages: [{ role: 'user', content: big }] }),
      Anthropic.APIError, 413);
  },
};

const required = new Set(REQUIRED);
for (const name of (process.env.KEEL_SDK_REQUIRE || '').split(',').filter(Boolean)) {
  if (name === 'all') Object.keys(features).forEach((n) => required.add(n));
  else required.add(name);
}
for (const [name, fn] of Object.entries(features)) await check(name, fn);
const results = finish('pending');
let failedRequired = 0;
for (const r of results) {
  const req = required.has(r.name);
  if (!r.ok && req) failedRequired += 1;
  const note = r.ok ? (req ? 'passes (required)' : 'passes: can be added to REQUIRED') : (req ? 'FAILS (required)' : 'not yet (pending)');
  console.log(`  ${r.name.padEnd(22)} ${note}`);
}
process.exitCode = failedRequired ? 1 : 0;
