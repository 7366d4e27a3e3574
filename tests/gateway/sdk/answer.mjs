// The official `openai` npm client against `keel answer` (docs/answer.md), whose gateway is run.sh's
// `keel gateway` in front of the fake vendors: plain and streamed answers agree, the stream arrives
// token by token with usage and the `keel` member, errors before the stream are the SDK's error
// classes, and a stream the upstream cuts raises instead of ending quietly. Run by run.sh.
import OpenAI from 'openai';
import { env, models, check, finish, rejectsWith, assert } from './lib.mjs';

const answerUrl = process.env.KEEL_ANSWER_URL;
if (!answerUrl) {
  console.error('KEEL_ANSWER_URL is not set: run this script through tests/gateway/sdk/run.sh');
  process.exit(2);
}
const client = new OpenAI({ apiKey: env.key, baseURL: `${answerUrl}/v1`, maxRetries: 0, timeout: 20000 });
const ask = { model: models.openai, messages: [{ role: 'user', content: 'say hello' }], max_tokens: 12 };

await check('answer: chat.completions.create', async () => {
  const r = await client.chat.completions.create(ask);
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.ok(r.choices[0].message.content.length > 0);
  assert.equal(r.keel.state, 'builtin-full');
  assert.deepEqual(r.keel.retrieved, []); // no vector: nothing searched
});

await check('answer: streamed token by token, the same text, usage and keel', async () => {
  const whole = await client.chat.completions.create(ask);
  const stream = await client.chat.completions.create({ ...ask, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let contentChunks = 0;
  let finishReason = null;
  let usage = null;
  let keel = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    if (chunk.keel) keel = chunk.keel;
    for (const c of chunk.choices) {
      if (c.delta.content) {
        text += c.delta.content;
        contentChunks += 1;
      }
      if (c.finish_reason) finishReason = c.finish_reason;
    }
  }
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finishReason, whole.choices[0].finish_reason);
  assert.ok(contentChunks > 3, `only ${contentChunks} content chunks: not streamed token by token`);
  assert.deepEqual(usage, whole.usage);
  assert.equal(keel && keel.state, 'builtin-full');
});

await check('answer: errors before the stream are the SDK error classes', async () => {
  await rejectsWith(client.chat.completions.create({ ...ask, model: 'no-such-model', stream: true }), OpenAI.NotFoundError, 404);
  const bad = new OpenAI({ apiKey: 'sk-keel-not-a-key', baseURL: `${answerUrl}/v1`, maxRetries: 0 });
  await rejectsWith(bad.chat.completions.create({ ...ask, stream: true }), OpenAI.AuthenticationError, 401);
  const broke = new OpenAI({ apiKey: env.budgetKey, baseURL: `${answerUrl}/v1`, maxRetries: 0 });
  await rejectsWith(broke.chat.completions.create(ask), OpenAI.RateLimitError, 429);
  await rejectsWith(client.chat.completions.create({ ...ask, messages: [] }), OpenAI.BadRequestError, 400);
});

await check('answer: a stream the upstream cuts raises an APIError', async () => {
  const stream = await client.chat.completions.create({ ...ask, model: 'sdk-truncate', stream: true });
  let text = '';
  let error = null;
  try {
    for await (const chunk of stream) for (const c of chunk.choices) text += c.delta.content ?? '';
  } catch (e) {
    error = e;
  }
  assert.ok(error instanceof OpenAI.APIError, `a cut stream ended quietly with "${text}"`);
});

await check('answer: models.list and models.retrieve are the gateway\'s', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.ok(ids.includes(models.openai), `models.list: ${JSON.stringify(ids)}`);
  const one = await client.models.retrieve(models.openai);
  assert.equal(one.id, models.openai);
  await rejectsWith(client.models.retrieve('no-such-model'), OpenAI.NotFoundError, 404);
});

finish('answer');
