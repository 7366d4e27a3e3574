// The official `@anthropic-ai/sdk` npm client against `keel gateway`: messages.create (plain,
// streamed, tools, stop_sequences, max_tokens, structured output) through every upstream format,
// and the SDK's error classes. The SDK sends its key as `Authorization: Bearer` and
// `anthropic-version: 2026-10-21`. Run by run.sh.
import Anthropic from '@anthropic-ai/sdk';
import { env, models, upstreamModels, REPLY, check, finish, rejectsWith, lastUpstreamRequest, assert } from './lib.mjs';

const client = new Anthropic({ apiKey: env.key, baseURL: env.gateway, maxRetries: 0, timeout: 20000 });
const say = [{ role: 'user', content: 'say hello' }];
const lookup = { name: 'lookup', description: 'looks things up', input_schema: { type: 'object', properties: { q: { type: 'string' } } } };

for (const model of upstreamModels) {
  await check(`messages.create via ${model}`, async () => {
    const m = await client.messages.create({ model, max_tokens: 256, system: 'be brief', messages: say });
    assert.equal(m.type, 'message');
    assert.equal(m.role, 'assistant');
    assert.equal(m.model, model);
    assert.ok(m.id.startsWith('msg_'), m.id);
    assert.equal(m.content.length, 1);
    assert.equal(m.content[0].type, 'text');
    assert.equal(m.content[0].text, REPLY);
    assert.equal(m.stop_reason, 'end_turn');
    assert.equal(m.stop_sequence, null);
    assert.ok(m.usage.input_tokens > 0 && m.usage.output_tokens > 0, JSON.stringify(m.usage));
  });

  await check(`messages.create stream via ${model}`, async () => {
    const stream = await client.messages.create({ model, max_tokens: 256, messages: say, stream: true });
    const types = [];
    let text = '';
    let stop = null;
    for await (const ev of stream) {
      types.push(ev.type);
      if (ev.type === 'content_block_delta' && ev.delta.type === 'text_delta') text += ev.delta.text;
      if (ev.type === 'message_delta') stop = ev.delta.stop_reason;
    }
    assert.equal(types[0], 'message_start');
    assert.equal(types[types.length - 1], 'message_stop');
    assert.ok(types.includes('content_block_start') && types.includes('content_block_stop') && types.includes('message_delta'),
      types.join(' '));
    assert.equal(text, REPLY);
    assert.equal(stop, 'end_turn');
  });

  await check(`messages.stream().finalMessage() via ${model}`, async () => {
    const deltas = [];
    const stream = client.messages.stream({ model, max_tokens: 256, messages: say }).on('text', (t) => deltas.push(t));
    const m = await stream.finalMessage();
    assert.equal(m.content[0].text, REPLY);
    assert.equal(deltas.join(''), REPLY);
    assert.ok(deltas.length > 3, `only ${deltas.length} text events: not streamed`);
    assert.ok(m.usage.output_tokens > 0);
  });
}

for (const model of [models.anthropicTools, models.openaiTools, models.geminiTools]) {
  await check(`tools via ${model}`, async () => {
    const m = await client.messages.create({ model, max_tokens: 256, tools: [lookup], messages: [{ role: 'user', content: 'look up x' }] });
    assert.equal(m.stop_reason, 'tool_use');
    const use = m.content.find((b) => b.type === 'tool_use');
    assert.ok(use, JSON.stringify(m.content));
    assert.equal(use.name, 'lookup');
    assert.deepEqual(use.input, { x: 1 });
    const after = await client.messages.create({
      model, max_tokens: 256, tools: [lookup],
      messages: [{ role: 'user', content: 'look up x' }, { role: 'assistant', content: m.content },
        { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '42' }] }],
    });
    assert.equal(after.stop_reason, 'end_turn');
    assert.equal(after.content[0].type, 'text');
  });

  await check(`tools stream via ${model}`, async () => {
    const m = await client.messages.stream({ model, max_tokens: 256, tools: [lookup], messages: [{ role: 'user', content: 'look up x' }] })
      .finalMessage();
    const use = m.content.find((b) => b.type === 'tool_use');
    assert.ok(use, JSON.stringify(m.content));
    assert.deepEqual(use.input, { x: 1 });
    assert.equal(m.stop_reason, 'tool_use');
  });
}

await check('stop_sequences: stop_reason "stop_sequence" and the sequence (create and stream)', async () => {
  const m = await client.messages.create({ model: models.anthropic, max_tokens: 256, messages: say, stop_sequences: ['w3'] });
  assert.equal(m.content[0].text, 'say hello w2 ');
  assert.equal(m.stop_reason, 'stop_sequence');
  assert.equal(m.stop_sequence, 'w3');
  const s = await client.messages.stream({ model: models.anthropic, max_tokens: 256, messages: say, stop_sequences: ['w3'] })
    .finalMessage();
  assert.equal(s.stop_reason, 'stop_sequence');
  assert.equal(s.stop_sequence, 'w3');
  assert.equal(s.content[0].text, 'say hello w2 ');
});

await check('max_tokens: stop_reason "max_tokens" from every upstream', async () => {
  for (const model of upstreamModels) {
    const m = await client.messages.create({ model, max_tokens: 3, messages: say });
    assert.equal(m.content[0].text, 'say hello w2', model);
    assert.equal(m.stop_reason, 'max_tokens', model);
  }
});

const city = {
  type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } }, required: ['city', 'days'], additionalProperties: false,
};
for (const model of upstreamModels) {
  await check(`output_config.format json_schema via ${model}`, async () => {
    const m = await client.messages.create({
      model, max_tokens: 256, messages: say, output_config: { format: { type: 'json_schema', schema: city } },
    });
    assert.deepEqual(JSON.parse(m.content[0].text), { city: 'say', days: 1 });
  });
}

await check('tool_choice.disable_parallel_tool_use reaches the Anthropic upstream', async () => {
  await client.messages.create({
    model: models.anthropicTools, max_tokens: 64, messages: say, tools: [lookup], tool_choice: { type: 'auto', disable_parallel_tool_use: true },
  });
  const sent = await lastUpstreamRequest('anthropic');
  assert.deepEqual(sent.json.tool_choice, { type: 'auto', disable_parallel_tool_use: true });
});

await check('error classes: AuthenticationError, NotFoundError, BadRequestError', async () => {
  const bad = new Anthropic({ apiKey: 'sk-keel-not-a-key', baseURL: env.gateway, maxRetries: 0 });
  const auth = await rejectsWith(bad.messages.create({ model: models.anthropic, max_tokens: 16, messages: say }), Anthropic.AuthenticationError, 401);
  assert.equal(auth.error?.type, 'error', JSON.stringify(auth.error));
  assert.equal(auth.error?.error?.type, 'authentication_error', JSON.stringify(auth.error));
  const nf = await rejectsWith(client.messages.create({ model: 'no-such-model', max_tokens: 16, messages: say }), Anthropic.NotFoundError, 404);
  assert.equal(nf.error?.error?.type, 'not_found_error', JSON.stringify(nf.error));
  const br = await rejectsWith(client.messages.create({ model: models.anthropic, messages: say }), Anthropic.BadRequestError, 400);
  assert.equal(br.error?.error?.type, 'invalid_request_error', JSON.stringify(br.error));
  await rejectsWith(client.messages.create({ model: 'no-such-model', max_tokens: 16, messages: say, stream: true }), Anthropic.NotFoundError, 404);
});

finish('anthropic');
